"""``rankscope sweep``: the pure planning and analysis, the command on the simulated cluster
(a pairwise sweep finds the injected slow rail, and none on a healthy run), and the torch
worker on gloo loopback against an independent timing loop."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from simrec import record_sim

from rankscope.cli import main
from rankscope.collector.schema import OP_INDEX, SCOPES
from rankscope.diagnosis.curves import bus_factor
from rankscope.hub import replay
from rankscope.launch.sweep import (
    MAX_SIZE,
    MIN_SIZE,
    PairPoint,
    SweepPlan,
    SweepTarget,
    pairwise_finding,
    plan_sweep,
    size_ladder,
    sweep_points,
)
from rankscope.sim.spec import build_scenario

RANKS = 16
STEPS = 8


def _record(scenario: str, rec: Path) -> None:
    record_sim(scenario, rec, ranks=RANKS, steps=STEPS)


@pytest.fixture(scope="module")
def rail_rec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rec = tmp_path_factory.mktemp("sweep") / "rail"
    _record("network-rail", rec)
    return rec


@pytest.fixture(scope="module")
def healthy_rec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rec = tmp_path_factory.mktemp("sweep") / "healthy"
    _record("healthy", rec)
    return rec


# -- pure parts ----------------------------------------------------------------------------


def test_size_ladder_surrounds_the_application_sizes() -> None:
    app = [3_000_000.0, 40_000.0]
    ladder = size_ladder(app)
    assert list(ladder) == sorted(set(ladder))
    assert all(MIN_SIZE <= s <= MAX_SIZE and s % 8 == 0 for s in ladder)
    # The application's own sizes are in it, and powers of two four times beyond each end.
    assert 3_000_000 in ladder and 40_000 in ladder
    assert min(ladder) <= 40_000 // 16 and max(ladder) >= 3_000_000 * 16
    assert size_ladder([]) == ()
    assert max(size_ladder([float(1 << 30)])) == MAX_SIZE


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_bandwidths_follow_the_diagnosis_convention(op: str, n: int) -> None:
    nbytes, t_ns = 1 << 20, 250_000.0
    result = {"points": [{"group": "g", "op": op, "nbytes": nbytes, "n": n, "time_ns": t_ns}]}
    (p,) = sweep_points(result)
    gather_like = op in ("all_gather", "reduce_scatter")
    size = nbytes * n if gather_like else nbytes
    assert p.algbw_gbps == pytest.approx(size / t_ns)
    f = float(bus_factor(np.array([OP_INDEX[op]]), np.array([float(n)]))[0])
    assert p.busbw_gbps == pytest.approx(p.algbw_gbps * f)
    expected = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)
    assert f == pytest.approx(expected)


def _links(bw: dict[tuple[int, int], float]) -> list[PairPoint]:
    # Ranks 0-3 on host a, 4-7 on host b; rail = local rank.
    def host(r: int) -> str:
        return "a" if r < 4 else "b"

    return [
        PairPoint(
            pair=p,
            hosts=(host(p[0]), host(p[1])),
            rails=(p[0] % 4, p[1] % 4),
            crosses_hosts=host(p[0]) != host(p[1]),
            op="all_reduce",
            nbytes=1 << 22,
            time_ns=(1 << 22) / v,
            busbw_gbps=v,
        )
        for p, v in bw.items()
    ]


def _two_hosts(slow_rail: int | None) -> dict[tuple[int, int], float]:
    bw = {}
    for a in range(8):
        for b in range(a + 1, 8):
            cross = (a < 4) != (b < 4)
            v = 40.0 if cross else 200.0
            if cross and slow_rail in (a % 4, b % 4):
                v = 8.0
            bw[(a, b)] = v + 0.01 * (a + b)  # no two links alike
    return bw


def test_pairwise_finding_names_the_slow_rail_and_pair() -> None:
    f = pairwise_finding(_links(_two_hosts(slow_rail=2)))
    assert f.finding == "network_rail" and f.slow_rail == 2
    assert f.slowest_pair is not None and 2 in (f.slowest_pair[0] % 4, f.slowest_pair[1] % 4)
    assert (2, 6) in f.slow_pairs
    assert all(2 in (a % 4, b % 4) for a, b in f.slow_pairs)


def test_pairwise_finding_names_none_on_uniform_links() -> None:
    # Cross-host links only (a data-parallel group, one rank per host), all alike.
    cross = {(a, b): v for (a, b), v in _two_hosts(slow_rail=None).items() if (a < 4) != (b < 4)}
    f = pairwise_finding(_links(cross))
    assert f.finding == "healthy"
    assert f.slow_pairs == () and f.slow_rail is None and f.slow_host is None
    # Links inside and across hosts, each kind alike: no link is slow; the group is only
    # slower across hosts than inside one (where it is placed), not on a bad link.
    f = pairwise_finding(_links(_two_hosts(slow_rail=None)))
    assert f.finding == "placement"
    assert f.slow_pairs == () and f.slow_rail is None and f.slow_host is None
    assert pairwise_finding([]).finding == "healthy"


def test_one_slow_link_inside_one_host_is_local_fabric() -> None:
    bw = _two_hosts(slow_rail=None)
    bw[(1, 2)] = 20.0
    f = pairwise_finding(_links(bw))
    assert f.finding == "local_fabric" and f.slow_host == "a"
    assert f.slow_pairs == ((1, 2),)


def test_plan_from_a_recorded_run(rail_rec: Path) -> None:
    store = replay.load(rail_rec, history_steps=STEPS, raw_steps=STEPS)
    window = store.window("parent", last=STEPS)
    full = plan_sweep(window, "full")
    assert full.world_size == RANKS and full.targets and not full.pairs
    assert {t.op for t in full.targets} <= {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(set(t.app_sizes) <= set(t.sizes) for t in full.targets)
    one = plan_sweep(window, "one-node")
    assert len(one.hosts) == 1 and all(set(t.ranks) <= set(one.ranks) for t in one.targets)
    pw = plan_sweep(window, "pairwise", sizes=["64K", "1M"])
    assert pw.pair_sizes == (1 << 16, 1 << 20) and pw.pairs and not pw.targets
    assert SweepPlan.from_dict(json.loads(json.dumps(pw.to_dict()))) == pw
    with pytest.raises(ValueError, match="no group 'nope'"):
        plan_sweep(window, "full", group="nope")
    with pytest.raises(ValueError, match="unknown sweep scope"):
        plan_sweep(window, "everything")
    with pytest.raises(ValueError, match="message size"):
        plan_sweep(window, "full", sizes=["lots"])
    assert "sweep" in SCOPES


# -- the command on the simulated cluster -------------------------------------------------


def _sweep(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["sweep", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_without_yes_launches_nothing(
    rail_rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _sweep(capsys, str(rail_rec), "--scope", "pairwise", "--launcher", "simulated")
    assert code == 0
    assert "links" in out and "dry run" in out and "simulated cluster" in out
    assert not (rail_rec / "sweeps").exists()
    # A template launcher shows its command (the worker under torchrun), starts nothing.
    code, out, _ = _sweep(capsys, str(rail_rec), "--scope", "one-node", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["launched"] is False
    assert "torchrun" in plan["command"] and "sweep_worker.py" in plan["command"]
    assert "RANKSCOPE_SCOPE=sweep" in plan["command"]
    assert not (rail_rec / "sweeps").exists()


def test_pairwise_sweep_finds_the_slow_rail(
    rail_rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = replay.load(rail_rec).window("parent").manifest["sim"]["spec"]
    argv = (str(rail_rec), "--scope", "pairwise", "--launcher", "simulated", "--yes", "--json")
    code, out, _ = _sweep(capsys, *argv)
    assert code == 0
    res = json.loads(out)
    found = res["found"]
    assert res["scope"] == "sweep" and res["parent_run"] == "parent"
    assert found["finding"] == "network_rail"
    window = replay.load(rail_rec).window("parent")
    rail = found["rail"]
    a, b = found["pair"]
    assert int(window.ranks.rail[a]) == int(window.ranks.rail[b]) == rail
    assert window.ranks.host[a] != window.ranks.host[b]
    assert truth["fault"]["mechanism"] == "network_rail"
    sim = window.manifest["sim"]
    assert rail == build_scenario(sim["spec"], name=sim["scenario"]).fault.rail
    written = json.loads(Path(res["result"]).read_text())
    assert Path(res["result"]).parent == rail_rec / "sweeps"
    assert written["scope"] == "sweep" and written["analysis"]["found"]["rail"] == rail
    assert written["pairs"] and written["backend"] == "simulated"


def test_full_sweep_reproduces_a_fabric_fault(
    rail_rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = (str(rail_rec), "--scope", "full", "--launcher", "simulated", "--yes", "--json")
    code, out, _ = _sweep(capsys, *argv)
    res = json.loads(out)
    assert code == 0 and res["points"]
    assert res["reproduces"] is True and "fabric" in res["conclusion"]


def test_pairwise_sweep_of_a_healthy_run_finds_nothing(
    healthy_rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = (str(healthy_rec), "--scope", "pairwise", "--launcher", "simulated", "--yes", "--json")
    code, out, _ = _sweep(capsys, *argv)
    res = json.loads(out)
    assert code == 0
    assert res["found"]["finding"] == "healthy"
    assert res["found"]["pair"] is None and res["found"]["rail"] is None


def test_full_sweep_against_a_baseline_names_the_slow_group(
    rail_rec: Path, healthy_rec: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rankscope.launch.sweep import compare

    argv = (str(rail_rec), "--scope", "full", "--launcher", "simulated", "--yes", "--json")
    code, out, _ = _sweep(capsys, *argv, "--baseline", str(healthy_rec))
    res = json.loads(out)
    assert code == 0 and res["comparison"]["app_slow"] is True
    assert res["found"]["finding"] == "primitive" and res["reproduces"] is True
    window = replay.load(rail_rec).window("parent")
    # The slow group is the one on the degraded rail (the scenario's drawn rail).
    sim = window.manifest["sim"]
    fault = build_scenario(sim["spec"], name=sim["scenario"]).fault
    group = next(g for g in window.groups.values() if g.name == res["found"]["group"])
    assert {int(window.ranks.rail[r]) for r in group.ranks} == {fault.rail}
    assert len({int(window.ranks.host[r]) for r in group.ranks}) > 1
    # The same sweep five times faster than the job: the primitive path is not what is
    # slow, the application's schedule or arrival is.
    result = json.loads(Path(res["result"]).read_text())
    for row in result["points"]:
        row["time_ns"] /= 5
    baseline = replay.load(healthy_rec).window("parent")
    comp = compare(result, window, baseline)
    assert comp.reproduces is False and comp.ratio > 4
    assert "schedule or arrival" in comp.conclusion
    # A healthy run against the faulty one as its baseline has no slow curve.
    code, out, _ = _sweep(
        capsys,
        str(healthy_rec),
        "--scope",
        "full",
        "--launcher",
        "simulated",
        "--baseline",
        str(rail_rec),
        "--yes",
        "--json",
    )
    res = json.loads(out)
    assert res["comparison"]["app_slow"] is False and res["found"]["finding"] == "healthy"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--scope", "full", "--group", "nope", "--launcher", "simulated"), "no group 'nope'"),
        (("--scope", "everything"), "invalid choice"),
        (("--scope", "full", "--sizes", "lots", "--launcher", "simulated"), "message size"),
        (("--scope", "full", "--run", "other"), "unknown run 'other'"),
        (("--scope", "full", "--launcher", "no-such-launcher"), "no-such-launcher"),
    ],
)
def test_bad_input_is_one_clean_line(
    rail_rec: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], says: str
) -> None:
    code, out, err = _sweep(capsys, str(rail_rec), *extra)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rankscope: error:"), err
    assert says in lines[0] and "Traceback" not in err


def test_missing_recording_is_one_clean_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _sweep(capsys, str(tmp_path / "none"), "--scope", "full")
    assert code == 2 and err.count("\n") == 1 and "no recording" in err


# -- the torch worker on gloo loopback ----------------------------------------------------

NBYTES = 1 << 20
ITERS = 100
"""Timed all-reduces a loop: at 20 (about 50 ms a loop) the rounds' ratios swung 0.83-1.05
on this shared 2-core machine; at 100 three runs gave 0.95-1.01."""
REPEATS = 7
ROUNDS = 7


def _independent_busbw(rank: int, port: int) -> float:
    """A plain all_reduce timing loop, nothing of rankscope in it: busbw in GB/s."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(NBYTES // 4, dtype=torch.float32)
    for _ in range(2):
        dist.all_reduce(x)
    means = []
    for _ in range(REPEATS):
        dist.barrier()
        t0 = time.perf_counter_ns()
        for _ in range(ITERS):
            dist.all_reduce(x)
        means.append((time.perf_counter_ns() - t0) / ITERS)
    t = torch.tensor([statistics.median(means)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return NBYTES / float(t[0]) * 2 * (2 - 1) / 2


def _rank_main(rank: int, ports: list[int], plan: str, folder: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
    )
    from rankscope.launch import sweep_worker

    plain = []
    for k in range(ROUNDS):
        # Interleaved, so a change of load on the machine reaches both alike.
        os.environ["MASTER_PORT"] = str(ports[2 * k])
        out = Path(folder) / f"round{k}.json"
        assert sweep_worker.main([f"--plan={plan}", f"--out={out}", "--backend=gloo"]) == 0
        plain.append(_independent_busbw(rank, ports[2 * k + 1]))
    if rank == 0:
        (Path(folder) / "plain.json").write_text(json.dumps(plain))


@pytest.mark.slow  # timing of two loops on a shared machine: the slow tier, run unloaded
@pytest.mark.torch
def test_worker_busbw_matches_an_independent_loop_on_gloo(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ports import free_port_pair

    plan = SweepPlan(
        job="t",
        parent_run="p",
        run="p-sweep-full",
        scope="full",
        hosts=("localhost",),
        ranks=(0, 1),
        nproc_per_node=2,
        targets=(SweepTarget("world", (0, 1), "all_reduce", (NBYTES,)),),
        warmup=2,
        iters=ITERS,
        repeats=REPEATS,
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_dict()))
    ports = [free_port_pair() for _ in range(ROUNDS)]
    ports = [p + d for p in ports for d in (0, 1)]
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, ports, str(plan_file), str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    sweep: list[Any] = []
    for k in range(ROUNDS):
        (point,) = sweep_points(json.loads((tmp_path / f"round{k}.json").read_text()))
        assert point.op == "all_reduce" and point.n == 2 and point.nbytes == NBYTES
        sweep.append(point.busbw_gbps)
    plain = json.loads((tmp_path / "plain.json").read_text())
    # Paired by round (the two loops ran back to back, under the same load), then the
    # median over rounds.
    ratio = statistics.median(s / p for s, p in zip(sweep, plain, strict=True))
    print(f"gloo loopback 1 MiB all_reduce busbw: sweep {sweep}, plain {plain}, ratio {ratio:.3f}")
    # A convention error (bits for bytes, algbw for busbw at n > 2, a time unit) is a
    # factor of 2 or more; the band leaves room for the noise of a shared machine.
    assert 0.75 <= ratio <= 1.33, (sweep, plain)


# -- the whole path on a real gloo job ----------------------------------------------------


def _wait_run(hub: Any, pred: Any, steps: int, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [r for r in hub.store.runs() if pred(r)]
        if runs and runs[0].steps_complete >= steps:
            return runs[0]
        time.sleep(0.1)
    raise AssertionError(f"no matching run with {steps} steps: {hub.store.runs()}")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.timeout(600)
def test_a_gloo_job_is_swept_through_torchrun_and_reported_as_a_sweep_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import subprocess
    import sys

    from ports import free_port_pair

    from rankscope.hub.server import Hub

    script = Path(__file__).resolve().parents[1] / "examples" / "tiny_ddp.py"
    rec = tmp_path / "rec"
    with Hub(record_dir=str(rec)) as hub:
        parent = [sys.executable, "-m", "rankscope", "run", "--hub", hub.endpoint]
        parent += ["--job", "tiny", "--run", "tiny-full", "--", "torchrun"]
        parent += ["--nproc-per-node=2", f"--master-port={free_port_pair()}", str(script)]
        done = subprocess.run([*parent, "--steps=6"], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        _wait_run(hub, lambda r: r.run == "tiny-full", 6)
        time.sleep(1.0)
        argv = ["sweep", str(rec), "--scope", "full", "--launcher", "torchrun", "--backend=gloo"]
        argv += ["--sizes", "64K", "1M", "--master-port", str(free_port_pair())]
        code = main([*argv, "--yes", "--json"])
        res = json.loads(capsys.readouterr().out)
        assert code == 0, res
        child = _wait_run(hub, lambda r: r.parent_run == "tiny-full", 1)
    assert child.scope == "sweep" and child.run == res["run"]
    assert res["backend"] == "gloo" and res["points"]
    assert {p["nbytes"] for p in res["points"]} == {1 << 16, 1 << 20}
    assert all(p["busbw_gbps"] > 0 for p in res["points"])
    assert Path(res["result"]).parent == rec / "sweeps"
