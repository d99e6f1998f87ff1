"""Real hung jobs (torchrun, gloo, CPU): the hub names the rank that holds each one.

Six two-rank jobs run at once against one hub with a `HangWatch` (they mostly sleep):

- ``sleep``: rank 1 sleeps for ever before a collective — ``not_entered`` (this job runs
  with torch's Flight Recorder enabled: its bundle holds both ranks' dumps);
- ``stop``: rank 1 SIGSTOPs itself before a collective — ``gone`` (no heartbeat);
- ``exit``: rank 1 leaves the loop and exits cleanly (torchrun waits for rank 0) — ``gone``;
- ``skip``: rank 1 skips a collective on one group and enters the next on another —
  ``mismatch``;
- ``long``: one step of rank 1 takes 20 times the others — no stall;
- ``slow``: steps of 20 s — no stall.

Each bundle is a snapshot bundle (``rankscope report`` reads it) with a ``hang/`` part.
gloo's timeout is 10 minutes, so no watchdog fires first. Every process is killed at the
end (its process group gets SIGKILL, which also ends a stopped one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
if shutil.which("torchrun") is None:
    pytest.skip("torchrun is not installed", allow_module_level=True)

from rankscope.collector.stacks import FR_ENV
from rankscope.hub.hang import HangWatch
from rankscope.hub.server import Hub

pytestmark = [pytest.mark.torch, pytest.mark.slow]

JOB = r"""
import os, signal, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import rankscope

def hang_here_for_ever():
    while True:
        time.sleep(3600)

mode, steps, step_s, at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
rank = dist.get_rank()
mon = rankscope.start(job="hang-" + mode)
side = dist.new_group([0, 1])
groups = [None, side]
x = torch.ones(256)
for step in range(steps):
    with mon.step(step):
        late = mode == "long" and rank == 1 and step == at
        time.sleep(step_s * (20 if late else 1))
        culprit = rank == 1 and step == at
        if culprit and mode == "sleep":
            hang_here_for_ever()
        if culprit and mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if culprit and mode == "exit":
            break
        if culprit and mode == "skip" and step % 2 == 0:
            continue
        dist.all_reduce(x, group=groups[step % 2])
if not (mode == "exit" and rank == 1):
    dist.barrier()
mon.close()
"""

CASES = {
    # mode: (steps, step seconds, culprit's step, expected case or None)
    "sleep": (40, 0.1, 4, "not_entered"),
    "stop": (40, 0.1, 4, "gone"),
    "exit": (40, 0.1, 4, "gone"),
    "skip": (40, 0.1, 4, "mismatch"),
    "long": (10, 0.2, 4, None),
    "slow": (2, 20.0, 99, None),
}
DEADLINE_S = 240.0
"""Only catches a hang of the test itself: a loaded machine may start torch slowly."""


def _launch(tmp: Path, hub: Hub, mode: str) -> subprocess.Popen:
    steps, step_s, at, _ = CASES[mode]
    env = dict(os.environ)
    env.update(
        RANKSCOPE_HUB=hub.endpoint,
        RANKSCOPE_RUN=f"hang-{mode}",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    for name in FR_ENV:
        env.pop(name, None)
    if mode == "sleep":
        env[FR_ENV[0]] = "200"
    log = open(tmp / f"{mode}.log", "wb")  # noqa: SIM115 - closed with the process
    argv = [
        "torchrun", "--standalone", "--nproc-per-node", "2", "--monitor-interval", "1",
        str(tmp / "job.py"), mode, str(steps), str(step_s), str(at),
    ]  # fmt: skip
    return subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun starts its workers in sessions of
    their own, out of reach of a signal to its process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended since the listing
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(proc: subprocess.Popen) -> None:
    # The workers too, stopped ones included (SIGKILL ends a stopped process): left behind,
    # a rank stopped with SIGSTOP and its peer waiting for it would outlive the test.
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture(scope="module")
def hangs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hangs")
    (tmp / "job.py").write_text(JOB)
    # The hub's own log and each run's verdicts as they change: a failure says why.
    hub_log = logging.FileHandler(tmp / "hub.log")
    hub_log.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("rankscope").addHandler(hub_log)
    hub = Hub(record_dir=str(tmp / "rec")).start()
    marker = tmp / "hook.txt"
    hook = f"{sys.executable} -c \"import sys; open({str(marker)!r}, 'a').write(sys.argv[1] + chr(10))\""
    watch = HangWatch(
        hub.store,
        tmp / "bundles",
        on_stall=hook,
        every_s=0.5,
        recording=hub.record_dir,
        flush=hub.recorder.flush if hub.recorder is not None else None,
    ).start()
    procs = {mode: _launch(tmp, hub, mode) for mode in CASES}
    named: dict[str, dict] = {}
    stalls: dict[str, list] = {m: [] for m in CASES}
    history: dict[str, list[str]] = {m: [] for m in CASES}
    began = time.monotonic()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            for mode in CASES:
                rec = watch.records.get(f"hang-{mode}")
                _follow(history[mode], _run_of(hub, mode), rec, time.monotonic() - began)
                if rec is not None and rec.hang.stalled:
                    stalls[mode].append(rec.hang)
                    if mode not in named and rec.bundle is not None:
                        named[mode] = {"hang": rec.hang, "bundle": Path(rec.bundle)}
            hung = [m for m, c in CASES.items() if c[3] is not None]
            healthy_done = all(
                procs[m].poll() is not None for m, c in CASES.items() if c[3] is None
            )
            if all(m in named for m in hung) and healthy_done:
                break
        time.sleep(1.0)  # the hook is a separate process
        yield {
            "named": named,
            "stalls": stalls,
            "procs": procs,
            "tmp": tmp,
            "marker": marker,
            "hub": hub,
            "history": history,
        }
    finally:
        for proc in procs.values():
            _kill(proc)
        watch.stop()
        hub.stop()
        logging.getLogger("rankscope").removeHandler(hub_log)
        hub_log.close()


def _run_of(hub: Hub, mode: str):
    return hub.store.run_state(f"hang-{mode}")


def _follow(history: list[str], run, rec, at_s: float) -> None:
    """Append a line to ``history`` when the run's beats or verdict change."""
    if run is None:
        return
    beats = run.beats.copy()
    state = {k: beats[k].tolist() for k in ("state", "error", "group", "seq", "step") if k in beats}
    verdict = "no verdict"
    if rec is not None:
        h = rec.hang
        verdict = (
            f"stalled={h.stalled} case={h.case!r} idle={h.idle_s:.1f}s "
            f"threshold={h.threshold_s:.1f}s bundle={rec.bundle is not None} "
            f"culprits={[c.rank for c in h.culprits]}"
        )
    line = f"beats {state}; {verdict}"
    if not history or history[-1].split(": ", 1)[1] != line:
        history.append(f"{at_s:6.1f} s: {line}")


def _why_not_named(hangs, mode: str) -> str:
    """The job's log, how its verdict went, and the hub's log."""
    tmp = hangs["tmp"]
    return "\n".join(
        [
            (tmp / f"{mode}.log").read_text()[-3000:],
            "--- beats and verdicts as they changed:",
            *hangs["history"][mode][-40:],
            "--- hub log:",
            (tmp / "hub.log").read_text()[-3000:],
        ]
    )


@pytest.mark.parametrize("mode", [m for m, c in CASES.items() if c[3] is not None])
def test_hung_job_names_the_rank_and_case(hangs, mode):
    got = hangs["named"].get(mode)
    assert got is not None, _why_not_named(hangs, mode)
    hang = got["hang"]
    assert [c.rank for c in hang.culprits] == [1], hang
    assert hang.case == CASES[mode][3], hang
    culprit = hang.culprits[0]
    assert culprit.host
    waiting0 = next(w for w in hang.waiting if w.rank == 0)
    if mode == "exit":
        # gloo ends rank 0's all_reduce with an error once rank 1's connection closes.
        assert "exited" in culprit.detail and waiting0.where == "exited", hang
        return
    if mode != "skip":
        assert culprit.group == 0 and culprit.op == "all_reduce" and culprit.seq >= 0, culprit
    assert waiting0.where.startswith("in ") and waiting0.op == "all_reduce", waiting0


@pytest.mark.parametrize("mode", [m for m, c in CASES.items() if c[3] is not None])
def test_bundle_holds_the_evidence(hangs, mode):
    got = hangs["named"].get(mode)
    assert got is not None, _why_not_named(hangs, mode)
    part = got["bundle"] / "hang"
    verdict = json.loads((part / "verdict.json").read_text())
    assert verdict["stalled"] and [c["rank"] for c in verdict["culprits"]] == [1]
    assert (got["bundle"] / "manifest.json").exists() and (part / "steps.json").exists()
    content = json.loads((got["bundle"] / "snapshot.json").read_text())
    assert [c["rank"] for c in content["hang"]["verdict"]["culprits"]] == [1]
    assert content["window"]["path"] == "window" and content["view"]["pins"] == [1]
    md = (got["bundle"] / "snapshot.md").read_text()
    assert md.index("## Stall") < md.index("## Verdict") and "culprit **rank 1**" in md
    if mode == "exit":  # both processes are gone: their last positions are the evidence
        assert "exited" in json.dumps(verdict["culprits"][0])
        assert "gone" in (part / "proc-r1.txt").read_text()
    else:
        waiting = (part / "stacks-r0.txt").read_text()
        assert "all_reduce" in waiting, waiting[:2000]
    if mode in ("sleep", "skip"):
        culprit = (part / "stacks-r1.txt").read_text()
        assert ("hang_here_for_ever" if mode == "sleep" else "all_reduce") in culprit
    if mode == "stop":
        status = (part / "proc-r1.txt").read_text()
        assert "T (stopped)" in status, status
        if shutil.which("py-spy"):
            assert "MainThread" in (part / "native-r1.txt").read_text()
    assert str(got["bundle"]) in hangs["marker"].read_text().splitlines()
    if mode != "sleep":  # no Flight Recorder enabled: the text says how
        assert "TORCH_FR_BUFFER_SIZE" in (part / "flight_recorder").read_text()


def test_report_reads_the_bundle(hangs):
    got = hangs["named"]["skip"]
    argv = [sys.executable, "-m", "rankscope", "report", str(got["bundle"]), "--width", "160"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STALLED" in done.stdout and "culprit rank 1" in done.stdout, done.stdout[:3000]


def test_flight_recorder_dumps_name_the_rank_that_never_entered(hangs):
    from rankscope.hub.importers.flight_recorder import load_dump

    folder = hangs["named"]["sleep"]["bundle"] / "hang" / "flight_recorder"
    assert folder.is_dir(), (folder.parent / "flight_recorder").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0.json", "rank_1.json"]
    waiting = load_dump(folder / "rank_0.json")["entries"]
    assert waiting[-1]["profiling_name"] == "gloo:all_reduce" and not waiting[-1]["retired"]
    rec = hangs["tmp"] / "fr-import"
    argv = [sys.executable, "-m", "rankscope", "import", "flight-recorder", str(folder)]
    argv += ["--record", str(rec), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    hang = json.loads(done.stdout)["details"]["hang"]
    assert [h["never_entered"] for h in hang] == [[1]], hang
    assert hang[0]["entered_not_finished"] == [0]


@pytest.mark.parametrize("mode", [m for m, c in CASES.items() if c[3] is None])
def test_healthy_job_never_stalls(hangs, mode):
    proc = hangs["procs"][mode]
    assert proc.poll() == 0, (hangs["tmp"] / f"{mode}.log").read_text()[-3000:]
    assert hangs["stalls"][mode] == []
    run = hangs["hub"].store.run_state(f"hang-{mode}")
    assert run is not None and run.beats.count >= 2


def test_diagnose_json_says_it_on_the_growing_recording(hangs):
    # The jobs still hang and the hub still records: the command reads the file it writes.
    rec = hangs["tmp"] / "rec"
    argv = [
        sys.executable,
        "-m",
        "rankscope",
        "diagnose",
        str(rec),
        "--run",
        "hang-sleep",
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    stall = json.loads(done.stdout)["stall"]
    assert stall["stalled"] is True and stall["culprits"] == [1], stall
    assert stall["hang"]["case"] == "not_entered"
    assert stall["hang"]["culprits"][0]["op"] == "all_reduce"


def test_prometheus_carries_the_stall(hangs):
    from prometheus_client import generate_latest

    from rankscope.hub.prometheus import make_registry, store_hangs, store_source

    store = hangs["hub"].store
    registry, _ = make_registry(store_source(store, last=8), store_hangs(store))
    text = generate_latest(registry).decode()
    stalled = [line for line in text.splitlines() if line.startswith("rankscope_stalled{")]
    assert any('run="hang-sleep"' in line and line.endswith(" 1.0") for line in stalled), stalled
    assert any('run="hang-slow"' in line and line.endswith(" 0.0") for line in stalled), stalled
    culprit = [line for line in text.splitlines() if line.startswith("rankscope_stall_culprit{")]
    assert any(
        'run="hang-skip"' in line and 'case="mismatch"' in line and 'rank="1"' in line
        for line in culprit
    )
