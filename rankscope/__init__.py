"""rankscope: live monitor and diagnosis for distributed PyTorch training.

The in-rank API is re-exported here::

    import rankscope
    mon = rankscope.start(job="llm", job_config={"global_batch": 512})
    rankscope.instrument(ddp_model)
    for batch in loader:
        with mon.step():
            ...
            mon.work(tokens=n_tokens, attn_cost=sum_seq_sq)

The names load on first use, so ``import rankscope`` (and the CLI) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rankscope.version import __version__

if TYPE_CHECKING:
    from rankscope.collector.monitor import Monitor
    from rankscope.collector.runtime import close, current, instrument, start
    from rankscope.collector.shards import shard_of

_LAZY = {
    "start": "rankscope.collector.runtime",
    "close": "rankscope.collector.runtime",
    "current": "rankscope.collector.runtime",
    "instrument": "rankscope.collector.runtime",
    "Monitor": "rankscope.collector.monitor",
    "shard_of": "rankscope.collector.shards",
}

__all__ = ["Monitor", "__version__", "close", "current", "instrument", "shard_of", "start"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankscope' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
