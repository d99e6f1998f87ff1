"""One module per ``rankscope`` subcommand (see ``rankscope.cli``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


def status_until_signal(every_s: float, line: Callable[[], str]) -> None:
    """Print ``line()`` every ``every_s`` seconds (never when 0) until SIGINT or SIGTERM:
    how a long-running command (``hub``, ``relay``) waits. The signal handlers are
    restored on the way out, so a caller that runs the command in its own process (a
    test, a script) keeps its Ctrl-C."""
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while not stop.wait(every_s if every_s > 0 else 3600):
            if every_s > 0:
                print(line(), flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
