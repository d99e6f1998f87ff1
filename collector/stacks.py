"""Stacks of a rank's own threads, taken from its background thread.

``python_stacks`` formats ``sys._current_frames()``: the training thread is not stopped or
touched (the background thread holds the GIL for the few microseconds a walk takes, as any
Python thread does between bytecodes). ``native_stacks`` runs py-spy on this process when it
is installed (native frames; it pauses the process for the few milliseconds of a dump, and
falls back to a non-pausing dump of Python frames); without py-spy it returns None.
``flight_recorder_dump`` takes the JSON dump of torch's Flight Recorder of this process
where the job enabled one (it never enables it), on a helper thread it waits for at most
``FR_TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import traceback
from typing import Any

from rankscope.collector.schema import MAX_FR_CHARS, MAX_STACK_CHARS

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


FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""Environment variables that enable torch's Flight Recorder (entries kept per process;
the second is the older NCCL-only name). Both are read by torch when a process group is
created, so they must be set in the job's environment."""
FR_TIMEOUT_S = 2.0
"""Longest the background thread waits for a Flight Recorder dump."""
_FR_DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
"""torch's JSON dump functions: NCCL's (CUDA builds; older torch) first, then the one of
every backend that records (gloo's on CPU)."""
_fr_busy = threading.Lock()


def flight_recorder_enabled() -> bool:
    """Whether this process has torch.distributed loaded and a Flight Recorder enabled."""
    if "torch.distributed" not in sys.modules:
        return False  # never import torch for it: a rank that does not use it has none
    for name in FR_ENV:
        try:
            if int(os.environ.get(name, "0") or 0) > 0:
                return True
        except ValueError:
            continue
    return False


def _note(text: str) -> str:
    return json.dumps({"entries": [], "rankscope_note": text})


def fit_dump(raw: str, limit: int = MAX_FR_CHARS) -> str:
    """A JSON dump within ``limit`` characters: as it is when it fits, else cut to its
    newest entries with a ``rankscope_note`` saying how many were left out.

    Args:
        raw: the dump's JSON text.
        limit: most characters.

    Returns:
        JSON text of at most ``limit`` characters (``rankscope.hub.importers.
        flight_recorder.load_dump`` reads it).
    """
    if len(raw) <= limit:
        return raw
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return _note(f"the dump of {len(raw)} characters is not JSON ({exc})")
    entries = obj.get("entries") if isinstance(obj, dict) else None
    if not isinstance(entries, list):
        return _note(f"the dump of {len(raw)} characters holds no entries list")
    rest = json.dumps({**obj, "entries": [], "rankscope_note": " " * 160})
    room = limit - len(rest)
    kept = 0
    for e in reversed(entries):  # the newest entries say where each rank stopped
        size = len(json.dumps(e)) + 2
        if size > room:
            break
        room -= size
        kept += 1
    note = (
        f"cut to the newest {kept} of {len(entries)} entries: the whole dump has "
        f"{len(raw)} characters, a heartbeat carries at most {limit}"
    )
    out = json.dumps({**obj, "entries": entries[len(entries) - kept :], "rankscope_note": note})
    return out if len(out) <= limit else _note(note + "; the rest of the dump does not fit")


def flight_recorder_dump(timeout_s: float = FR_TIMEOUT_S, limit: int = MAX_FR_CHARS) -> str | None:
    """The JSON dump of this process's Flight Recorder, when the job enabled one.

    Taken on a helper thread: the caller waits at most ``timeout_s`` (a dump waits for the
    recorder's lock), and while one dump is still running no other starts.

    Args:
        timeout_s: longest wait.
        limit: most characters returned (`fit_dump`).

    Returns:
        JSON text (the dump, cut to fit, or a map with ``entries: []`` and a
        ``rankscope_note`` saying why there is no dump), or None when no Flight Recorder
        is enabled.
    """
    if not flight_recorder_enabled():
        return None
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return None
    if not _fr_busy.acquire(blocking=False):
        return _note("an earlier Flight Recorder dump of this process has not returned")
    got: dict[str, Any] = {}

    def take() -> None:
        try:
            errors = []
            for name in _FR_DUMPS:
                fn = getattr(c10d, name, None)
                if fn is None:
                    continue
                try:
                    raw = fn()
                except Exception as exc:  # a backend without a recorder raises
                    errors.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                    continue
                text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
                if '"entries"' in text:
                    got["text"] = text
                    return
            got["text"] = _note(
                "the Flight Recorder holds no entry yet"
                + (": " + "; ".join(errors) if errors else "")
            )
        finally:
            _fr_busy.release()

    helper = threading.Thread(target=take, name="rankscope-fr-dump", daemon=True)
    helper.start()
    helper.join(timeout_s)
    text = got.get("text")
    if text is None:
        return _note(f"the Flight Recorder dump did not return within {timeout_s:.0f} s")
    return fit_dump(text, limit)
