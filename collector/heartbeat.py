"""The heartbeat: a rank says it is alive, and where its training thread is.

The collector's background thread (`pump.Pump`) sends a ``beat`` message every
``BEAT_EVERY_S`` seconds whatever the training loop does, so the hub tells apart a rank that
is alive but has not entered a collective, one that entered and never left, and one whose
process is gone or frozen (no beat at all). Nothing is added to the training thread's hot
path: the beat reads what the hot path writes anyway (the open step and its start, the
newest step ended, the newest rows shipped), and finds the collective the training thread is
inside by looking at that thread's Python frames (``sys._current_frames``): a frame of the
torch collective wrapper holds the op, the group and the entry time in its locals, and the
group's next sequence number is the instance it is waiting in.

When the training thread's position has not changed for ``STACKS_AFTER_S`` seconds, the
beat carries its Python stacks once (py-spy's native ones too with
``RANKSCOPE_NATIVE_STACKS=1`` where py-spy is installed), and the JSON dump of torch's
Flight Recorder where the job enabled one (``TORCH_FR_BUFFER_SIZE``; the collector never
enables it, and waits at most ``stacks.FR_TIMEOUT_S`` for the dump):
the evidence of a hang is sent before any watchdog can end the process, without the hub
having to ask for it — a hub that must ask needs a request channel to every rank and a
round trip while the job may be dying. A stuck episode sends them once; progress re-arms.

Wire cost: one beat is ~196 bytes of msgpack (``benchmarks/bench_hangs.py``),
so ~196 B/s per rank; stacks add at most 2 × ``schema.MAX_STACK_CHARS`` and a Flight
Recorder dump at most ``schema.MAX_FR_CHARS`` once per stuck episode.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rankscope.collector import schema
from rankscope.collector.stacks import flight_recorder_dump, native_stacks, python_stacks

if TYPE_CHECKING:
    from rankscope.collector.monitor import Monitor
    from rankscope.collector.pump import Pump

BEAT_EVERY_S = 1.0
"""Seconds between two beats."""
STACKS_AFTER_S = 3.0
"""The training thread's position unchanged this long sends its stacks (once per episode)."""
SELF_NATIVE = os.environ.get("RANKSCOPE_NATIVE_STACKS") == "1"
"""Also run py-spy on this process for native frames when stuck (off by default: py-spy
pauses the process while it reads native stacks, which on a loaded host can outlast the
hub's heartbeat timeout; the hub takes them itself of the processes on its host)."""
_WRAPPERS = ("wrapper", "tensor_wrapper")
_NEVER = -(1 << 62)


def _collectives_file() -> str | None:
    mod = sys.modules.get("rankscope.collector.torch_collectives")
    return getattr(mod, "__file__", None) if mod is not None else None


def inside_collective(frame: Any, gids: Any = None) -> tuple[int, int, int] | None:
    """The collective a thread is inside, from its innermost frame.

    Args:
        frame: the thread's innermost frame (``sys._current_frames()[tid]``).
        gids: the wrapper's group table (read from the frame when None).

    Returns:
        ``(op index, group id, local entry ns)``, or None when no frame of the torch
        collective wrapper is on the stack (or its group is not known yet).
    """
    path = _collectives_file()
    if path is None:
        return None
    f = frame
    depth = 0
    while f is not None and depth < 256:
        code = f.f_code
        if code.co_name in _WRAPPERS and code.co_filename == path:
            loc = f.f_locals
            t0 = loc.get("t0")
            op = loc.get("op_i")
            if not isinstance(t0, int) or not isinstance(op, int):
                return None  # not yet past the entry stamp
            args = loc.get("args") or ()
            kwargs = loc.get("kwargs") or {}
            g_pos = loc.get("g_pos", -1)
            table = gids if gids is not None else loc.get("gids")
            group = kwargs.get("group") if "group" in kwargs else None
            if "group" not in kwargs and isinstance(g_pos, int) and 0 <= g_pos < len(args):
                group = args[g_pos]
            try:
                gid = table.get(group) if table is not None else None
            except TypeError:  # an unhashable group object
                gid = None
            return None if gid is None else (op, int(gid), t0)
        f = f.f_back
        depth += 1
    return None


class Heartbeat:
    """Builds and sends one rank's beats; runs on the pump's thread only."""

    def __init__(self, mon: Monitor, pump: Pump) -> None:
        self.mon = mon
        self.pump = pump
        self.every_ns = int(BEAT_EVERY_S * 1e9)
        self.stacks_after_ns = int(STACKS_AFTER_S * 1e9)
        self.next_ns = 0
        """Local monotonic time the next beat is due."""
        self.sent = 0
        self.bytes = 0
        """Beats sent and their bytes (the wire cost)."""
        self.stacks_sent = 0
        self.fr_sent = 0
        """Flight Recorder dumps sent (one per stuck episode where one is enabled)."""
        self.exit_t = -1
        """Latest collective exit shipped (local ns; `note_shipped`)."""
        self.ended_t = -1
        """Latest step end shipped (local ns)."""
        self._pos: tuple[int, ...] = ()
        self._pos_since = 0
        self._stacks_done = False

    def note_shipped(self, step_ends: Any, coll_exits: Any) -> None:
        """The pump shipped these rows (local ns columns): keep their latest times."""
        if len(step_ends):
            self.ended_t = max(self.ended_t, int(step_ends.max()))
        if len(coll_exits):
            self.exit_t = max(self.exit_t, int(coll_exits.max()))

    def _train_thread(self) -> int:
        tid = self.mon._step_thread
        return tid if tid else (threading.main_thread().ident or 0)

    def position(self, now: int) -> tuple[dict[str, int], int]:
        """The training thread's position now (local clock; converted on sending).

        Returns:
            (the ``pos`` map in local ns, the training thread's id).
        """
        mon = self.mon
        tid = self._train_thread()
        open_ = mon._open
        ended = mon._last_ended
        frame = sys._current_frames().get(tid)
        where = inside_collective(frame) if frame is not None else None
        del frame
        cpu = -1
        try:
            cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(tid))
        except (OSError, AttributeError, OverflowError):
            pass
        pos = {
            "t": now,
            "step": mon._step if open_ else -1,
            "step_t0": mon._t_step if open_ else -1,
            "ended": ended if ended != _NEVER else -1,
            "ended_t": self.ended_t,
            "exit_t": self.exit_t,
            "group": -1,
            "seq": -1,
            "op": -1,
            "since": -1,
            "cpu_ns": cpu,
        }
        if where is not None:
            op, gid, t0 = where
            pos.update(group=gid, seq=mon._seq.get(gid, 0), op=op, since=t0)
        return pos, tid

    def beat(self, now: int, final: bool = False) -> None:
        """Send one beat (with stacks when the training thread is stuck)."""
        self.next_ns = now + self.every_ns
        pos, tid = self.position(now)
        key = (pos["step"], pos["ended"], pos["group"], pos["seq"], pos["ended_t"], pos["exit_t"])
        if key != self._pos:
            self._pos = key
            self._pos_since = now
            self._stacks_done = False
        stacks = None
        if not final and not self._stacks_done and now - self._pos_since >= self.stacks_after_ns:
            self._stacks_done = True
            stuck = (now - self._pos_since) / 1e9
            stacks = {"py": python_stacks(first=tid), "why": f"no progress for {stuck:.1f} s"}
            if SELF_NATIVE:
                native = native_stacks(timeout_s=3.0)
                if native is not None:
                    stacks["native"] = native
            fr = flight_recorder_dump()
            if fr is not None:
                stacks["fr"] = fr
                self.fr_sent += 1
            self.stacks_sent += 1
        to_hub = self.pump.clock.to_hub
        for key_t in ("t", "step_t0", "ended_t", "exit_t", "since"):
            if pos[key_t] >= 0:
                pos[key_t] = max(0, to_hub(pos[key_t]))
        error = None
        if final:
            # Set by the interpreter for an exception that ended the program.
            exc = getattr(sys, "last_value", None)
            if exc is not None:
                error = f"{type(exc).__name__}: {exc}"[: schema.MAX_NAME_CHARS]
        data = schema.beat_message(
            self.pump._header(),
            pos,
            state="exit" if final else "run",
            stacks=stacks,
            error=error,
        )
        self.pump._send(data)
        self.sent += 1
        self.bytes += len(data)
