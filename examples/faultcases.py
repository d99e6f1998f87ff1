"""Real faults in real torch jobs, each with the answer rankscope should give.

Each case is a run of ``examples/faultjobs.py`` under ``torchrun`` (gloo, CPU, one thread
per rank) reporting to a rankscope hub through the collector, with one fault made for
real: host time outside every phase, a CPU quota or a busy neighbour on the rank's core, a
full garbage collection over many live objects, a pipeline stage with more layers, a slow
warm-up. Where a healthy run of the same job is a meaningful baseline, it is run too (once
per hub: the DDP cases share it). The runs go through `incidents.run_local` and land in the
hub's store under fixed run ids, so a case already run into a hub is read back, not rerun.

    python examples/faultcases.py gap --record /tmp/rec      # one case, diagnosed and printed
    python examples/faultcases.py all --record /tmp/rec

The interface the tests and ``rankscope eval --real`` use:

    from faultcases import CASES, run_case
    window, baseline, truth = run_case("gap", hub)   # truth: mechanism, ranks[, stage]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import incidents  # noqa: E402
from incidents import RunSpec, WorkloadError, local_hub, run_local, settled_window  # noqa: E402

WORKLOAD = HERE / "faultjobs.py"
JOB = "faultjobs"
STEPS = 24
WARMUP = 4
"""Leading steps left out of the windows (autograd and allocator warm-up), except where
the warm-up is the case."""

THROTTLE_QUOTA = 0.25
"""CPU share of one core the throttled rank's process gets (cgroup quota)."""
THROTTLE_PERIOD_US = 5_000
"""Quota period. Short, so the throttling is spread over each step rather than one stall,
and so the quota (1.25 ms; 1 ms is the kernel's least) is shorter than a forward or
backward pass of this job (~2-3 ms of CPU): with a 10 ms period, a pass that began on a
fresh quota ran through unthrottled, and whether the forward slowed varied from run to
run."""
SPIN_NICE = -10
"""Niceness of the busy neighbour on the shared core. At equal weight the scheduler lets
a rank that keeps waking from collectives run ahead of a process that never sleeps, and
the rank hardly slows; at -10 (about 9x the weight) it gets about a tenth of the core
whenever both want it."""


@dataclass(frozen=True)
class Case:
    """One fault, the runs that show it, and the mechanism rankscope should name.

    Attributes:
        name: short name (the key in `CASES`).
        title: one line for reports.
        flags: ``faultjobs.py`` arguments of the run under study.
        baseline: arguments of its healthy baseline run; None: no baseline is meaningful.
        mechanism: the verdict's expected top mechanism.
        ranks: the ranks it should implicate (empty for ``healthy``).
        stage: the pipeline stage it should implicate, where there is one.
        nproc: ranks.
        steps: steps per run.
        warmup: leading steps left out of the windows.
        throttle: the run needs a CPU quota or a shared busy core for ``ranks[0]``.
        alternatives: other mechanisms that would also be a right answer on this evidence
            (a catalogued host-side mechanism for host time outside the phases).
        warmup_steps: leading steps of the window that are warm-up, where the case is
            about warm-up.
    """

    name: str
    title: str
    flags: tuple[str, ...]
    baseline: tuple[str, ...] | None
    mechanism: str
    ranks: tuple[int, ...]
    stage: int | None = None
    nproc: int = 2
    steps: int = STEPS
    warmup: int = WARMUP
    throttle: bool = False
    alternatives: tuple[str, ...] = ()
    warmup_steps: int | None = None

    def truth(self) -> dict[str, Any]:
        """What the diagnosis should say: ``mechanism``, ``ranks`` and, where they apply,
        ``stage``, ``alternatives`` and ``warmup_steps``."""
        out: dict[str, Any] = {"mechanism": self.mechanism, "ranks": self.ranks}
        if self.stage is not None:
            out["stage"] = self.stage
        if self.alternatives:
            out["alternatives"] = self.alternatives
        if self.warmup_steps is not None:
            out["warmup_steps"] = self.warmup_steps
        return out

    def spec(self, role: str) -> RunSpec:
        """The run of one role: ``fault`` (the run under study) or ``baseline``."""
        if role == "fault":
            return RunSpec(
                f"fj-{self.name}", self.flags, self.nproc, self.steps, script=WORKLOAD, job=JOB
            )
        if self.baseline is None:
            raise ValueError(f"case {self.name} has no baseline run")
        # Runs with the same flags share one id, hence one run in a hub.
        tag = re.sub(r"[^A-Za-z0-9]+", "-", " ".join(self.baseline)).strip("-") or "none"
        return RunSpec(
            f"fj-baseline-{self.nproc}r-{tag}",
            self.baseline,
            self.nproc,
            self.steps,
            script=WORKLOAD,
            job=JOB,
        )


HEALTHY = ("--fault=none",)
CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            name="gap",
            title="rank 1 sleeps 25 ms after every optimizer step, outside any phase",
            flags=("--fault=gap", "--fault-rank=1", "--gap-ms=25"),
            baseline=HEALTHY,
            mechanism="unexplained_straggler",
            ranks=(1,),
            alternatives=("host_pause",),
        ),
        Case(
            name="throttle",
            title=f"rank 0's process gets {THROTTLE_QUOTA:.0%} of a core (a CPU quota), or shares "
            "its core with a spinning process",
            flags=("--fault=throttle", "--fault-rank=0"),
            baseline=HEALTHY,
            mechanism="cpu_contention",
            ranks=(0,),
            throttle=True,
        ),
        Case(
            name="gc",
            title="rank 1 runs a full gc.collect() over 800k live lists every 4th step",
            flags=("--fault=gc", "--fault-rank=1", "--gc-every=4", "--gc-objects=800000"),
            baseline=HEALTHY,
            mechanism="host_pause",
            ranks=(1,),
        ),
        Case(
            name="data",
            title="rank 1 reads a shard whose batches hold twice as many samples",
            flags=("--fault=data", "--fault-rank=1", "--shard-scale=2"),
            baseline=HEALTHY,
            mechanism="data_imbalance",
            ranks=(1,),
        ),
        Case(
            name="input",
            title="rank 1's data loader waits 20 ms for every batch",
            flags=("--fault=input", "--fault-rank=1", "--input-ms=20"),
            baseline=HEALTHY,
            mechanism="slow_host_input",
            ranks=(1,),
        ),
        Case(
            name="slow",
            title="rank 1's forward pass computes 15 ms longer every step (a slower device)",
            flags=("--fault=slow", "--fault-rank=1", "--slow-ms=15", "--slow-kind=busy"),
            baseline=HEALTHY,
            # Two CPU ranks and no device telemetry: no spread to call a device slow by.
            mechanism="unexplained_straggler",
            ranks=(1,),
            alternatives=("slow_device",),
        ),
        Case(
            name="blocked",
            title="rank 1's forward pass blocks 15 ms every step (waiting on a slower device)",
            flags=("--fault=slow", "--fault-rank=1", "--slow-ms=15", "--slow-kind=sleep"),
            baseline=HEALTHY,
            mechanism="unexplained_straggler",
            ranks=(1,),
            alternatives=("slow_device",),
        ),
        Case(
            name="pipeline",
            title="two pipeline stages by send/recv, stage 0 has 6 layers and stage 1 has 1",
            flags=(
                "--fault=pipeline",
                "--fault-rank=0",
                "--heavy-layers=6",
                "--light-layers=1",
                "--microbatches=4",
            ),
            baseline=None,
            mechanism="pipeline_imbalance",
            ranks=(0,),
            stage=0,
        ),
        Case(
            name="warmup",
            title="healthy job whose first 4 steps run 100 ms more forward compute on every rank",
            flags=("--fault=warmup", "--warmup-steps=4", "--warmup-ms=100"),
            baseline=None,
            mechanism="healthy",
            ranks=(),
            warmup=0,
            warmup_steps=4,
        ),
        Case(
            name="healthy",
            title="the healthy job against another run of itself",
            flags=HEALTHY,
            baseline=HEALTHY,
            mechanism="healthy",
            ranks=(),
        ),
    )
}


@dataclass(frozen=True)
class CaseRun:
    """One case's windows and what was measured while making them."""

    case: Case
    window: Any
    """`Window` of the run under study, warm-up left out (``case.warmup``)."""
    baseline: Any | None
    """`Window` of the healthy baseline run, or None."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Role -> wall seconds of the torchrun (start-up included); a run read back from the
    hub is absent."""
    fault: dict[str, Any] = field(default_factory=dict)
    """How the fault was made, where the runner made it (the throttle: ``method``, ``core``
    or ``cgroup``, and the cgroup's ``nr_throttled`` / ``throttled_ms``)."""

    @property
    def truth(self) -> dict[str, Any]:
        return self.case.truth()


# -- the throttle: a CPU quota, else a shared busy core ------------------------------------
def _cgroup_mounts() -> list[tuple[str, str]]:
    """``(version, mount point)`` of the cgroup hierarchies that can carry a CPU quota."""
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            _, where, kind, opts, *_ = line.split()
            if kind == "cgroup2":
                try:
                    ctl = Path(where, "cgroup.controllers").read_text().split()
                except OSError:
                    continue
                if "cpu" in ctl:
                    out.append(("v2", where))
            elif kind == "cgroup" and "cpu" in opts.split(","):
                out.append(("v1", where))
    out.sort()  # v1 < v2: prefer v2
    return out[::-1]


def _make_cgroup(version: str, mount: str, quota: float, period_us: int) -> Path:
    path = Path(mount, f"rankscope-throttle-{os.getpid()}-{time.monotonic_ns()}")
    path.mkdir()
    try:
        q = int(quota * period_us)
        if version == "v2":
            # The parent must hand the cpu controller down to its children.
            sub = Path(mount, "cgroup.subtree_control")
            if "cpu" not in sub.read_text().split():
                sub.write_text("+cpu")
            Path(path, "cpu.max").write_text(f"{q} {period_us}")
            if Path(path, "cpu.max").read_text().split() != [str(q), str(period_us)]:
                raise OSError("cpu.max did not take")
        else:
            Path(path, "cpu.cfs_period_us").write_text(str(period_us))
            Path(path, "cpu.cfs_quota_us").write_text(str(q))
            if int(Path(path, "cpu.cfs_quota_us").read_text()) != q:
                raise OSError("cpu.cfs_quota_us did not take")
    except BaseException:
        _remove_cgroup(path, mount)
        raise
    return path


def _remove_cgroup(path: Path, mount: str) -> None:
    # Whatever is still inside (a rank that outlived torchrun) goes back to the root.
    try:
        for pid in Path(path, "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                Path(mount, "cgroup.procs").write_text(pid)
    except OSError:
        pass
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def _cgroup_stat(path: Path) -> dict[str, float]:
    stat = {}
    with contextlib.suppress(OSError):
        for line in Path(path, "cpu.stat").read_text().splitlines():
            k, v = line.split()
            stat[k] = float(v)
    out = {"nr_periods": stat.get("nr_periods", 0.0), "nr_throttled": stat.get("nr_throttled", 0.0)}
    if "throttled_time" in stat:  # v1: ns
        out["throttled_ms"] = stat["throttled_time"] / 1e6
    elif "throttled_usec" in stat:  # v2: µs
        out["throttled_ms"] = stat["throttled_usec"] / 1e3
    return out


@contextlib.contextmanager
def cpu_throttle(
    quota: float = THROTTLE_QUOTA,
    period_us: int = THROTTLE_PERIOD_US,
    method: str = "auto",
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """A CPU quota the throttled rank joins, or a core a spinning process shares with it.

    The quota (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``) is preferred: it needs
    root and a writable cpu controller. Without one, a busy process is pinned to the last
    core this process may use and the rank pins itself there. Both are removed on exit,
    failure included.

    Args:
        quota: share of one core under the quota.
        period_us: the quota's period.
        method: ``auto`` (the quota where the machine allows it), ``cgroup`` (the quota or
            `OSError`), ``shared-core``.

    Yields:
        The job flags that put the rank under the throttle, and a dict describing it (filled
        with the cgroup's throttling counters on exit).
    """
    if method not in ("auto", "cgroup", "shared-core"):
        raise ValueError(f"throttle method {method!r} is not auto, cgroup or shared-core")
    info: dict[str, Any] = {}
    for version, mount in _cgroup_mounts() if method != "shared-core" else ():
        try:
            path = _make_cgroup(version, mount, quota, period_us)
        except OSError as exc:
            info.setdefault("refused", []).append(f"cgroup {version} at {mount}: {exc}")
            continue
        info.update(method=f"cgroup-{version}", cgroup=str(path), quota=quota)
        try:
            yield (f"--throttle-cgroup={path}",), info
        finally:
            info.update(_cgroup_stat(path))
            _remove_cgroup(path, mount)
        return
    if method == "cgroup":
        raise OSError(f"no cgroup takes a CPU quota here: {info.get('refused', 'none mounted')}")
    core = max(os.sched_getaffinity(0))
    spin = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os\nos.sched_setaffinity(0, {{{core}}})\nos.nice({SPIN_NICE})\n"
            "while True:\n    pass\n",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    info.update(method="shared-core", core=core, spinner_pid=spin.pid)
    try:
        yield (f"--throttle-core={core}",), info
    finally:
        spin.kill()
        spin.wait(timeout=10)


# -- running cases -------------------------------------------------------------------------
def _stored(store: Any, spec: RunSpec) -> bool:
    try:
        w = store.window(spec.run)
    except KeyError:
        return False
    return int(w.present.sum()) >= w.world_size * spec.steps


def _run(
    hub: Any,
    spec: RunSpec,
    warmup: int,
    seconds: dict[str, float],
    role: str,
    extra: tuple[str, ...] = (),
    timeout: float = 300.0,
) -> Any:
    if not _stored(hub.store, spec):
        if extra:
            spec = RunSpec(
                spec.run,
                (*spec.flags, *extra),
                spec.nproc,
                spec.steps,
                script=spec.script,
                job=spec.job,
            )
        seconds[role] = run_local(hub.endpoint, spec, timeout=timeout)
    return settled_window(hub.store, spec, warmup=warmup)


def measure(name: str, hub: Any, *, timeout: float = 300.0, throttle: str = "auto") -> CaseRun:
    """Run one case (and its baseline, unless the hub holds it already).

    Args:
        name: a key of `CASES`.
        hub: a running `rankscope.hub.server.Hub` (`incidents.local_hub`).
        timeout: seconds each torchrun may take.
        throttle: how a throttle case is throttled (`cpu_throttle`'s ``method``).

    Returns:
        The windows, the seconds each run took, and how the fault was made.

    Raises:
        WorkloadError: a run failed or never reached the hub.
    """
    case = CASES[name]
    seconds: dict[str, float] = {}
    fault: dict[str, Any] = {}
    base = None
    if case.baseline is not None:
        base = _run(hub, case.spec("baseline"), case.warmup, seconds, "baseline", timeout=timeout)
    spec = case.spec("fault")
    if case.throttle and not _stored(hub.store, spec):
        with cpu_throttle(method=throttle) as (extra, info):
            try:
                window = _run(hub, spec, case.warmup, seconds, "fault", extra, timeout)
            finally:
                fault = info
    else:
        window = _run(hub, spec, case.warmup, seconds, "fault", timeout=timeout)
    return CaseRun(case, window, base, seconds, fault)


def run_case(name: str, hub: Any) -> tuple[Any, Any | None, dict[str, Any]]:
    """Run one case into ``hub``: ``(window, baseline_window or None, truth)``.

    ``truth`` holds ``mechanism``, ``ranks`` (a tuple) and, for a pipeline case,
    ``stage``; ``alternatives`` where another mechanism is an equally right answer;
    ``warmup_steps`` for the warm-up case (its window starts at step 0).
    """
    got = measure(name, hub)
    return got.window, got.baseline, got.truth


def summary(got: CaseRun, diagnosis: Any) -> list[str]:
    """A few lines: the runs, the truth, and the verdict's top three."""
    import numpy as np

    lines = [f"{got.case.name}: {got.case.title}"]
    for role, w in (("fault", got.window), ("baseline", got.baseline)):
        if w is None:
            continue
        step = np.nanmedian(np.nanmax(w.step_ns, axis=0)) / 1e6
        took = f", {got.seconds[role]:.1f} s" if role in got.seconds else ""
        lines.append(f"  {role:8s} {w.run}: {w.world_size} ranks, p50 step {step:.1f} ms{took}")
    if got.fault:
        lines.append(f"  fault made by {got.fault}")
    lines.append(f"  truth {got.truth}")
    for h in diagnosis.verdict.hypotheses[:3]:
        lines.append(f"  {h.mechanism:24s} score {h.score:.2f} ranks {list(h.ranks)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from rankscope.diagnosis.engine import diagnose

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("case", choices=[*CASES, "all"])
    ap.add_argument("--record", required=True, help="recording directory for the hub")
    args = ap.parse_args(argv)
    names = list(CASES) if args.case == "all" else [args.case]
    with local_hub(Path(args.record)) as hub:
        for name in names:
            got = measure(name, hub)
            print("\n".join(summary(got, diagnose(got.window, got.baseline))), flush=True)
    return 0


__all__ = [
    "CASES",
    "Case",
    "CaseRun",
    "WorkloadError",
    "cpu_throttle",
    "incidents",
    "measure",
    "run_case",
]

if __name__ == "__main__":
    sys.exit(main())
