"""The torchtitan-style reference workload (``examples/titan_like.py``: FSDP2 over ``dp``,
a ``torch.distributed.pipelining`` 1F1B schedule over ``pp``, gloo, CPU) under ``rankscope
run``, zero-code, recorded by a hub and diagnosed from the recording with ``rankscope
diagnose --json`` as the README shows. Two 4-rank runs (pp 2 x dp 2): the default split,
and the same with stage 0 given three times the blocks. Before them, fast checks of the
judge on hand-made windows: what measures a stage's work, and that bubbles alone are not it.

What a healthy run must read: not ``pipeline_imbalance``, nor any catalogued mechanism but
``cpu_contention``. On this shared 2-core machine (four ranks, other jobs) wall time is not a measure of
work: a stage can set the step for a while because its threads got fewer cores, and the
open world then rightly names a wall-time straggler (``unexplained_straggler``, or
``cpu_contention`` when one rank's share of CPU drops). So a healthy run may read healthy
or a straggler nobody's work explains, never a mechanism that blames the stages' work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis.engine import gather_evidence
from rankscope.diagnosis.parallelism import judge_pipeline_imbalance
from rankscope.diagnosis.synthetic import make_window, rank_layout

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "titan_like.py"
STEPS = 10
MICROBATCHES = 4  # the example's default
HEALTHY_ANSWERS = ("healthy", "cpu_contention", "unexplained_straggler")
"""What a run with balanced stages may read on a shared machine (module docstring)."""
MS = 1e6


# -- the judge on hand-made windows -----------------------------------------------------------
def _pipeline(wall0: float, cpu0: float, *, gpu: bool, seed: int = 0):
    """Two stages (ranks 0, 1 | 2, 3), 12 steps of 300 ms. Stage 1 computes 140 ms a step
    (wall) on 50 ms of CPU; stage 0 ``wall0`` on ``cpu0``; each idles in ``pp_wait`` what
    is left of the step but 10 ms."""
    rng = np.random.default_rng(seed)
    pp = np.array([0, 0, 1, 1])[:, None]
    ranks = rank_layout(4, ranks_per_host=4, pp=2)
    if not gpu:
        ranks = dataclasses.replace(ranks, gpu_index=np.full(4, -1, dtype=np.int32))
    step = 300 * MS
    t0 = np.tile(np.arange(12) * step, (4, 1)).astype(float)

    def jitter(a):
        return a * rng.normal(1.0, 0.03, (4, 12))

    wall = jitter(np.where(pp == 0, wall0, 140 * MS))
    cpu = jitter(np.where(pp == 0, cpu0, 50 * MS))
    wait = step - 10 * MS - wall
    split = {"forward": 0.4, "backward": 0.5, "optimizer": 0.1}
    return make_window(
        t0,
        t0 + step,
        ranks=ranks,
        phase_ns={**{p: wall * f for p, f in split.items()}, "pp_wait": wait},
        phase_cpu_ns={p: cpu * f for p, f in split.items()},
    )


def test_on_cpu_ranks_a_stage_that_is_only_slower_in_wall_time_is_not_heavier() -> None:
    # Stage 0 takes 1.4x the wall time on the same CPU time: its threads got the cores
    # less often (other processes), it does no more work.
    got = judge_pipeline_imbalance(gather_evidence(_pipeline(200 * MS, 50 * MS, gpu=False)))
    assert got.strength < 0.05, got


def test_on_gpu_ranks_the_wall_time_is_the_work() -> None:
    got = judge_pipeline_imbalance(gather_evidence(_pipeline(200 * MS, 50 * MS, gpu=True)))
    assert got.strength > 0.9 and got.ranks == (0, 1), got
    assert "local time" in got.evidence[0]


def test_on_cpu_ranks_more_cpu_time_is_a_heavier_stage() -> None:
    got = judge_pipeline_imbalance(gather_evidence(_pipeline(200 * MS, 100 * MS, gpu=False)))
    assert got.strength > 0.9 and got.ranks == (0, 1), got
    assert "CPU time" in got.evidence[0] and "2.0" in got.evidence[0], got.evidence


def test_bubbles_alone_are_not_an_imbalance() -> None:
    # Equal work; every stage idles half the step in bubbles.
    w = _pipeline(140 * MS, 50 * MS, gpu=True)
    assert np.nanmedian(w.phase_ns["pp_wait"]) > 0.45 * 300 * MS
    got = judge_pipeline_imbalance(gather_evidence(w))
    assert got.strength < 0.05, got


def test_a_split_as_heavy_in_the_baseline_is_no_regression() -> None:
    w = _pipeline(200 * MS, 100 * MS, gpu=False)
    alone = judge_pipeline_imbalance(gather_evidence(w))
    same = judge_pipeline_imbalance(
        gather_evidence(w, _pipeline(200 * MS, 100 * MS, gpu=False, seed=1))
    )
    balanced = _pipeline(140 * MS, 50 * MS, gpu=False, seed=1)
    new = judge_pipeline_imbalance(gather_evidence(w, balanced))
    assert same.strength < 0.6 * alone.strength and same.caveats, same
    assert new.strength == pytest.approx(alone.strength) and not new.caveats, new


# -- the reference workload, recorded ---------------------------------------------------------


def _record(
    folder: Path, job: str, *flags: str, layout: tuple[str, ...] = ("--pp", "2", "--dp", "2")
) -> dict[str, Any]:
    """Run the example as 4 ranks under ``rankscope run`` against a recording hub, then
    diagnose the recording from the command line."""
    pytest.importorskip("torch")
    from rankscope.hub.replay import load_run
    from rankscope.hub.server import Hub

    record = folder / "record"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["RANKSCOPE_KEYS"] = os.environ.get("RANKSCOPE_KEYS", "none")
    argv = [str(EXAMPLE), *layout, "--steps", str(STEPS), *flags]
    launch = ["--", "torchrun", "--standalone", "--nproc_per_node=4", *argv]
    with Hub("tcp://127.0.0.1:0", str(record)) as hub:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rankscope",
                "run",
                "--hub",
                hub.endpoint,
                "--job",
                job,
                *launch,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        # The ranks flush on exit; wait until the hub holds every rank-step.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs = hub.store.run_ids()
            if runs and int(hub.store.window(runs[-1]).present.sum()) >= 4 * STEPS:
                break
            time.sleep(0.2)
    _, window = load_run(record, None, 100)
    diag = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(record), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert diag.returncode == 0, diag.stderr[-3000:]
    return {"window": window, "diagnosis": json.loads(diag.stdout), "record": record}


REAL = (pytest.mark.torch, pytest.mark.slow)


def real(test):
    """A test that reads a recorded run (torch, the slower tier)."""
    for mark in REAL:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def balanced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _record(tmp_path_factory.mktemp("titan-balanced"), "titan-balanced")


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Stage 0 (embedding and 6 blocks) against stage 1 (2 blocks and the loss head).
    return _record(
        tmp_path_factory.mktemp("titan-heavy"),
        "titan-heavy",
        "--heavy-stage",
        "0",
        "--heavy-factor",
        "3",
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # Every block torch.compile'd (FSDP2 around compiled blocks): the layout, the pipeline's
    # rows and its bubbles are recorded as for the eager run.
    return _record(tmp_path_factory.mktemp("titan-compiled"), "titan-compiled", "--compile")


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # pp 2 x tp 2: each stage's MLPs colwise/rowwise over tp, whose all-reduces are
    # DTensor's functional collectives.
    return _record(
        tmp_path_factory.mktemp("titan-tp"),
        "titan-tp",
        layout=("--pp", "2", "--tp", "2", "--dp", "1"),
    )


def _stage_cpu(w: Any) -> np.ndarray:
    """Median over steps (warm-up left out) of each stage's median rank's CPU time in its
    forward and backward phases, from the recorded rows."""
    cpu = sum(w.phase_cpu_ns[p] for p in ("forward", "backward"))
    pp = w.ranks.mesh["pp"]
    return np.array([np.nanmedian(np.nanmedian(cpu[pp == s, 2:], axis=0)) for s in (0, 1)])


def _hypothesis(d: dict[str, Any], mechanism: str) -> dict[str, Any]:
    return next(h for h in d["verdict"]["hypotheses"] if h["mechanism"] == mechanism)


def _top(d: dict[str, Any]) -> list[tuple[str, float, list[int]]]:
    return [(h["mechanism"], h["score"], h["ranks"]) for h in d["verdict"]["hypotheses"][:3]]


@real
@pytest.mark.parametrize("case", ["balanced", "heavy", "compiled"])
def test_every_rank_has_its_mesh_coordinates_and_groups(case, request) -> None:
    w = request.getfixturevalue(case)["window"]
    assert w.world_size == 4
    # Mesh (pp, dp, tp) = (2, 2, 1), row-major: rank = 2 pp + dp.
    ranks = np.arange(4)
    assert w.ranks.mesh["pp"].tolist() == (ranks // 2).tolist()
    assert w.ranks.mesh["dp"].tolist() == (ranks % 2).tolist()
    assert w.ranks.mesh["tp"].tolist() == [0, 0, 0, 0]
    groups = {(g.name, tuple(sorted(g.ranks))) for g in w.groups.values()}
    for r in range(4):
        assert ("dp", (r - r % 2, r - r % 2 + 1)) in groups, groups
        assert ("pp", (r % 2, r % 2 + 2)) in groups, groups
        assert ("tp", (r,)) in groups, groups
    # One send/recv link each way between the stages, per dp rank.
    links = {g.name for g in w.groups.values() if g.name.startswith("p2p")}
    assert links == {"p2p 0->2", "p2p 2->0", "p2p 1->3", "p2p 3->1"}, links


@real
@pytest.mark.parametrize("case", ["balanced", "heavy", "compiled"])
def test_send_recv_rows_carry_stage_and_micro_batch(case, request) -> None:
    w = request.getfixturevalue(case)["window"]
    rows = w.rows
    assert rows is not None and len(rows)
    stage, micro = schema.pp_ids(np.asarray(rows.flags, dtype=np.int32))
    for r in range(4):
        mine = (rows.rank == r) & (stage >= 0)
        assert set(stage[mine].tolist()) == {r // 2}
        assert set(micro[mine].tolist()) == set(range(MICROBATCHES))
        # The bubbles are measured (pp_wait spans), on every rank.
        assert np.nanmedian(w.phase_ns["pp_wait"][r]) > 0


@real
def test_tensor_parallel_all_reduces_are_recorded_and_matched(tensor_parallel) -> None:
    w = tensor_parallel["window"]
    ranks = np.arange(4)
    # Mesh (pp, dp, tp) = (2, 1, 2): rank = 2 pp + tp.
    assert w.ranks.mesh["tp"].tolist() == (ranks % 2).tolist()
    assert w.ranks.mesh["pp"].tolist() == (ranks // 2).tolist()
    tp = {gid: g for gid, g in w.groups.items() if g.name == "tp"}
    assert {tuple(sorted(g.ranks)) for g in tp.values()} == {(0, 1), (2, 3)}, w.groups
    rows = w.rows
    assert rows is not None
    on_tp = np.isin(np.asarray(rows.group), list(tp))
    ar = on_tp & (np.asarray(rows.op) == schema.OP_INDEX["all_reduce"])
    # RowwiseParallel's all-reduce of the partial sums, in forward and backward, on
    # every rank, every step, micro-batch by micro-batch.
    for r in range(4):
        per_step = np.bincount(np.asarray(rows.step)[ar & (rows.rank == r)], minlength=STEPS)
        assert np.all(per_step[:STEPS] >= MICROBATCHES), (r, per_step)
    assert np.all(np.asarray(rows.flags)[ar] & schema.FLAG_ASYNC)
    # Both members of each all-reduce arrive: the instances match across the pair.
    inst = w.instances
    mine = np.isin(np.asarray(inst.group), list(tp))
    assert mine.sum() > 0 and np.all(np.asarray(inst.n_arrived)[mine] == 2)


@real
def test_balanced_split_is_not_a_pipeline_imbalance(balanced) -> None:
    # Two blocks a stage; the loss head costs the last about 3 % more multiply-adds. (No
    # check of that in CPU time here: on this machine the two stages of the same run were
    # seen 1.0-1.2x apart, the ranks of one stage 4-11 %.)
    d = balanced["diagnosis"]
    assert d["verdict"]["top"] in HEALTHY_ANSWERS, _top(d)
    assert _hypothesis(d, "pipeline_imbalance")["score"] < 0.5, _top(d)


@real
def test_heavy_stage_is_a_pipeline_imbalance_on_its_ranks(heavy) -> None:
    cpu = _stage_cpu(heavy["window"])
    assert cpu[0] > 1.5 * cpu[1], cpu / 1e6
    d = heavy["diagnosis"]
    assert d["verdict"]["top"] == "pipeline_imbalance", _top(d)
    top = _hypothesis(d, "pipeline_imbalance")
    assert sorted(top["ranks"]) == [0, 1], _top(d)
    assert any("pp=0" in e for e in top["evidence"]), top["evidence"]


@real
def test_heavy_stage_against_the_balanced_run(balanced, heavy) -> None:
    # The balanced run as baseline: its stage 0 was not heavy, so nothing is discounted.
    got = judge_pipeline_imbalance(gather_evidence(heavy["window"], balanced["window"]))
    assert got.ranks == (0, 1) and got.strength > 0.5 and not got.caveats, got
