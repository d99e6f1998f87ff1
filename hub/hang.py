"""The hub's hang watch: judge every run from its heartbeats, capture the evidence once.

A `HangWatch` thread judges each run about once a second (`diagnosis.stall.judge_hang`).
The first time a run is stalled it writes one bundle — before any NCCL or gloo watchdog
ends the job — and runs the user's ``--on-stall`` hook with the bundle's path:

```
hang-<run>-<utc>/
  hang/verdict.json      the verdict: case, culprits (rank, host, group, op, seq), waiting
  hang/stacks-r<N>.txt   Python stacks the culprit and one waiting rank sent (their
                         collectors take them from their background threads)
  hang/native-r<N>.txt   py-spy's native stacks, where py-spy is installed (the rank's own,
                         or the hub's dump of a process on the hub's host: a stopped one too)
  hang/proc-r<N>.txt     /proc/<pid>/status and wchan of a process on the hub's host (says
                         "T (stopped)" of a SIGSTOPped rank, or that the process is gone)
  hang/flight_recorder   what torch's NCCL Flight Recorder says, or why there is none
  steps.json             the last window of steps (per rank start and end)
  manifest.json          the run's manifest
```

When progress resumes the run is re-armed: a later stall writes a new bundle.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector.stacks import native_stacks
from rankscope.diagnosis.baseline import job_step_ns
from rankscope.diagnosis.stall import STALL_S, Hang, judge_hang

log = logging.getLogger("rankscope.hub")

WATCH_EVERY_S = 1.0
"""Seconds between two judgements of every run."""
BUNDLE_GRACE_S = 10.0
"""After a stall is flagged, the bundle waits at most this long for the stacks of the ranks
it holds (collectors send them a few seconds into a stuck episode)."""
HOOK_TIMEOUT_S = 300.0
"""Longest the ``--on-stall`` hook may run before it is killed."""


@dataclass
class HangRecord:
    """What the watch knows of one run."""

    hang: Hang
    bundle: str | None = None
    """Path of the bundle of the current stall (None while not stalled)."""
    first_named_ns: int = -1
    """Hub clock when the current stall's culprit was first named."""


def run_inputs(store: Any, run_id: str) -> tuple[dict[str, np.ndarray], np.ndarray, dict, dict]:
    """What `judge_hang` needs of one run of ``store``: beats, step times, groups, hosts."""
    run = store.run_state(run_id)
    beats = run.beats.copy()
    try:
        window = store.window(run_id, last=32)
        step = job_step_ns(window)
    except (KeyError, ValueError):
        step = np.zeros(0)
    groups = {
        int(g["id"]): (tuple(int(r) for r in g["ranks"]), str(g.get("name") or f"group{g['id']}"))
        for g in list(run.groups.values())
    }
    hosts = {int(r): str(i.get("host", "")) for r, i in list(run.identities.items())}
    return beats, np.asarray(step, np.float64), groups, hosts


def judge_run(store: Any, run_id: str, now_ns: int, stall_s: float = STALL_S) -> Hang:
    """`judge_hang` of one run of ``store`` at ``now_ns`` (hub clock)."""
    beats, step, groups, hosts = run_inputs(store, run_id)
    return judge_hang(beats, now_ns, step, groups, hosts, stall_s=stall_s)


class HangWatch:
    """Judges every run of a store on its own thread; writes a bundle at each new stall."""

    def __init__(
        self,
        store: Any,
        out_dir: str | Path,
        *,
        on_stall: str | None = None,
        stall_s: float = STALL_S,
        every_s: float = WATCH_EVERY_S,
        clock: Any = time.time_ns,
    ) -> None:
        """Configure; `start` launches the thread.

        Args:
            store: the hub's live store.
            out_dir: where bundles go.
            on_stall: a command line (split with ``shlex.split``, never run by a shell)
                run with the bundle's path as its last argument.
            stall_s: floor of the stall threshold.
            every_s: seconds between two judgements.
            clock: the hub clock (ns).
        """
        self.store = store
        self.out_dir = Path(out_dir)
        self.hook = shlex.split(on_stall) if on_stall else None
        self.stall_s = stall_s
        self.every_s = every_s
        self.clock = clock
        self.records: dict[str, HangRecord] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hooks: list[subprocess.Popen] = []

    def start(self) -> HangWatch:
        self._thread = threading.Thread(target=self._loop, name="rankscope-hang", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def check(self) -> dict[str, HangRecord]:
        """Judge every run once (the thread's pass; tests call it directly)."""
        now = int(self.clock())
        for run_id in list(self.store.run_ids()):
            try:
                run = self.store.run_state(run_id)
                if run is None or not run.beats.count:
                    continue
                hang = judge_run(self.store, run_id, now, self.stall_s)
                rec = self.records.get(run_id)
                if rec is None:
                    rec = self.records[run_id] = HangRecord(hang)
                rec.hang = hang
                if not hang.stalled:
                    rec.bundle = None
                    rec.first_named_ns = -1
                    continue
                if rec.bundle is None:
                    if rec.first_named_ns < 0:
                        rec.first_named_ns = now
                    waited = (now - rec.first_named_ns) / 1e9
                    if waited >= BUNDLE_GRACE_S or _stacks_in(run, hang):
                        rec.bundle = str(self.write_bundle(run_id, hang))
                        self._run_hook(rec.bundle)
            except Exception as exc:  # one bad run must not stop the watch
                self.errors += 1
                if self.errors == 1:
                    log.exception("hang watch failed on run %s: %r", run_id, exc)
        return self.records

    def _run_hook(self, bundle: str) -> None:
        if not self.hook:
            return
        try:
            proc = subprocess.Popen([*self.hook, bundle], stdin=subprocess.DEVNULL)
        except OSError as exc:
            log.warning("--on-stall hook %s could not start: %s", self.hook[0], exc)
            return
        self.hooks.append(proc)
        threading.Timer(HOOK_TIMEOUT_S, _kill_if_running, (proc,)).start()

    def write_bundle(self, run_id: str, hang: Hang) -> Path:
        """Write the evidence of ``hang`` in run ``run_id``; returns the bundle's path."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(hang.now_ns / 1e9))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:80]
        root = self.out_dir / f"hang-{safe}-{stamp}"
        part = root / "hang"
        part.mkdir(parents=True, exist_ok=True)
        run = self.store.run_state(run_id)
        verdict = {"run": run_id, "job": run.job, **hang.to_dict()}
        (part / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
        ranks = [c.rank for c in hang.culprits[:4]]
        waiter = next((w.rank for w in hang.waiting if w.rank not in ranks and w.group >= 0), None)
        if waiter is not None:
            ranks.append(waiter)
        here = socket.gethostname()
        for r in ranks:
            got = run.beats.stacks.get(r)
            if got:
                head = f"# rank {r}: {got.get('why', '')}\n"
                (part / f"stacks-r{r}.txt").write_text(head + got.get("py", ""))
                if got.get("native"):
                    (part / f"native-r{r}.txt").write_text(got["native"])
            ident = run.identities.get(r, {})
            pid = ident.get("pid")
            if ident.get("host") == here and isinstance(pid, int) and pid > 0:
                (part / f"proc-r{r}.txt").write_text(_proc_status(pid))
                if not (part / f"native-r{r}.txt").exists():
                    native = native_stacks(pid, timeout_s=5.0)
                    if native is not None:
                        (part / f"native-r{r}.txt").write_text(native)
        (part / "flight_recorder").write_text(
            "no Flight Recorder: this run's groups do not use torch's NCCL backend\n"
            if not any("nccl" in str(g.get("backend")) for g in run.groups.values())
            else "Flight Recorder: set TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_"
            "TEMP_FILE in the job; its dumps are written by each rank at the watchdog\n"
        )
        try:
            w = self.store.window(run_id, last=32)
            steps = {
                "steps": [int(s) for s in w.steps],
                "t0_ns": int(w.t0_ns),
                "t_start_ns": _plain(w.t_start),
                "t_end_ns": _plain(w.t_end),
            }
        except (KeyError, ValueError) as exc:
            steps = {"error": repr(exc)}
        (root / "steps.json").write_text(json.dumps(steps) + "\n")
        (root / "manifest.json").write_text(json.dumps(run.manifest(), indent=2, default=str))
        return root


def _evidence_ranks(hang: Hang) -> list[int]:
    """The culprits (at most four) and one rank waiting inside a collective."""
    ranks = [c.rank for c in hang.culprits[:4]]
    waiter = next((w.rank for w in hang.waiting if w.rank not in ranks and w.group >= 0), None)
    if waiter is not None:
        ranks.append(waiter)
    return ranks


def _stacks_in(run: Any, hang: Hang) -> bool:
    """Whether every live rank of the evidence sent stacks in this stuck episode."""
    gone = {c.rank for c in hang.culprits if c.case == "gone"}
    for r in _evidence_ranks(hang):
        got = run.beats.stacks.get(r)
        if r not in gone and (got is None or got["t"] < hang.last_progress_ns):
            return False
    return True


def _plain(a: np.ndarray) -> list[list[float | None]]:
    return [[float(v) if np.isfinite(v) else None for v in row] for row in np.asarray(a, float)]


def _proc_status(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as exc:
        return f"process {pid}: not readable ({exc.strerror}): gone\n"
    keep = [line for line in status.splitlines() if line.split(":")[0] in ("Name", "State", "Pid")]
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = "?"
    return "\n".join([*keep, f"wchan:\t{wchan}"]) + "\n"


def _kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.kill(proc.pid, 9)
        except OSError:
            pass
