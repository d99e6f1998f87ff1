"""The one error a command raises for what the user gave it.

A missing recording, an unknown run, a bad option value, an unreadable file: the command
raises `CommandError` with a message that names what was wrong, and ``rankscope.cli.main``
prints it as one line, ``rankscope: error: ...``, and exits 2. Anything else that escapes a
command is a bug in rankscope and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CommandError"]


class CommandError(Exception):
    """What a command was given cannot be used; the message says what and why."""
