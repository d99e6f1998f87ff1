"""Real torchrun gloo jobs, instrumented zero-code and explicitly, reporting to a real hub.

Rank 2 of ``examples/tiny_ddp.py`` sleeps a known delay before each of its collectives;
the hub must name it the last arriver with about that lateness. Two torchrun agents on
loopback stand in for two nodes; a hub killed and restarted on the same port must lose
nothing it had recorded while the job carries on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

pytest.importorskip("torch", reason="torch is not installed")

from ports import free_port_pair

from rankscope.collector import schema
from rankscope.collector.clock import FALLBACK_ERROR_NS
from rankscope.hub import replay
from rankscope.hub.server import Hub

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "tiny_ddp.py")
DELAY_MS = 50.0
SCHEDULER_MS = 25.0
"""Most extra lateness a delayed rank may show from waiting for a core once its sleep
ends (a few scheduler periods with six runnable processes on two cores)."""
STEPS = 12


def start_hub_on(port: int, record: str | None) -> Hub:
    """A hub on a port just released: the kernel may need a moment to free it."""
    for _ in range(50):
        try:
            return Hub(bind=f"tcp://127.0.0.1:{port}", record_dir=record).start()
        except zmq.ZMQError:
            time.sleep(0.1)
    return Hub(bind=f"tcp://127.0.0.1:{port}", record_dir=record).start()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKSCOPE_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def zero_code(hub: str, *cmd: str, job: str = "tiny") -> list[str]:
    return [sys.executable, "-m", "rankscope", "run", "--hub", hub, "--job", job, "--", *cmd]


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a job started with ``start_new_session``: torchrun and every rank it started
    (killing torchrun alone leaves its ranks running, and loading the machine, until they
    give up on their peers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_job(cmd: list[str], env: dict[str, str], timeout: float = 180) -> None:
    """Run a job to the end; the timeout only catches a hang (these take ~10-20 s)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            stop_group(proc)
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{err[-4000:]}"


def wait_for(pred, timeout: float = 60.0) -> bool:
    """Poll until ``pred()``; returns as soon as it holds, so a generous timeout costs a
    passing test nothing and leaves room for a loaded machine."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def check_straggler(window, delayed: int = 2, delay_ms: float = DELAY_MS) -> None:
    assert window.world_size == 4
    inst = window.instances
    complete = inst.n_arrived == inst.n_members
    assert complete.sum() >= STEPS * 3, f"only {complete.sum()} complete instances"
    share = float(np.mean(inst.last_rank[complete] == delayed))
    assert share >= 0.9, f"rank {delayed} last in only {share:.0%} of collectives"
    late = window.coll["late_ns"][delayed]
    n_coll = window.coll["n"][delayed]
    mean_late_ms = np.nansum(late) / np.nansum(n_coll) / 1e6
    # A sleep ends no earlier than asked; on a machine whose cores are busy the woken rank
    # then waits for one (61.7 ms for a 50 ms delay was seen with both cores busy).
    most = delay_ms + max(0.2 * delay_ms, SCHEDULER_MS)
    assert 0.8 * delay_ms <= mean_late_ms <= most, f"mean lateness {mean_late_ms:.1f} ms"
    # All four ranks reported every step.
    assert window.present.all(), f"missing rank-steps: {np.argwhere(~window.present)[:8]}"
    assert len(window.steps) >= STEPS


# The zero-code path is also the real instrumentation tests' (test_real_instrumentation):
# here it runs in the slower tier.
@pytest.mark.parametrize("mode", [pytest.param("zero-code", marks=pytest.mark.slow), "explicit"])
def test_straggler_named_by_the_hub(tmp_path: Path, mode: str) -> None:
    record = tmp_path / "rec"
    # Port 0: the hub binds a free pair itself and reports it; nothing to race for.
    hub = Hub(bind="tcp://127.0.0.1:0", record_dir=str(record)).start()
    try:
        job = [
            "--standalone",
            "--nproc_per_node=4",
            SCRIPT,
            f"--steps={STEPS}",
            "--delay-rank=2",
            f"--delay-ms={DELAY_MS}",
        ]
        if mode == "explicit":
            env = clean_env(RANKSCOPE_HUB=hub.endpoint)
            run_job(torchrun(*job, "--rankscope=explicit"), env)
        else:
            run_job(zero_code(hub.endpoint, *torchrun(*job)), clean_env())
        assert wait_for(lambda: any(r.steps_complete >= STEPS for r in hub.store.runs()))
        time.sleep(0.5)  # the final stats messages
        runs = hub.store.runs()
        assert len(runs) == 1, runs
        run = runs[0]
        assert run.job == "tiny_ddp" if mode == "explicit" else run.job == "tiny"
        assert run.n_ranks_seen == 4
        window = hub.store.window(run.run)
        check_straggler(window)
        # Every rank synced its clock with the hub (the fallback states a whole second).
        assert window.clock_error_ns is not None
        assert np.all(window.clock_error_ns < FALLBACK_ERROR_NS)
        if mode == "explicit":
            assert window.manifest["job_config"]["global_batch"] == 32
        # Everything the collectors sent passed the hub's validation, nothing was dropped
        # and no collector reported an internal error.
        counters = hub.counters()
        assert not any(counters["rejects"].values()), counters["rejects"]
        assert counters["collector_errors"] == {}, counters["collector_errors"]
        assert counters["drops"] == {"batches": 0, "events": 0}, counters["drops"]
    finally:
        hub.stop()
    # The recording replays to the same conclusion.
    replayed = replay.load(record)
    check_straggler(replayed.window(run.run))


# Slow tier (~20 s of two torchrun agents): the default tier's real jobs are single-node;
# the namespaced two-node tests, also slow-tier, cover several nodes over a real link.
@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    # Both agents must be told the rendezvous port before either binds it: a probed port,
    # outside the ephemeral range. The hub binds its own.
    rdzv = free_port_pair()
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    procs = []
    try:
        for node, host in enumerate(("nodeA", "nodeB")):
            cmd = zero_code(
                hub.endpoint,
                *torchrun(
                    "--nnodes=2",
                    f"--node_rank={node}",
                    "--nproc_per_node=2",
                    "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{rdzv}",
                    "--rdzv_id=two-nodes",
                    SCRIPT,
                    "--steps=6",
                ),
            )
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=clean_env(RANKSCOPE_HOST=host),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        for p in procs:
            _, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-4000:]
        assert wait_for(lambda: any(r.steps_complete >= 6 for r in hub.store.runs()))
        runs = hub.store.runs()
        # No --run given on a multi-node command: the ranks agreed on one run id through
        # the process group's store.
        assert len(runs) == 1, runs
        window = hub.store.window(runs[0].run)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_group(p)
        hub.stop()
    info = window.ranks
    hosts = [info.hosts[c] for c in info.host]
    assert sorted(hosts) == ["nodeA", "nodeA", "nodeB", "nodeB"]
    node_ranks = info.node_rank.tolist()
    assert sorted(node_ranks) == [0, 0, 1, 1]
    for r in range(4):
        # torchrun numbers ranks node by node; each host holds one node rank.
        assert node_ranks[r] == r // 2
        assert hosts[r] == hosts[(r // 2) * 2]
        assert info.local_rank[r] == r % 2
    assert window.present.all()


# Measured ~20 s; the limit is above the sum of the waits inside, which catch a hang first.
# Slow tier: in the default one, tests/test_collector_reconnect.py restarts a hub under a
# live collector without torch, and tests/test_relay.py one under a relay.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hub_killed_and_restarted_mid_run(tmp_path: Path) -> None:
    # The hub restarts on the same port: it must be known before the first hub binds it.
    port = free_port_pair()
    record = tmp_path / "rec"
    hub = Hub(bind=f"tcp://127.0.0.1:{port}", record_dir=str(record)).start()
    steps = 80
    job = torchrun(
        "--standalone",
        "--nproc_per_node=4",
        SCRIPT,
        f"--steps={steps}",
        "--step-sleep-ms=60",
        "--rankscope=explicit",
    )
    proc = subprocess.Popen(
        job,
        env=clean_env(RANKSCOPE_HUB=hub.endpoint),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:

        def last_step(h: Hub) -> int:
            runs = h.store.runs()
            return max((r.last_step or -1) for r in runs) if runs else -1

        assert wait_for(lambda: last_step(hub) >= 10, timeout=90), "no steps before the kill"
        hub.stop()
        before = replay.load(record)
        run_id = before.run_ids()[0]
        w_before = before.window(run_id)
        steps_before = set(w_before.steps[w_before.present.all(axis=0)].tolist())
        assert steps_before
        assert proc.poll() is None, "the job should still be running"
        time.sleep(1.0)
        hub = start_hub_on(port, str(record))
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-4000:]
        assert wait_for(lambda: last_step(hub) >= steps - 1)
    finally:
        if proc.poll() is None:
            stop_group(proc)
        hub.stop()
    after = replay.load(record)
    w = after.window(run_id)
    complete = set(w.steps[w.present.all(axis=0)].tolist())
    assert steps_before <= complete, "steps recorded before the restart were lost"
    assert max(complete) >= steps - 1, "no data after the restart"
    assert len(complete) > len(steps_before)


@pytest.mark.slow  # the restart itself is test_hub_killed_and_restarted_mid_run's
@pytest.mark.timeout(600)  # as test_hub_killed_and_restarted_mid_run
def test_fresh_hub_without_recording_learns_the_ranks_again(tmp_path: Path) -> None:
    """A hub process killed, and a new one on the same port that knows nothing (no
    recording): the running job's collectors say hello again as soon as they reconnect,
    and from then on every message is accepted."""
    port = free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    first = subprocess.Popen(
        [sys.executable, "-m", "rankscope", "hub", "--bind", endpoint, "--status-every", "0.2"],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    seen = [-1]

    def follow() -> None:
        assert first.stdout is not None
        for line in first.stdout:
            m = re.search(r"last step (\d+)", line)
            if m:
                seen[0] = int(m.group(1))

    threading.Thread(target=follow, daemon=True).start()
    steps = 100
    job = torchrun(
        "--standalone",
        "--nproc_per_node=4",
        SCRIPT,
        f"--steps={steps}",
        "--step-sleep-ms=60",
        "--rankscope=explicit",
    )
    proc = subprocess.Popen(
        job,
        env=clean_env(RANKSCOPE_HUB=endpoint),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    hub: Hub | None = None
    try:
        assert wait_for(lambda: seen[0] >= 5, timeout=90), "the first hub saw no steps"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert proc.poll() is None, "the job should still be running"
        hub = start_hub_on(port, None)

        def ranks_known() -> int:
            runs = hub.store.runs()
            return runs[0].n_ranks_seen if runs else 0

        assert wait_for(lambda: ranks_known() == 4), (
            f"the new hub did not hear every rank's hello: {hub.health['rejects']}"
        )
        unknown_at_hello = hub.health["rejects"].get("unknown_rank", 0)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-4000:]
        run_id = hub.store.runs()[0].run
        assert wait_for(lambda: (hub.store.runs()[0].last_step or -1) >= steps - 1)
        hub.stop()
        rejects = hub.health["rejects"]
        assert rejects.get("unknown_rank", 0) == unknown_at_hello, rejects
        w = hub.store.window(run_id)
        complete = sorted(w.steps[w.present.all(axis=0)].tolist())
        # Every step from the first one the new hub saw to the end, from all four ranks.
        assert complete == list(range(complete[0], steps)), complete
        assert complete[0] < steps - 20, "too little of the job ran after the restart"
        assert 0 in w.groups and len(w.groups[0].ranks) == 4
    finally:
        if proc.poll() is None:
            stop_group(proc)
        if first.poll() is None:
            first.kill()
        if hub is not None:
            hub.stop()


P2P_SCRIPT = """
import sys, time, torch, torch.distributed as dist
import rankscope
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mon = rankscope.start(job="p2p")
x = torch.ones(16)
for step in range(4):
    with mon.step():
        # A pipeline-like exchange between ranks 0 and 1 only: ranks 2 and 3 take no part,
        # yet the world all-reduce below must still match across all four.
        if rank == 0:
            dist.send(x, dst=1)
            dist.irecv(x, src=1).wait()
        elif rank == 1:
            dist.recv(x)  # any source: the peer comes from the return value
            dist.isend(x, dst=0).wait()
        dist.all_reduce(x)
        if rank in (2, 3):
            dist.send(x, dst=5 - rank) if rank == 2 else dist.recv(x, src=2)
        dist.barrier()
rankscope.close()
dist.destroy_process_group()
"""


@pytest.mark.slow  # ~16 s in a busy suite; p2p matching is unit-tested in test_hub_matching*
def test_point_to_point_keeps_collectives_matched(tmp_path: Path) -> None:
    script = tmp_path / "p2p.py"
    script.write_text(P2P_SCRIPT)
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    try:
        run_job(
            torchrun("--standalone", "--nproc_per_node=4", str(script)),
            clean_env(RANKSCOPE_HUB=hub.endpoint),
        )
        assert wait_for(lambda: any(r.steps_complete >= 4 for r in hub.store.runs()))
        window = hub.store.window(hub.store.runs()[0].run)
        counters = hub.counters()
    finally:
        hub.stop()
    inst = window.instances
    assert len(inst) > 0 and np.all(inst.n_arrived == inst.n_members), "unmatched instances"
    ops = {schema.OPS[o] for o in inst.op.tolist()}
    assert {"send", "all_reduce", "barrier"} <= ops
    groups = window.groups
    p2p = {g.ranks for g in groups.values() if g.name.startswith("p2p")}
    assert p2p == {(0, 1), (1, 0), (2, 3)}
    # Per step: world all-reduce + barrier, 0->1, 1->0 and 2->3 messages.
    assert np.sum(inst.group == 0) == 8
    assert len(inst) == 4 * 5
    assert counters["collector_errors"] == {}


def _two_rank_window(hub: Hub, steps: int, env: dict[str, str], *flags: str, timeout: float = 180):
    """Run the tiny DDP example zero-code on two ranks for ``steps`` steps and return its
    window once the hub holds them all (every rank-step present)."""
    job = ["--standalone", "--nproc_per_node=2", SCRIPT, f"--steps={steps}", *flags]
    run_job(zero_code(hub.endpoint, *torchrun(*job)), env, timeout=timeout)
    assert wait_for(lambda: any(r.steps_complete >= steps for r in hub.store.runs()))
    time.sleep(0.5)
    window = hub.store.window(hub.store.runs()[0].run)
    assert window.present.all() and len(window.steps) >= steps
    return window


# Each mode is one more torchrun (~11 s in a busy suite): the slow tier; the default
# tier reads the setting in test_collector_monitor and runs DDP jobs in test_real_faults.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "sampled", "tail"])
def test_ddp_bucket_settings_across_ranks(mode: str) -> None:
    """``RANKSCOPE_DDP_BUCKETS`` in a real zero-code job. ``sampled``: bucket instances
    of the sampled steps still match across ranks (the sequence counts every bucket).
    ``tail``: one all-reduce row per step, matched across ranks, no comm hook.
    ``off``: steps and phases without a single collective, and the diagnosis still runs."""
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    steps = 12
    try:
        env = clean_env(RANKSCOPE_DDP_BUCKETS=mode, RANKSCOPE_DDP_SAMPLE_EVERY="3")
        window = _two_rank_window(
            hub, steps, env, "--quiet-exit", f"--explicit-colls={0 if mode == 'off' else 3}"
        )
        for phase in ("input", "forward", "backward", "optimizer"):
            assert np.all(window.phase_ns[phase][:, :steps] > 0), phase
        assert hub.counters()["collector_errors"] == {}
        inst = window.instances
        if mode == "off":
            assert len(inst) == 0
            from rankscope.diagnosis.engine import diagnose

            verdict = diagnose(window).verdict
            assert verdict.hypotheses and verdict.hypotheses[0].evidence
            return
        rows = window.rows
        assert rows is not None
        if mode == "tail":
            assert not np.any(rows.flags & schema.FLAG_DDP_BUCKET)
            tail = (rows.flags & schema.FLAG_DDP_TAIL) != 0
            assert np.all(inst.n_arrived == inst.n_members), "an instance is not matched"
            # The window keeps the raw rows of its last steps: one tail row per rank there.
            kept, n = np.unique(rows.step[tail & (rows.step < steps)], return_counts=True)
            assert len(kept) > 0 and np.all(n == 2)
            per_step = np.bincount(inst.step[inst.step < steps].astype(int), minlength=steps)
            assert per_step.tolist() == [3 * (s > 0) + 1 for s in range(steps)]
            return
        bucket = (rows.flags & schema.FLAG_DDP_BUCKET) != 0
        assert bucket.any()
        assert set(np.unique(rows.step[bucket]).tolist()) <= set(range(0, steps + 1, 3))
        assert np.all(inst.n_arrived == inst.n_members), "an instance is not matched"
        # Auto steps end at the optimizer step, so a step holds the explicit collectives
        # issued after the previous one (none in step 0) and, on sampled steps, the bucket.
        per_step = np.bincount(inst.step[inst.step < steps].astype(int), minlength=steps)
        assert per_step.tolist() == [3 * (s > 0) + (s % 3 == 0) for s in range(steps)]
    finally:
        hub.stop()


@pytest.mark.slow  # two ranks compiling the model: ~15 s alone
def test_a_compiled_ddp_job_reports_its_steps_phases_and_collectives(tmp_path: Path) -> None:
    """``torch.compile(DDP(model))`` in a real zero-code job: the model runs compiled, and
    every step still has its forward, backward and optimizer phases and its matched
    all-reduce (DDP's tail) and explicit collective."""
    hub = Hub(bind="tcp://127.0.0.1:0").start()
    steps = 6
    timings = tmp_path / "timings.json"
    try:
        flags = ("--compile", "--explicit-colls=1", f"--timings={timings}")
        window = _two_rank_window(hub, steps, clean_env(), *flags, timeout=400)
        assert json.loads(timings.read_text())["compiled_frames"] > 0
        for phase in ("forward", "backward", "optimizer"):
            assert np.all(window.phase_ns[phase][:, :steps] > 0), phase
        inst = window.instances
        assert np.all(inst.n_arrived == inst.n_members), "an instance is not matched"
        per_step = np.bincount(inst.step[inst.step < steps].astype(int), minlength=steps)
        assert np.all(per_step[1:] >= 2), per_step  # the DDP tail and the explicit one
        assert hub.counters()["collector_errors"] == {}
    finally:
        hub.stop()


EXIT_PROBE = """
import os, sys
sys.path.insert(0, {examples!r})
import tiny_ddp

def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{tid}}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended since the listing
            pass
    return sum(n.startswith(("pt_gloo", "gloo")) for n in names)

before = []
destroy = tiny_ddp.dist.destroy_process_group
def counted(*a, **k):
    before.append(gloo_threads())
    return destroy(*a, **k)
tiny_ddp.dist.destroy_process_group = counted
code = tiny_ddp.main(["--steps=3", "--rankscope={mode}"])
print(code, before[0], gloo_threads())
"""


@pytest.mark.parametrize("mode", [pytest.param("off", marks=pytest.mark.slow), "explicit"])
def test_example_ends_its_gloo_threads_before_interpreter_exit(mode: str) -> None:
    # A gloo worker still alive at interpreter exit can abort the process while freeing a
    # tensor ("terminate called without an active exception", about 1 run in 6 of the
    # two-rank example on this machine): the example must leave none behind.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port_pair()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        RANKSCOPE_HUB=f"tcp://127.0.0.1:{free_port_pair()}",
    )
    code = EXIT_PROBE.format(examples=str(ROOT / "examples"), mode=mode)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code_, during, after = (int(v) for v in done.stdout.split())
    assert code_ == 0 and during > 0  # the probe sees gloo's threads while the group lives
    assert after == 0
