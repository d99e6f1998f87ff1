"""`rankscope.tui.runner.run_app`: quitting does not wait for a thread worker still busy
(a long diagnosis or ladder pass), and the worker's thread does not keep the process up."""

from __future__ import annotations

import threading

from textual import work
from textual.app import App

from rankscope.tui.runner import run_app

HANG_S = 120
"""Longer than this is a hang (a detector, not a timing claim)."""


class _Busy(App[None]):
    """Starts a thread worker that runs until released, then quits."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release
        self.started = threading.Event()
        self.worker_thread: threading.Thread | None = None

    def on_mount(self) -> None:
        self.busy()

    @work(thread=True)
    def busy(self) -> None:
        self.worker_thread = threading.current_thread()
        self.started.set()
        self.release.wait(HANG_S)


def test_quit_leaves_a_busy_thread_worker_behind() -> None:
    release = threading.Event()
    app = _Busy(release)

    async def quit_once_busy(pilot) -> None:
        while not app.started.is_set():
            await pilot.pause(0.02)
        await pilot.press("ctrl+q")

    done = threading.Event()
    runner = threading.Thread(
        target=lambda: (run_app(app, headless=True, auto_pilot=quit_once_busy), done.set()),
        daemon=True,
    )
    runner.start()
    try:
        runner.join(HANG_S / 2)
        assert done.is_set(), "run_app waited for the busy worker"
        worker = app.worker_thread
        assert worker is not None and worker.is_alive() and worker.daemon
    finally:
        release.set()
