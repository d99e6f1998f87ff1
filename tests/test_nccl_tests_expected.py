"""An imported nccl-tests recording given as ``--baseline`` is the fabric's expected curve:
``diagnose --json`` sets each application point next to nccl-tests' busbw at the same op and
size (``curves.points[].expected_busbw_gbps``, ``curves.expected``), judges the slow rail's
groups below it and the healthy fabric at it, and is not compared with as a run of the job
(no step-time ratio against a benchmark). The ladder takes it as its bandwidth reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simrec import record_sim

from rankscope.cli import main
from rankscope.collector.schema import OP_INDEX
from rankscope.commands.grammar import load_run
from rankscope.diagnosis.curves import (
    EXPECTED_SHARE,
    bus_factor,
    compare_expected,
    expected_curve,
    message_curves,
    split_baseline,
)
from rankscope.hub.importers import write_recording
from rankscope.launch.ladder import build_ladder

RANKS = 16
HOSTS = ("node000", "node001", "node002", "node003")
HEALTHY_BUSBW = 48.0
"""What nccl-tests would measure on the simulated fabric across its hosts (GB/s): its
healthy cross-host all-reduce runs at ~44-46 GB/s inside the job."""
SIZES = [1 << k for k in range(20, 30)]  # 1 MiB .. 512 MiB: the run's dp all-reduce sizes


def _record(scenario: str, rec: Path) -> None:
    record_sim(scenario, rec, ranks=RANKS, steps=8, run_id="p")


def nccl_tests_json(busbw: float) -> str:
    """An all_reduce_perf ``-J`` file (util.cu's layout) of 16 ranks, 4 per host, at a
    flat ``busbw`` (GB/s) over ``SIZES``."""
    f = float(bus_factor([OP_INDEX["all_reduce"]], [RANKS])[0])
    rows = []
    for s in SIZES:
        alg = busbw / f
        t = s / alg / 1e3
        place = f'{{"time":{t:f},"alg_bw":{alg:f},"bus_bw":{busbw:f},"nwrong":{0.0:f}}}'
        rows.append(
            f'{{"size":{s},"count":{s // 4},"type":"float","redop":"sum","root":"    -1",'
            f'"out_of_place":{place},"in_place":{place},"actual_iterations":20,'
            f'"experiment_name":""}}'
        )
    devices = ",".join(
        f'{{"rank":{4 * p},"group":0,"pid":{p},"hostname":"{h}","device":0,'
        f'"device_hex":"0000:1b:00","device_info":"H100"}}'
        for p, h in enumerate(HOSTS)
    )
    return (
        '{"version":2,"start_time":"2026-12-03 16:00:00","args":["./build/all_reduce_perf",'
        '"-b","1M","-e","512M","-f","2","-g","4","-J","fabric.json"],"env":[],'
        '"nccl_version":22703,"config":{"nthreads":1,"ngpus":4,"minimum_bytes":1048576,'
        '"maximum_bytes":536870912,"step_factor":2,"warmup_iters":1,"iterations":20,'
        '"aggregated_iterations":1,"validation":1,"graph":0,"blocking_collectives":"false",'
        f'"per_iter_timing":"false","parallel_init":"false","devices":[{devices}]}},'
        f'"results":[{",".join(rows)}],"out_of_bounds":{{"count":0,"okay":"true"}},'
        f'"average_bus_bandwidth":{{"bandwidth":{busbw:f},"okay":"unchecked"}},'
        '"errors":[],"end_time":"2026-12-03 16:00:09"}'
    )


@pytest.fixture(scope="module")
def recs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("expected")
    out = {"rail": root / "rail", "healthy": root / "healthy", "fabric": root / "fabric"}
    _record("network-rail", out["rail"])
    _record("healthy", out["healthy"])
    src = root / "fabric.json"
    src.write_text(nccl_tests_json(HEALTHY_BUSBW))
    rep = write_recording("nccl-tests", [src], out["fabric"], run="fabric")
    assert rep.problems == [] and rep.ranks == RANKS
    return out


def _diagnose(rec: Path, fabric: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert main(["diagnose", str(rec), "--baseline", str(fabric), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_slow_rail_is_below_the_nccl_tests_curve(
    recs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _diagnose(recs["rail"], recs["fabric"], capsys)
    # Not a run of the job: nothing is compared with it as one.
    assert out["run"]["baseline_run"] is None
    assert out["distributions"]["baseline"] is None and out["curves"]["shifts"] == []
    ex = out["curves"]["expected"]
    assert ex["source_run"] == "fabric" and ex["share"] == EXPECTED_SHARE
    assert ex["finding"] == "fabric_underperforms"
    below = {p["group"] for p in ex["points"] if p["below"]}
    fine = {p["group"] for p in ex["points"] if not p["below"]}
    # network-rail slows the rail of dp0.2: its group, and only it, is below expected.
    assert below == {"dp0.2"} and fine == {"dp0.0", "dp0.1", "dp0.3"}
    pts = {p["group"]: p for p in out["curves"]["points"] if p["group"].startswith("dp")}
    assert pts["dp0.2"]["expected_busbw_gbps"] == pytest.approx(HEALTHY_BUSBW, rel=1e-4)
    assert pts["dp0.2"]["expected_ratio"] < EXPECTED_SHARE
    assert all(pts[g]["expected_ratio"] >= EXPECTED_SHARE for g in fine)
    # The intra-host tp groups are not judged by a cross-host curve.
    tp = [p for p in out["curves"]["points"] if p["group"].startswith("tp")]
    assert tp and all(p["expected_busbw_gbps"] is None for p in tp)
    assert ex["unmatched"] == len(tp)
    # The verdict's fabric hypothesis carries it as evidence.
    (rail,) = [h for h in out["verdict"]["hypotheses"] if h["mechanism"] == "network_rail"]
    assert rail["groups"] == ["dp0.2"]
    assert any("nccl-tests measured" in e and "dp0.2" in e for e in rail["evidence"])


def test_healthy_fabric_meets_the_curve_and_a_faster_curve_does_not(
    recs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _diagnose(recs["healthy"], recs["fabric"], capsys)
    assert out["curves"]["expected"]["finding"] == "fabric_fine"
    # The same run against a fabric nccl-tests measured 3x faster: below everywhere.
    src = tmp_path / "fast.json"
    src.write_text(nccl_tests_json(3 * HEALTHY_BUSBW))
    write_recording("nccl-tests", [src], tmp_path / "fast", run="fast")
    out = _diagnose(recs["healthy"], tmp_path / "fast", capsys)
    ex = out["curves"]["expected"]
    assert ex["finding"] == "fabric_underperforms"
    assert {p["group"] for p in ex["points"] if p["below"]} == {f"dp0.{i}" for i in range(4)}


def test_ladder_takes_the_curve_as_its_bandwidth_reference(recs: dict[str, Path]) -> None:
    _, rail = load_run(str(recs["rail"]), None, 100)
    _, fabric = load_run(str(recs["fabric"]), None, 100)
    baseline, expected = split_baseline(fabric)
    assert baseline is None and expected is not None and expected.cross_host is True
    j = compare_expected(message_curves(rail.instances), rail, expected)
    assert j.points[0].group == "dp0.2"
    ladder = build_ladder(rail, [], expected=expected)
    (rung,) = ladder.rungs
    assert "nccl-tests" in ladder.reference
    assert rung.regression and rung.comm is not None and rung.comm.group == "dp0.2"
    assert rung.comm.reference_gbps == pytest.approx(HEALTHY_BUSBW, rel=1e-4)
    assert "nccl-tests" in rung.why
    # Same curve as expected_curve gives directly.
    e2 = expected_curve(fabric)
    assert list(e2.bucket) == [s.bit_length() - 1 for s in SIZES]


def test_a_rail_nccl_tests_also_finds_slow_is_not_the_jobs_doing(
    recs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nccl-tests measured 10 GB/s across these hosts: the slow rail's 9.2 GB/s is what the
    # fabric gives, so the application's curve meets the expected one.
    src = tmp_path / "slow.json"
    src.write_text(nccl_tests_json(10.0))
    write_recording("nccl-tests", [src], tmp_path / "slow", run="slow")
    out = _diagnose(recs["rail"], tmp_path / "slow", capsys)
    assert out["curves"]["expected"]["finding"] == "fabric_fine"
    (rail,) = [h for h in out["verdict"]["hypotheses"] if h["mechanism"] == "network_rail"]
    assert any("measured no more" in c and "dp0.2" in c for c in rail["caveats"])
    assert not any("nccl-tests measured" in e for e in rail["evidence"])
