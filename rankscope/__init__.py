"""rankscope: live monitor and diagnosis for distributed PyTorch training.

The in-rank API is re-exported here: ``import rankscope; mon = rankscope.start(...)``.
"""

from rankscope.version import __version__

__all__ = ["__version__"]
