"""The ladder's rule on hand-built windows: where the regression first appears."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rankscope.collector.schema import OP_INDEX
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout
from rankscope.launch.ladder import Tolerances, build_ladder

MS = 1e6
STEPS = 8
MIB64 = 64 * 2**20


def _window(
    local_ms: np.ndarray,
    *,
    run: str,
    scope: str,
    parent: str | None = "full",
    hosts: int | None = None,
    tp_ms: dict[int, float] | None = None,
    host_names: tuple[str, ...] | None = None,
):
    """Ranks with the given local time (R, S); tp groups of 8 (one per host) each run one
    64 MiB all-reduce a step taking ``tp_ms[host]`` ms (5 ms default) after the last arrival."""
    local = np.asarray(local_ms, dtype=float) * MS
    world = local.shape[0]
    ranks = rank_layout(world, ranks_per_host=min(8, world))
    if host_names is not None:
        ranks = dataclasses.replace(ranks, hosts=host_names)
    n_hosts = len(ranks.hosts)
    members = [list(range(h * 8, min(world, h * 8 + 8))) for h in range(n_hosts)]
    groups = make_groups(ranks, members, [f"tp{h}" for h in range(n_hosts)]) if world > 1 else {}
    comm = np.zeros(world)
    rows: dict[str, list] = {k: [] for k in ("group", "seq", "step", "transfer", "n")}
    for gid, m in enumerate(members if world > 1 else []):
        t = (tp_ms or {}).get(gid, 5.0) * MS
        comm[m] = t
        for s in range(STEPS):
            for key, val in (("group", gid), ("seq", s), ("step", s), ("transfer", t)):
                rows[key].append(val)
            rows["n"].append(len(m))
    step = (local + comm[:, None]).max(axis=0)
    wait = step[None, :] - local - comm[:, None]
    t_start = np.tile(np.cumsum(np.r_[0, step[:-1]]), (world, 1))
    n = len(rows["group"])
    inst = instance_table(
        group=np.array(rows["group"]),
        seq=np.array(rows["seq"]),
        step=np.array(rows["step"]),
        op=np.full(n, OP_INDEX["all_reduce"]),
        nbytes=np.full(n, MIB64),
        n_members=np.array(rows["n"]),
        first=np.zeros(n),
        last=np.zeros(n),
        transfer=np.array(rows["transfer"], dtype=float),
    )
    win = make_window(
        t_start,
        t_start + step[None, :],
        ranks=ranks,
        groups=groups,
        coll={
            "exposed_wait_ns": wait,
            "exposed_transfer_ns": np.repeat(comm[:, None], STEPS, axis=1),
        },
        instances=inst,
        run=run,
        scope=scope,
    )
    return dataclasses.replace(win, parent_run=parent, job="llm")


def _flat(world: int, ms: float = 100.0) -> np.ndarray:
    rng = np.random.default_rng(world)
    return ms * (1 + 0.01 * rng.standard_normal((world, STEPS)))


def test_slow_device_first_appears_on_one_rank() -> None:
    full = _flat(32)
    full[13] *= 1.4
    one_rank = full[13:14]
    one_node = full[8:16]
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None),
        [
            _window(one_rank, run="c1", scope="one-rank"),
            _window(one_node, run="c2", scope="one-node"),
        ],
    )
    assert [r.scope for r in ladder.rungs] == ["one-rank", "one-node", "full"]
    assert all(r.regression for r in ladder.rungs)
    assert ladder.first_scope == "one-rank" and ladder.first_run == "c1"
    assert ladder.rungs[0].local_ratio == pytest.approx(1.4, rel=0.05)
    assert "kernel or host" in ladder.meaning
    assert ladder.eliminated == ()
    assert "slow_device" in ladder.implicated
    assert ladder.missing == ("two-node",)


def test_data_imbalance_needs_several_ranks_meeting() -> None:
    # Each step one random rank of each host gets a heavy batch: the slowest rank changes
    # from step to step, so one rank alone is usually fine but a node never is.
    rng = np.random.default_rng(3)
    full = _flat(32)
    for s in range(STEPS):
        for h in range(4):
            full[h * 8 + rng.integers(8), s] *= 1.5
    one_rank = full[13:14].copy()
    one_rank[0] = np.median(full[13])  # the kept rank's own batches, mostly light
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None),
        [
            _window(one_rank, run="c1", scope="one-rank"),
            _window(full[8:16], run="c2", scope="one-node"),
        ],
    )
    assert [r.regression for r in ladder.rungs] == [False, True, True]
    assert ladder.first_scope == "one-node"
    assert "slow_device" in ladder.eliminated
    assert "data_imbalance" in ladder.implicated and "local_fabric" in ladder.implicated


def test_local_fabric_shows_as_bandwidth_at_one_node() -> None:
    full = _flat(32)
    slow_tp = {1: 12.0}  # host 1's intra-node all-reduce takes 12 ms instead of 5
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None, tp_ms=slow_tp),
        [
            _window(full[13:14], run="c1", scope="one-rank"),
            _window(
                full[8:16],
                run="c2",
                scope="one-node",
                tp_ms={0: 12.0},
                host_names=("node0001",),
            ),
        ],
    )
    one_rank, one_node, whole = ladder.rungs
    assert not one_rank.regression
    assert one_node.regression and whole.regression
    assert one_node.comm is not None
    assert one_node.comm.ratio == pytest.approx(5 / 12, rel=1e-6)
    assert "tp0 all_reduce 64 MiB" in one_node.why
    assert whole.comm is not None and whole.comm.group == "tp1"
    assert ladder.first_scope == "one-node"


def test_clean_ladder_says_so_and_eliminates_what_it_can() -> None:
    full = _flat(32)
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None),
        [_window(full[8:24], run="c3", scope="two-node")],
    )
    assert not any(r.regression for r in ladder.rungs)
    assert ladder.first_scope is None
    assert "no measured scope" in ladder.meaning
    assert "network_rail" in ladder.eliminated


def test_a_baseline_reveals_what_the_parent_cannot() -> None:
    # Every rank does 25 % more work: the parent's own median rank moves with it, so only
    # a baseline shows the regression (a numerator change).
    base = _flat(32)
    full = base * 1.25
    kids = [_window(full[13:14], run="c1", scope="one-rank")]
    parent = _window(full, run="full", scope="full", parent=None)
    assert build_ladder(parent, kids).first_scope is None
    ladder = build_ladder(
        parent, kids, baseline=_window(base, run="base", scope="full", parent=None)
    )
    assert ladder.first_scope == "one-rank"
    assert ladder.reference == "baseline run 'base'"


def test_other_runs_and_custom_scopes_stay_off_the_ladder() -> None:
    full = _flat(16)
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None),
        [
            _window(full[:8], run="x", scope="one-node", parent="other"),
            _window(full[:8], run="y", scope="custom"),
        ],
    )
    assert [r.run for r in ladder.rungs] == ["full"]


def test_verdicts_are_shown_per_rung() -> None:
    full = _flat(16)
    verdicts = {"full": {"hypotheses": [{"mechanism": "slow_device", "score": 0.8}]}}
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None), [], verdicts=verdicts
    )
    assert (ladder.rungs[0].verdict, ladder.rungs[0].verdict_score) == ("slow_device", 0.8)


def test_decomposition_and_distribution_per_rung() -> None:
    full = _flat(16)
    rung = build_ladder(_window(full, run="full", scope="full", parent=None), []).rungs[0]
    assert sum(rung.decomposition.values()) == pytest.approx(rung.step.mean, rel=1e-9)
    assert rung.step.p50 <= rung.step.p90 <= rung.step.max
    assert rung.hosts == ("node0000", "node0001")
    with pytest.raises(ValueError, match="tolerance comm"):
        Tolerances(comm=2)


def test_a_parent_alone_is_only_the_smallest_measured_scope() -> None:
    # A slow device: with no rerun the ladder cannot claim the regression needs the full job.
    full = _flat(32)
    full[13] *= 1.4
    alone = build_ladder(_window(full, run="full", scope="full", parent=None), [])
    assert alone.first_scope == "full"
    assert alone.unmeasured_below == ("one-rank", "one-node", "two-node")
    assert "may first appear lower" in alone.meaning
    assert "slow_device" in alone.implicated  # a one-rank mechanism stays a suspect
    one_node = full[8:16]
    narrowed = build_ladder(
        _window(full, run="full", scope="full", parent=None),
        [_window(one_node, run="c2", scope="one-node")],
    )
    assert narrowed.first_scope == "one-node"
    assert narrowed.unmeasured_below == ("one-rank",)
    assert "slow_device" in narrowed.implicated


def test_a_one_host_job_is_its_own_one_node_and_two_node_rung() -> None:
    full = _flat(8)
    full[3] *= 1.4
    alone = build_ladder(_window(full, run="full", scope="full", parent=None), [])
    assert alone.first_scope == "full"
    assert alone.unmeasured_below == ("one-rank",)
    assert alone.missing == ("one-rank",)
    # Regressing as a whole, it regresses at one node: the one-node mechanisms, not the
    # full-scale ones, are what it implicates (with one rank's, not run).
    assert "is its own one-node rung" in alone.meaning
    assert {"slow_device", "data_imbalance", "local_fabric"} <= set(alone.implicated)
    assert "intermittent_congestion" not in alone.implicated


def test_a_clean_node_closes_the_scopes_inside_it() -> None:
    # The network case: one node clean, two nodes (the whole job) regress; one rank alone
    # was never run, but it lies inside the clean node.
    full = _flat(16)
    ladder = build_ladder(
        _window(full, run="full", scope="full", parent=None, tp_ms={0: 5.0, 1: 40.0}),
        [_window(full[:8], run="c2", scope="one-node")],
    )
    assert [r.regression for r in ladder.rungs] == [False, True]
    assert ladder.first_scope == "full" and ladder.unmeasured_below == ()
    # Two hosts: the whole job is the two-node rung, which points at the network.
    assert "is its own two-node rung" in ladder.meaning
    assert "network_rail" in ladder.implicated and "local_fabric" in ladder.eliminated
