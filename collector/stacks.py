"""Stacks of a rank's own threads, taken from its background thread.

``python_stacks`` formats ``sys._current_frames()``: the training thread is not stopped or
touched (the background thread holds the GIL for the few microseconds a walk takes, as any
Python thread does between bytecodes). ``native_stacks`` runs py-spy on this process when it
is installed (native frames; it pauses the process for the few milliseconds of a dump, and
falls back to a non-pausing dump of Python frames); without py-spy it returns None.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import traceback

from rankscope.collector.schema import MAX_STACK_CHARS

MAX_FRAMES = 64
"""Innermost frames kept per thread (a deep recursion is cut at the outer end)."""


def python_stacks(first: int | None = None, limit: int = MAX_STACK_CHARS) -> str:
    """Python stacks of every thread of this process, innermost frame last.

    Args:
        first: thread id listed first (the training thread), when known.
        limit: most characters returned (the end of a longer text is cut).

    Returns:
        One block per thread: ``Thread NAME (id N):`` then its frames.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda tid: (tid != first, names.get(tid, ""), tid))
    me = threading.get_ident()
    out: list[str] = []
    for tid in order:
        if tid == me:
            continue  # this thread's own stack says only that it is taking stacks
        label = "training thread " if tid == first else ""
        out.append(f"Thread {names.get(tid, '?')} ({label}id {tid}):\n")
        out.extend(traceback.format_stack(frames[tid], limit=MAX_FRAMES))
        out.append("\n")
    del frames
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 20] + "\n[... cut ...]\n"


def py_spy_path() -> str | None:
    """Where py-spy is installed, or None."""
    return shutil.which("py-spy")


def native_stacks(
    pid: int | None = None, timeout_s: float = 10.0, limit: int = MAX_STACK_CHARS
) -> str | None:
    """py-spy's dump of ``pid`` (this process by default) with native frames.

    Args:
        pid: process to dump.
        timeout_s: bound on py-spy's run.
        limit: most characters returned.

    Returns:
        The dump, a one-line error text when py-spy ran and failed, or None when py-spy is
        not installed.
    """
    exe = py_spy_path()
    if exe is None:
        return None
    target = os.getpid() if pid is None else int(pid)
    # Native frames need py-spy to pause the process for the few ms of the dump (a stuck
    # or stopped one loses nothing); where it cannot, a non-pausing dump of Python frames.
    text = ""
    for extra in (["--native"], ["--nonblocking"]):
        argv = [exe, "dump", "--pid", str(target), *extra]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (OSError, subprocess.SubprocessError) as exc:
            text += f"py-spy {' '.join(extra)} failed: {type(exc).__name__}: {exc}\n"
            continue
        if done.returncode == 0:
            return (text + done.stdout)[:limit]
        err = " | ".join((done.stderr or done.stdout).strip().splitlines()[:3])[:500]
        text += f"py-spy {' '.join(extra)} exit {done.returncode}: {err}\n"
    return text[:limit]
