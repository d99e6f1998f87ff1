"""Run a Textual app so that quitting never waits for a background computation.

Textual runs thread workers (a diagnosis pass, the ladder, a rerun plan, a snapshot) in the
event loop's default executor, and ``App.run`` ends with ``asyncio.run``, which joins that
executor: a ``q`` pressed during a long pass restores the terminal and then leaves it
blank until the pass ends (16 s measured after a ladder of a 512-rank demo), and the
interpreter joins a ``ThreadPoolExecutor``'s threads again at exit. `run_app` gives the app
a loop whose executor runs each worker in a daemon thread, and closes the loop without
waiting for them. What such a worker leaves unfinished is harmless: it only reads, or
writes beside the destination and renames when whole (snapshot bundles, experiment records).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class DaemonExecutor(ThreadPoolExecutor):
    """Runs every submitted call in a daemon thread of its own; ``shutdown`` never waits.

    A `ThreadPoolExecutor` only in name (asyncio accepts no other default executor): its
    pool is never used, so the interpreter has none of its threads to join at exit."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever awaits the future
                future.set_exception(exc)

        threading.Thread(target=call, name="rankscope-tui-worker", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to join: the workers' daemon threads end with the process."""


def run_app(app: Any, **kwargs: Any) -> Any:
    """Run ``app`` until it exits, leaving its unfinished thread workers behind.

    Args:
        app: a Textual ``App``.
        **kwargs: passed to ``App.run`` (``headless``, ``size``, ``auto_pilot``, ...).

    Returns:
        What ``App.run`` returns.
    """
    loop = asyncio.new_event_loop()
    loop.set_default_executor(DaemonExecutor())
    try:
        return app.run(loop=loop, **kwargs)
    finally:
        loop.close()  # shuts the executor down without waiting
