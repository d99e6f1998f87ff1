"""Rerun plans pick the right hosts and ranks for each scope from a Window."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rankscope.diagnosis.synthetic import make_window, rank_layout
from rankscope.launch.plan import Suspect, busy_ns, job_config, propose
from rankscope.launch.scopes import LADDER, MECHANISMS, eliminated_by, implicated_by

MS = 1e6


def _window(busy_by_rank: dict[int, float] | None = None, *, manifest=None, steps: int = 6):
    """32 ranks on 4 hosts of 8 (2 hosts a rack, rail = local rank). Every step lasts
    100 ms; a rank busy for b ms waits 100 - b ms at the collectives."""
    world = 32
    ranks = rank_layout(world, ranks_per_host=8, hosts_per_rack=2)
    busy = np.full(world, 80.0)
    busy[24:32] = 70.0  # host 3 is the least busy, but in the other rack
    for r, b in (busy_by_rank or {13: 100.0}).items():
        busy[r] = b
    t_start = np.tile(np.arange(steps) * 100.0 * MS, (world, 1))
    t_end = t_start + 100.0 * MS
    wait = np.repeat(((100.0 - busy) * MS)[:, None], steps, axis=1)
    win = make_window(
        t_start, t_end, ranks=ranks, coll={"exposed_wait_ns": wait}, manifest=manifest or {}
    )
    return dataclasses.replace(win, job="llm", run="r1")


def test_busy_time_is_step_minus_wait() -> None:
    busy = busy_ns(_window())
    assert busy[13] == pytest.approx(100 * MS)
    assert busy[0] == pytest.approx(80 * MS)


def test_one_rank_takes_the_slowest_ranks_device() -> None:
    plan = propose(_window(), [], "one-rank")
    assert plan.ranks == (13,)
    assert plan.hosts == ("node0001",)
    assert plan.gpus == (5,)
    assert (plan.world_size, plan.nproc_per_node, plan.nnodes) == (1, 1, 1)
    assert "rank 13" in plan.reason
    assert plan.parent_run == "r1" and plan.run == "r1-one-rank"


def test_one_rank_follows_the_hypothesis() -> None:
    hyp = Suspect("slow_device", 0.9, ranks=(20,), hosts=("node0002",))
    plan = propose(_window(), [hyp], "one-rank")
    assert plan.ranks == (20,)
    assert plan.hosts == ("node0002",)
    assert plan.gpus == (4,)


def test_one_node_is_the_suspect_node() -> None:
    plan = propose(_window(), [], "one-node")
    assert plan.hosts == ("node0001",)
    assert plan.ranks == tuple(range(8, 16))
    assert plan.gpus == tuple(range(8))
    assert plan.nproc_per_node == 8 and plan.world_size == 8
    plan = propose(_window(), [{"mechanism": "local_fabric", "hosts": ["node0002"]}], "one-node")
    assert plan.hosts == ("node0002",)
    assert plan.ranks == tuple(range(16, 24))


def test_two_node_pairs_the_suspect_with_a_healthy_peer() -> None:
    plan = propose(_window(), [], "two-node")
    # node0000 shares node0001's rack; node0003 is less busy but a rack away.
    assert plan.hosts == ("node0001", "node0000")
    assert plan.ranks == tuple(range(16))
    assert plan.nproc_per_node == 8 and plan.world_size == 16
    assert "node0000" in plan.reason
    # Without a same-rack candidate, the least busy host wins.
    win = _window({13: 100.0, 0: 95.0})
    hyp = Suspect("slow_host_input", 0.8, hosts=("node0001", "node0000"))
    assert propose(win, [hyp], "two-node").hosts == ("node0001", "node0003")


def test_two_node_for_a_rail_takes_the_pair_across_it() -> None:
    hyp = Suspect("network_rail", 0.8, ranks=(19, 27), hosts=("node0002", "node0003"), rails=(3,))
    plan = propose(_window(), [hyp], "two-node")
    assert plan.hosts == ("node0002", "node0003")
    assert plan.ranks == tuple(range(16, 32))
    # Only one host named: the peer must also have a rank on the suspect rail.
    ranks = rank_layout(32, ranks_per_host=8, hosts_per_rack=2)
    rail = ranks.rail.copy()
    rail[0:8] = 9  # node0000 has no rail 3
    win = dataclasses.replace(_window(), ranks=dataclasses.replace(ranks, rail=rail))
    hyp = Suspect("network_rail", 0.8, hosts=("node0001",), rails=(3,))
    plan = propose(win, [hyp], "two-node")
    assert plan.hosts[0] == "node0001"
    assert plan.hosts[1] != "node0000"
    assert "rail 3" in plan.reason


def test_two_node_for_placement_takes_the_hosts_the_group_spans() -> None:
    hyp = Suspect("placement", 0.7, ranks=(20, 21, 28, 29), hosts=("node0002", "node0003"))
    plan = propose(_window(), [hyp], "two-node")
    assert plan.hosts == ("node0002", "node0003")
    assert "misplaced group" in plan.reason


def test_full_keeps_everything_suspect_first() -> None:
    plan = propose(_window(), [Suspect("slow_device", 0.9, ranks=(27,))], "full")
    assert plan.hosts[0] == "node0003"
    assert sorted(plan.hosts) == ["node0000", "node0001", "node0002", "node0003"]
    assert plan.ranks == tuple(range(32))
    assert plan.changes[0].before == plan.changes[0].after == "32"


def test_batch_changes_keep_local_work_or_the_global_batch() -> None:
    manifest = {"config": {"micro_batch": 4, "grad_accum": 2, "global_batch": 256}}
    assert job_config(manifest) == {"micro_batch": 4, "grad_accum": 2, "global_batch": 256}
    plan = propose(_window(manifest=manifest), [], "one-node")
    assert plan.batch == {"micro_batch": 4, "grad_accum": 2, "global_batch": 64}
    names = [c.name for c in plan.changes]
    assert names == ["world size", "global batch"]
    assert (plan.changes[1].before, plan.changes[1].after) == ("256", "64")
    assert any("micro batch (4)" in p for p in plan.preserved)
    kept = propose(_window(manifest=manifest), [], "one-node", keep_global_batch=True)
    assert kept.batch == {"micro_batch": 4, "grad_accum": 8, "global_batch": 256}
    assert kept.changes[1].name == "gradient accumulation"
    # Not divisible: the plan says so instead of pretending.
    # Tensor parallel: 32 ranks are 4 replicas; the global batch scales with the world.
    tp = {"job_config": {"micro_batch": 1, "grad_accum": 3, "global_batch": 12}}
    plan = propose(_window(manifest=tp), [], "two-node")
    assert plan.batch == {"micro_batch": 1, "grad_accum": 3, "global_batch": 6}
    odd = {"config": {"micro_batch": 4, "grad_accum": 1}}
    plan = propose(_window(manifest=odd), [Suspect("slow_device", ranks=(1,))], "one-rank")
    assert plan.batch["global_batch"] == 4
    plan = propose(_window(manifest={}), [], "one-node")
    assert any("micro_batch" in w for w in plan.warnings)


def test_data_imbalance_keeps_the_very_same_batches() -> None:
    plan = propose(_window(), [Suspect("data_imbalance", 0.9)], "one-node")
    assert any("very same packed batches" in p and "shards" in p for p in plan.preserved)
    assert plan.shards == tuple(range(8, 16))
    other = propose(_window(), [Suspect("local_fabric", 0.9)], "one-node")
    assert any("sequence-length distribution" in p for p in other.preserved)


def test_expectations_follow_each_mechanisms_smallest_scope() -> None:
    hyps = [
        Suspect("slow_device", 0.7),
        Suspect("network_rail", 0.2),
        Suspect("healthy", 0.1),
        Suspect("checkpoint", 0.0),
    ]
    exp = {e.mechanism: e for e in propose(_window(), hyps, "one-node").expectations}
    assert set(exp) == {"slow_device", "network_rail"}  # healthy and score-0 ones left out
    assert exp["slow_device"].should_reproduce
    assert not exp["network_rail"].should_reproduce
    assert "two-node" in exp["network_rail"].if_absent
    exp2 = {e.mechanism: e for e in propose(_window(), hyps, "two-node").expectations}
    assert exp2["network_rail"].should_reproduce
    assert exp2["network_rail"].if_appears.startswith("supports network_rail")


def test_bad_requests_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="scope"):
        propose(_window(), [], "custom")
    one_host = make_window(np.zeros((8, 2)), np.ones((8, 2)), ranks=rank_layout(8))
    with pytest.raises(ValueError, match="two"):
        propose(one_host, [], "two-node")
    empty = make_window(np.full((8, 2), np.nan), np.full((8, 2), np.nan), ranks=rank_layout(8))
    with pytest.raises(ValueError, match="no step"):
        propose(empty, [], "one-rank")


def test_scope_table_matches_the_method() -> None:
    assert LADDER == ("one-rank", "one-node", "two-node", "full")
    assert MECHANISMS["slow_device"].first_scope == "one-rank"
    assert MECHANISMS["data_imbalance"].first_scope == "one-node"
    assert MECHANISMS["local_fabric"].first_scope == "one-node"
    assert MECHANISMS["network_rail"].first_scope == "two-node"
    assert MECHANISMS["placement"].first_scope == "two-node"
    assert "slow_device" in eliminated_by("one-node")
    assert "local_fabric" not in eliminated_by("one-node")
    assert set(implicated_by("two-node")) == {"placement", "network_rail"}
    assert eliminated_by("one-rank") == ()
