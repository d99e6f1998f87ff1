"""The hub's hang watch: judge every run from its heartbeats, capture the evidence once.

A `HangWatch` thread judges each run about once a second (`diagnosis.stall.judge_hang`).
The first time a run is stalled it writes one bundle — before any NCCL or gloo watchdog
ends the job — and runs the user's ``--on-stall`` hook with the bundle's path. The bundle
is a snapshot bundle (`rankscope.snapshot`: ``rankscope report DIR`` and ``rankscope open
DIR`` read it; ``snapshot.md`` leads with the stall) with a ``hang/`` part:

```
hang-<run>-<utc>/
  snapshot.md            the stall first (culprit, case, what the others wait in, links to
                         the stacks), then the snapshot of the last steps
  snapshot.json          the same, machine-readable (``hang`` holds the verdict and files)
  screen.svg / .png      the report as a screen
  window/                the raw recording of the last steps and each rank's latest beat
                         (when the hub records): ``rankscope open DIR``
  manifest.json, manifests/
  hang/verdict.json      the verdict: case, culprits (rank, host, group, op, seq), waiting
  hang/stacks-r<N>.txt   Python stacks the culprit and one waiting rank sent (their
                         collectors take them from their background threads)
  hang/native-r<N>.txt   py-spy's native stacks, where py-spy is installed (the rank's own,
                         or the hub's dump of a process on the hub's host: a stopped one too)
  hang/proc-r<N>.txt     /proc/<pid>/status and wchan of a process on the hub's host (says
                         "T (stopped)" of a SIGSTOPped rank, or that the process is gone)
  hang/flight_recorder/rank_<N>.json
                         each rank's Flight Recorder dump, sent with its stacks where the
                         job enabled one (``rankscope import flight-recorder`` reads them);
                         without any, ``hang/flight_recorder`` is a text saying how to
                         enable it
  hang/steps.json        the last window of steps as the live store holds them
```

``hang/`` is written first; the snapshot around it follows. A diagnosis of the hung window
that fails or outlasts ``DIAGNOSIS_BUDGET_S`` leaves the bundle without it (``snapshot.md``
says why), and a snapshot that cannot be written at all leaves ``hang/`` with a
``snapshot.md`` that says what failed. Everything runs on the watch's thread, never the
hub's ingest (it reads the store under its lock for the few ms a window takes).

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

from rankscope.collector.stacks import FR_ENV, native_stacks
from rankscope.diagnosis.baseline import job_step_ns
from rankscope.diagnosis.stall import STALL_S, Hang, judge_hang
from rankscope.sanitize import for_filename

log = logging.getLogger("rankscope.hub")

WATCH_EVERY_S = 1.0
"""Seconds between two judgements of every run."""
BUNDLE_GRACE_S = 10.0
"""After a stall is flagged, the bundle waits at most this long for the stacks of the ranks
it holds (collectors send them a few seconds into a stuck episode)."""
HOOK_TIMEOUT_S = 300.0
"""Longest the ``--on-stall`` hook may run before it is killed."""
DIAGNOSIS_BUDGET_S = 20.0
"""Longest the bundle waits for the diagnosis of the hung window (on a helper thread); the
bundle is written without it past that."""
FR_HOWTO = f"""no Flight Recorder dump: no rank of this run sent one.

torch's Flight Recorder keeps each process's last collectives. Enable it in the job's
environment (read when a process group is created; the collector never enables it):

  gloo and NCCL:  {FR_ENV[0]}=2000      (entries kept per process)
  NCCL, older torch:  {FR_ENV[1]}=2000
  NCCL watchdog's own dumps at its timeout: TORCH_FR_DUMP_TEMP_FILE=/path/prefix_
    (older: TORCH_NCCL_DEBUG_INFO_TEMP_FILE)

Each rank's collector then sends its dump (JSON, cut to its newest entries past 256 KiB)
with its stacks when it is stuck, and the next bundle holds hang/flight_recorder/
rank_<N>.json: rankscope import flight-recorder DIR/hang/flight_recorder --record REC
"""


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
        recording: str | Path | None = None,
        flush: Any = None,
        diagnosis_budget_s: float = DIAGNOSIS_BUDGET_S,
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
            recording: the hub's recording directory, for the bundle's ``window/``
                (None: a hub that does not record; the bundle says so).
            flush: the hub recorder's ``flush``, called before ``window/`` is copied.
            diagnosis_budget_s: longest wait for the diagnosis of the hung window.
        """
        self.store = store
        self.out_dir = Path(out_dir)
        self.hook = shlex.split(on_stall) if on_stall else None
        self.stall_s = stall_s
        self.every_s = every_s
        self.clock = clock
        self.recording = recording
        self.flush = flush
        self.diagnosis_budget_s = diagnosis_budget_s
        self.last_bundle_s = float("nan")
        """Seconds the latest bundle took to write (evidence, diagnosis and snapshot)."""
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
        """Write the evidence of ``hang`` in run ``run_id`` as a snapshot bundle with a
        ``hang/`` part; returns the bundle's path.

        The evidence (``hang/``) is written first; the snapshot around it (diagnosis of the
        window, ``window/``, ``snapshot.md``...) follows, and whatever goes wrong there is
        caught and said in ``snapshot.md``: the evidence is never lost to it.
        """
        began = time.perf_counter()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(hang.now_ns / 1e9))
        root = _fresh(self.out_dir / f"hang-{for_filename(run_id, max_len=80)}-{stamp}")
        part = root / "hang"
        part.mkdir(parents=True)
        run = self.store.run_state(run_id)
        section = self._write_evidence(run_id, run, hang, part)
        section["written_s"] = round(time.perf_counter() - began, 3)
        try:
            self._write_snapshot(root, run_id, run, hang, section)
        except Exception as exc:  # evidence first: the part stays, a note says what failed
            log.exception("hang bundle %s: the snapshot could not be written", root)
            _write_bare(root, run, section, f"the snapshot could not be written: {exc!r}")
        self.last_bundle_s = time.perf_counter() - began
        log.info("hang bundle %s written in %.2f s", root, self.last_bundle_s)
        return root

    def _write_evidence(self, run_id: str, run: Any, hang: Hang, part: Path) -> dict[str, Any]:
        """``hang/``: verdict, stacks, native stacks, process status, Flight Recorder dumps,
        the last window of steps. Returns the snapshot's ``hang`` section."""
        files: dict[str, str] = {}

        def put(key: str, name: str, text: str) -> None:
            (part / name).write_text(text)
            files[key] = f"hang/{name}"

        verdict = {"run": run_id, "job": run.job, **hang.to_dict()}
        put("verdict", "verdict.json", json.dumps(verdict, indent=2) + "\n")
        here = socket.gethostname()
        stacks = dict(run.beats.stacks)
        for r in _evidence_ranks(hang):
            got = stacks.get(r)
            if got and got.get("py"):
                put(
                    f"stacks:r{r}",
                    f"stacks-r{r}.txt",
                    f"# rank {r}: {got.get('why', '')}\n" + got["py"],
                )
            if got and got.get("native"):
                put(f"native:r{r}", f"native-r{r}.txt", got["native"])
            ident = run.identities.get(r, {})
            pid = ident.get("pid")
            if ident.get("host") == here and isinstance(pid, int) and pid > 0:
                put(f"proc:r{r}", f"proc-r{r}.txt", _proc_status(pid))
                if f"native:r{r}" not in files:
                    native = native_stacks(pid, timeout_s=5.0)
                    if native is not None:
                        put(f"native:r{r}", f"native-r{r}.txt", native)
        fr = _write_flight_recorder(part, stacks, hang, run)
        files.update({f"fr:r{r}": rel for r, rel in fr["dumps"].items()})
        if not fr["dumps"]:
            files["fr_note"] = "hang/flight_recorder"
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
        put("steps", "steps.json", json.dumps(steps) + "\n")
        return {
            "verdict": verdict,
            "files": files,
            "flight_recorder": fr,
            "diagnosis_note": None,
        }

    def _write_snapshot(
        self, root: Path, run_id: str, run: Any, hang: Hang, section: dict[str, Any]
    ) -> None:
        """The snapshot around the ``hang/`` part: the same writer as ``rankscope snapshot``."""
        from rankscope.snapshot import DEFAULT_STEPS, View, take_snapshot

        try:
            window = self.store.window(run_id, last=DEFAULT_STEPS)
        except (KeyError, ValueError) as exc:
            _write_bare(root, run, section, f"no window of steps to snapshot: {exc!r}")
            return
        if window.steps.size:
            diagnosis, note = _diagnose(window, self.diagnosis_budget_s)
        else:  # hung in its first step: the snapshot holds the ranks and their last beats
            diagnosis, note = {}, "no step was complete: nothing to diagnose but the stall"
        section["diagnosis_note"] = note
        pins = tuple(c.rank for c in hang.culprits[:8] if 0 <= c.rank < window.world_size)
        take_snapshot(
            root,
            window,
            recording=self.recording,
            diagnosis=diagnosis,
            view=View(run=run_id, pins=pins),
            screen_svg=_report_svg,
            created_ns=hang.now_ns,
            flush=self.flush,
            hang=section,
            part=section["files"],
        )


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


def _fresh(root: Path) -> Path:
    """``root``, or ``root-2``, ``root-3``... when a bundle of the same second exists."""
    out, n = root, 1
    while out.exists():
        n += 1
        out = root.with_name(f"{root.name}-{n}")
    return out


def _write_flight_recorder(
    part: Path, stacks: dict[int, dict[str, Any]], hang: Hang, run: Any
) -> dict[str, Any]:
    """``hang/flight_recorder/rank_<N>.json`` of every rank that sent a dump in this stuck
    episode, or the ``hang/flight_recorder`` text saying how to enable one.

    Returns:
        ``dumps`` (rank -> path in the bundle) and ``note`` (what is missing, or None).
    """
    dumps: dict[int, str] = {}
    bad: list[str] = []
    since = hang.last_progress_ns
    for r in sorted(stacks):
        got = stacks[r]
        text = got.get("fr")
        if not text or (since >= 0 and got.get("t", -1) < since):
            continue
        try:
            doc = json.loads(text)
        except ValueError as exc:
            bad.append(f"rank {r}: not JSON ({exc})")
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
            bad.append(f"rank {r}: not a Flight Recorder dump (no entries list)")
            continue
        if not doc["entries"]:
            bad.append(f"rank {r}: {doc.get('rankscope_note') or 'no entry'}")
            continue
        folder = part / "flight_recorder"
        folder.mkdir(exist_ok=True)
        (folder / f"rank_{r}.json").write_text(text)
        dumps[r] = f"hang/flight_recorder/rank_{r}.json"
    note = "; ".join(bad) if bad else None
    if not dumps:
        nccl = any("nccl" in str(g.get("backend")) for g in list(run.groups.values()))
        head = f"sent but not usable: {note}\n\n" if note else ""
        (part / "flight_recorder").write_text(
            head + FR_HOWTO + ("" if nccl else "\n(this run's groups do not use NCCL)\n")
        )
        note = note or f"none sent: enable it with {FR_ENV[0]} (see hang/flight_recorder)"
    return {"dumps": {str(r): rel for r, rel in dumps.items()}, "note": note}


def _diagnose(window: Any, budget_s: float) -> tuple[dict[str, Any], str | None]:
    """The window's diagnosis as ``serialize.to_dict`` data, on a helper thread waited for
    at most ``budget_s``; a failure or a timeout gives an empty diagnosis and why."""
    from rankscope.diagnosis.engine import diagnose
    from rankscope.diagnosis.serialize import to_dict

    got: dict[str, Any] = {}

    def run() -> None:
        began = time.perf_counter()
        try:
            got["diagnosis"] = to_dict(diagnose(window))
        except Exception as exc:
            got["error"] = exc
        got["s"] = time.perf_counter() - began

    helper = threading.Thread(target=run, name="rankscope-hang-diagnosis", daemon=True)
    helper.start()
    helper.join(budget_s)
    if "diagnosis" in got:
        return got["diagnosis"], None
    if "error" in got:
        exc = got["error"]
        log.warning("hang bundle: the diagnosis of the hung window failed: %r", exc)
        why = f"the diagnosis of the hung window failed ({type(exc).__name__}: {exc})"
    else:
        why = f"the diagnosis of the hung window did not finish within {budget_s:g} s"
    return {}, why + "; the evidence is complete: run rankscope diagnose on the recording"


def _report_svg(content: dict[str, Any]) -> str:
    from rankscope.commands.report import render_svg  # rich, only when a bundle is written

    return render_svg(content)


def _write_bare(root: Path, run: Any, section: dict[str, Any], why: str) -> None:
    """What a bundle holds when no snapshot could be written around ``hang/``: the manifest
    and a ``snapshot.md`` with the stall and why the rest is missing."""
    from rankscope.sanitize import for_markdown
    from rankscope.snapshot_markdown import stall_md

    section["diagnosis_note"] = why
    try:
        manifest = run.manifest()
    except Exception as exc:
        manifest = {"error": repr(exc)}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    head = f"# rankscope stall — {for_markdown(run.job)} / {for_markdown(run.run)}\n\n"
    (root / "snapshot.md").write_text(head + "\n".join(stall_md(section)))
