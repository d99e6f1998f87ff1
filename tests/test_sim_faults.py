"""Each simulated fault shows where its mechanism acts and nowhere else.

Checks run on the tables the simulated ranks would send (the same columns the hub gets).
Where a scope leaves out what a mechanism needs, the run must be identical to the
scenario's healthy twin (same seed, fault removed): the fault has vanished, not shrunk.
"""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.sim import Cluster, ScopeSpec, StepTables, load_scenario

PH = schema.PHASE_INDEX


def simulate(cluster: Cluster, steps: int) -> list[StepTables]:
    return [cluster.step(k) for k in range(steps)]


def concat(tables: list[StepTables], name: str) -> dict[str, np.ndarray]:
    parts = [getattr(t, name) for t in tables]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def instances(tables: list[StepTables]) -> dict[str, np.ndarray]:
    """One row per collective instance (group, seq): members, first/last entry, the last
    arriving rank, and the transfer (median over members of exit - last entry)."""
    c = concat(tables, "colls")
    key = c["group"].astype(np.int64) << 40 | c["seq"]
    order = np.lexsort((c["t_enter"], key))
    key, enter, exit_, rank = key[order], c["t_enter"][order], c["t_exit"][order], c["rank"][order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    ends = np.r_[starts[1:], key.shape[0]]
    last = enter[ends - 1]
    by_exit = np.lexsort((exit_, key))
    exit_sorted = exit_[by_exit]
    transfer = (exit_sorted[starts + (ends - starts) // 2] - last).astype(float)
    return {
        "group": (key[starts] >> 40).astype(np.int64),
        "seq": key[starts] & ((1 << 40) - 1),
        "step": c["step"][order][starts],
        "flags": c["flags"][order][starts],
        "n": ends - starts,
        "first": enter[starts],
        "last": last,
        "skew": last - enter[starts],
        "last_rank": rank[ends - 1],
        "transfer": transfer,
    }


def group_members(cluster: Cluster) -> dict[int, list[int]]:
    return {g["id"]: g["ranks"] for g in cluster.groups}


def phase_per_rank(tables: list[StepTables], phase: str) -> np.ndarray:
    """(steps, ranks) total ns of one phase."""
    out = np.zeros((len(tables), tables[0].steps["step"].shape[0]))
    for i, t in enumerate(tables):
        p = t.phases
        m = p["phase"] == PH[phase]
        np.add.at(out[i], p["rank"][m], (p["t1"] - p["t0"])[m])
    return out


def step_ns(tables: list[StepTables]) -> np.ndarray:
    return np.stack([t.steps["t_end"] - t.steps["t_start"] for t in tables]).astype(float)


def assert_same_tables(a: list[StepTables], b: list[StepTables]) -> None:
    for ta, tb in zip(a, b, strict=True):
        for name in ("steps", "phases", "colls", "samples"):
            ca, cb = getattr(ta, name), getattr(tb, name)
            for col in ca:
                np.testing.assert_array_equal(ca[col], cb[col], err_msg=f"{name}.{col}")


def twin_tables(
    name: str, scope: ScopeSpec, steps: int, seed: int | None = None, **kw
) -> tuple[list, list, Cluster]:
    """Tables of a scenario (with fault overrides ``kw``) and of its healthy twin."""
    faulty = Cluster(load_scenario(name, seed=seed, **kw), scope)
    healthy = Cluster(load_scenario(name, seed=seed, fault="healthy"), scope)
    return simulate(faulty, steps), simulate(healthy, steps), faulty


def other_host(host: int, n_hosts: int) -> int:
    return (host + 1) % n_hosts


# -- slow device ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [3, 21])
def test_slow_device_is_last_in_its_collectives_at_every_scope_that_holds_it(seed: int) -> None:
    sc = load_scenario("slow-device", seed=seed)
    gph = sc.topology.gpus_per_host
    host = sc.fault.device // gph
    scopes = [
        ScopeSpec("full"),
        ScopeSpec("one-node", hosts=(host,)),
        ScopeSpec("two-node", hosts=(host, other_host(host, sc.topology.hosts))),
    ]
    for scope in scopes:
        cluster = Cluster(sc, scope)
        (slow,) = cluster.truth["ranks"]
        tables = simulate(cluster, 6)
        inst = instances(tables)
        members = group_members(cluster)
        holds = np.array([slow in members[g] for g in inst["group"]])
        assert holds.sum() > 20
        share = np.mean(inst["last_rank"][holds] == slow)
        assert share > 0.9, (scope, share)
        # nobody else is last that consistently in the groups without it
        others = inst["last_rank"][~holds]
        if others.size:
            counts = np.bincount(others)
            assert counts.max() / others.size < 0.5
        samples = concat(tables, "samples")
        at = samples["rank"] == slow
        assert np.all(samples["throttle"][at] != 0)
        assert np.all(samples["throttle"][~at] == 0)
        nominal = sc.topology.sm_clock_mhz
        assert samples["sm_clock_mhz"][at].mean() < 0.9 * nominal
        assert samples["sm_clock_mhz"][~at].min() > 0.97 * nominal


def test_slow_device_shows_at_one_rank_scope_only_on_its_gpu() -> None:
    sc = load_scenario("slow-device")
    gph = sc.topology.gpus_per_host
    bad_host, bad_gpu = divmod(sc.fault.device, gph)
    good_gpu = (bad_gpu + 1) % gph
    slow = simulate(Cluster(sc, ScopeSpec("one-rank", hosts=(bad_host,), gpus=(bad_gpu,))), 4)
    fine = simulate(Cluster(sc, ScopeSpec("one-rank", hosts=(bad_host,), gpus=(good_gpu,))), 4)
    assert len(slow[0].colls["op"]) == 0  # a single rank has no peer to wait for
    ratio = np.median(step_ns(slow)) / np.median(step_ns(fine))
    # compute dominates a one-rank step: it slows by about 1/speed
    assert ratio > 1.0 + 0.5 * (1.0 / sc.fault.magnitude - 1.0)
    assert concat(slow, "samples")["throttle"][0] != 0
    assert concat(fine, "samples")["throttle"][0] == 0


def test_slow_device_vanishes_on_another_node() -> None:
    sc = load_scenario("slow-device")
    host = other_host(sc.fault.device // sc.topology.gpus_per_host, sc.topology.hosts)
    faulty, healthy, cluster = twin_tables("slow-device", ScopeSpec("one-node", hosts=(host,)), 4)
    assert cluster.truth["present"] is False and cluster.truth["mechanism"] == "healthy"
    assert_same_tables(faulty, healthy)


@pytest.mark.parametrize("name", ["slow-device", "network-rail"])
def test_a_fault_with_an_onset_leaves_the_steps_before_it_healthy(name: str) -> None:
    faulty, healthy, cluster = twin_tables(name, ScopeSpec("full"), 6, fault__onset=3)
    assert cluster.truth["onset"] == 3
    assert_same_tables(faulty[:3], healthy[:3])
    always = simulate(Cluster(load_scenario(name), ScopeSpec("full")), 6)
    # From the onset on, the cluster is the faulty one (its clock carries the healthy past).
    late = step_ns(faulty[3:]) - step_ns(healthy[3:])
    assert np.median(late) > 0
    np.testing.assert_array_equal(
        faulty[5].samples["throttle"], always[5].samples["throttle"], err_msg="samples"
    )


# -- packing imbalance ----------------------------------------------------------------------


def _first_bucket(inst: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    buckets = (inst["flags"] & schema.FLAG_DDP_BUCKET) != 0
    sel = {k: v[buckets] for k, v in inst.items()}
    first = np.zeros(sel["seq"].shape[0], dtype=bool)
    for step in np.unique(sel["step"]):
        at = np.flatnonzero(sel["step"] == step)
        first[at[np.argmin(sel["seq"][at])]] = True
    return {k: v[first] for k, v in sel.items()}


@pytest.mark.parametrize("seed", [None, 40])
def test_packing_imbalance_moves_the_last_rank_and_compute_tracks_attention_cost(
    seed: int | None,
) -> None:
    cluster = Cluster(load_scenario("data-imbalance", seed=seed))
    assert cluster.layout.tp == 1 and cluster.layout.pp == 1
    warm = cluster.truth["warmup_steps"]
    tables = simulate(cluster, warm + 12)[warm:]
    first = _first_bucket(instances(tables))
    # the rank the all-reduce waits for changes from step to step
    assert np.unique(first["last_rank"]).size >= 6
    steps = concat(tables, "steps")
    tokens = steps["tokens"].reshape(12, -1)
    attn = steps["attn_cost"].reshape(12, -1)
    compute = phase_per_rank(tables, "forward") + phase_per_rank(tables, "backward")
    for k in range(12):
        # tokens are balanced (one cut of the concatenated stream per rank) ...
        assert tokens[k].max() - tokens[k].min() <= 0.001 * tokens[k].mean()
        # ... so compute differences follow the attention cost
        assert np.corrcoef(compute[k], attn[k])[0, 1] > 0.9
    # the last arriver is one of the ranks with the most attention work
    top = [int(first["last_rank"][k]) in np.argsort(-attn[k])[:4] for k in range(12)]
    assert np.mean(top) >= 0.75


@pytest.mark.parametrize("scope", ["full", "one-node"])
def test_attention_balanced_packer_cuts_entry_spread(scope: str) -> None:
    faulty, healthy, _ = twin_tables("data-imbalance", ScopeSpec(scope), 10)
    spread_bad = np.median(_first_bucket(instances(faulty))["skew"])
    spread_good = np.median(_first_bucket(instances(healthy))["skew"])
    assert spread_bad > 2.0 * spread_good
    # post-arrival service is the same: the collectives did not get slower
    t_bad = np.median(_first_bucket(instances(faulty))["transfer"])
    t_good = np.median(_first_bucket(instances(healthy))["transfer"])
    assert 0.8 < t_bad / t_good < 1.25
    # valid tokens per step are the same with both packers
    v_bad = concat(faulty, "steps")["valid_tokens"].sum()
    v_good = concat(healthy, "steps")["valid_tokens"].sum()
    assert abs(v_bad - v_good) <= 0.001 * v_good


# -- network rail ---------------------------------------------------------------------------


def _transfer_by_group(inst, bucket: bool) -> dict[int, float]:
    sel = ((inst["flags"] & schema.FLAG_DDP_BUCKET) != 0) == bucket
    out = {}
    for g in np.unique(inst["group"][sel]):
        out[int(g)] = float(np.median(inst["transfer"][sel & (inst["group"] == g)]))
    return out


@pytest.mark.parametrize("seed", [None, 33])
def test_degraded_rail_slows_only_groups_crossing_hosts_on_that_rail(seed: int | None) -> None:
    faulty, healthy, cluster = twin_tables("network-rail", ScopeSpec("full"), 5, seed=seed)
    rail = cluster.scenario.fault.rail
    members = group_members(cluster)
    gpu = cluster.layout.gpu
    bad = _transfer_by_group(instances(faulty), bucket=True)
    good = _transfer_by_group(instances(healthy), bucket=True)
    for g, t in bad.items():
        on_rail = all(gpu[r] == rail for r in members[g])
        ratio = t / good[g]
        assert (ratio > 2.0) if on_rail else (0.8 < ratio < 1.25), (g, on_rail, ratio)
    # intra-host (tensor-parallel) transfer is untouched
    tp_bad = np.median(list(_transfer_by_group(instances(faulty), bucket=False).values()))
    tp_good = np.median(list(_transfer_by_group(instances(healthy), bucket=False).values()))
    assert 0.9 < tp_bad / tp_good < 1.1


def test_degraded_rail_reproduces_on_two_nodes_and_vanishes_on_one() -> None:
    faulty, healthy, cluster = twin_tables("network-rail", ScopeSpec("one-node", hosts=(3,)), 4)
    assert cluster.truth["present"] is False
    assert_same_tables(faulty, healthy)
    faulty, healthy, cluster = twin_tables("network-rail", ScopeSpec("two-node", hosts=(3, 4)), 4)
    assert cluster.truth["present"] is True
    rail = cluster.scenario.fault.rail
    bad = _transfer_by_group(instances(faulty), bucket=True)
    good = _transfer_by_group(instances(healthy), bucket=True)
    members = group_members(cluster)
    slowed = [g for g in bad if bad[g] > 2.0 * good[g]]
    assert slowed and all(cluster.layout.gpu[members[g][0]] == rail for g in slowed)


# -- local fabric, host input, placement ----------------------------------------------------


def test_local_fabric_slows_tensor_parallel_transfer_on_one_host_only() -> None:
    sc = load_scenario("local-fabric")
    host = sc.fault.host
    faulty, healthy, cluster = twin_tables("local-fabric", ScopeSpec("full"), 4)
    members = group_members(cluster)
    bad = _transfer_by_group(instances(faulty), bucket=False)
    good = _transfer_by_group(instances(healthy), bucket=False)
    for g in bad:
        on_host = all(cluster.layout.host[r] == host for r in members[g])
        ratio = bad[g] / good[g]
        assert (ratio > 3.0) if on_host else (0.8 < ratio < 1.25), (g, on_host, ratio)
    one, one_h, c1 = twin_tables("local-fabric", ScopeSpec("one-node", hosts=(host,)), 3)
    assert c1.truth["present"]
    assert np.median(instances(one)["transfer"]) > 3.0 * np.median(instances(one_h)["transfer"])
    elsewhere = ScopeSpec("one-node", hosts=(other_host(host, sc.topology.hosts),))
    faulty, healthy, _ = twin_tables("local-fabric", elsewhere, 3)
    assert_same_tables(faulty, healthy)


def test_slow_host_input_shows_as_input_time_on_that_host() -> None:
    sc = load_scenario("slow-host-input")
    host = sc.fault.host
    cluster = Cluster(sc)
    tables = simulate(cluster, 6)
    inp = phase_per_rank(tables, "input")
    on_host = cluster.layout.host == host
    assert np.median(inp[:, on_host]) > 10 * np.median(inp[:, ~on_host])
    assert sorted(cluster.truth["ranks"]) == np.flatnonzero(on_host).tolist()
    one = simulate(Cluster(sc, ScopeSpec("one-rank", hosts=(host,), gpus=(0,))), 3)
    assert np.median(phase_per_rank(one, "input")) > 0.5 * sc.fault.magnitude * 1e6
    elsewhere = ScopeSpec("one-node", hosts=(other_host(host, sc.topology.hosts),))
    faulty, healthy, _ = twin_tables("slow-host-input", elsewhere, 3)
    assert_same_tables(faulty, healthy)


@pytest.mark.parametrize("seed", [None, 30])
def test_bad_placement_puts_tensor_parallel_groups_across_hosts(seed: int | None) -> None:
    sc = load_scenario("placement", seed=seed)
    a, b = sc.fault.host, sc.fault.peer_host
    faulty, _healthy, cluster = twin_tables("placement", ScopeSpec("full"), 4, seed=seed)
    members = group_members(cluster)
    inst = instances(faulty)
    tp_groups = {g["id"] for g in cluster.groups if g["name"].startswith("tp")}
    crossing = {g for g in tp_groups if len(set(cluster.layout.host[members[g]])) > 1}
    assert len(crossing) == 2
    assert {int(h) for g in crossing for h in cluster.layout.host[members[g]]} == {a, b}
    assert set(cluster.truth["ranks"]) == {r for g in crossing for r in members[g]}
    bad = _transfer_by_group(inst, bucket=False)
    slow = {g for g in tp_groups if bad[g] > 3 * np.median(list(bad.values()))}
    assert slow == crossing
    # reproduces on exactly that pair of hosts, not on one of them
    pair, pair_h, cp = twin_tables("placement", ScopeSpec("two-node", hosts=(a, b)), 3, seed=seed)
    assert len(cp.layout.moved) > 0
    tp_pair = _transfer_by_group(instances(pair), bucket=False)
    tp_pair_h = _transfer_by_group(instances(pair_h), bucket=False)
    assert max(tp_pair.values()) > 3 * max(tp_pair_h.values())
    one, one_h, c1 = twin_tables("placement", ScopeSpec("one-node", hosts=(a,)), 3, seed=seed)
    assert not c1.truth["present"]
    assert_same_tables(one, one_h)


# -- time-shaped faults ---------------------------------------------------------------------


def test_checkpoint_interference_is_periodic() -> None:
    sc = load_scenario("checkpoint")
    every = sc.fault.every
    cluster = Cluster(sc)
    tables = simulate(cluster, 2 * every + 1)
    ckpt = phase_per_rank(tables, "checkpoint").max(axis=1)
    due = np.array([(k + 1) % every == 0 for k in range(len(tables))])
    assert np.all(ckpt[due] > 0.5 * sc.fault.magnitude * 1e9)
    assert np.all(ckpt[~due] == 0)
    slowest = step_ns(tables).max(axis=1)
    assert slowest[due].min() > 2 * np.median(slowest[~due])
    barriers = concat(tables, "colls")
    is_barrier = barriers["op"] == schema.OP_INDEX["barrier"]
    assert set(np.unique(barriers["step"][is_barrier])) == set(np.flatnonzero(due))


def test_allocator_growth_trends_with_time_since_start() -> None:
    warm = load_scenario("allocator-growth").noise.warmup_steps
    n = warm + 12
    faulty, healthy, cluster = twin_tables("allocator-growth", ScopeSpec("full"), n)
    mem = phase_per_rank(faulty, "memory").mean(axis=1)
    assert np.corrcoef(np.arange(n), mem)[0, 1] > 0.95
    reserved = np.array([t.steps["mem_reserved"].mean() for t in faulty])
    assert np.all(np.diff(reserved) > 0)
    assert phase_per_rank(healthy, "memory").sum() == 0
    # after the warm-up, the healthy twin has no trend in step time, the faulty one does
    assert cluster.truth["warmup_steps"] == warm
    after = np.arange(warm, n)
    assert np.corrcoef(after, step_ns(faulty[warm:]).max(axis=1))[0, 1] > 0.9


def test_intermittent_congestion_spikes_cross_host_transfer_on_some_steps() -> None:
    faulty, healthy, _cluster = twin_tables("intermittent-congestion", ScopeSpec("full"), 16)
    inst_f, inst_h = instances(faulty), instances(healthy)

    def per_step(inst, bucket: bool) -> np.ndarray:
        sel = ((inst["flags"] & schema.FLAG_DDP_BUCKET) != 0) == bucket
        return np.array([np.median(inst["transfer"][sel & (inst["step"] == k)]) for k in range(16)])

    ratio = per_step(inst_f, True) / per_step(inst_h, True)
    burst = ratio > 2.0
    assert 0 < burst.sum() < 16  # bursts on some steps, not all
    assert np.all(np.abs(ratio[~burst] - 1.0) < 0.2)
    # intra-host collectives never see it
    tp_ratio = per_step(inst_f, False) / per_step(inst_h, False)
    assert np.all(np.abs(tp_ratio - 1.0) < 0.1)
    one, one_h, _ = twin_tables("intermittent-congestion", ScopeSpec("one-node"), 6)
    assert_same_tables(one, one_h)


@pytest.mark.parametrize("variant", ["padding", "longer"])
def test_numerator_change_adds_executed_work_not_valid_work(variant: str) -> None:
    faulty, healthy, _ = twin_tables(
        "numerator-change", ScopeSpec("full"), 5, fault__variant=variant
    )
    sf, sh = concat(faulty, "steps"), concat(healthy, "steps")
    mag = load_scenario("numerator-change").fault.magnitude
    if variant == "padding":
        # same useful work, more executed work: padding tokens
        assert abs(sf["valid_tokens"].sum() / sh["valid_tokens"].sum() - 1.0) < 0.001
        assert sf["tokens"].sum() > (1.0 + 0.9 * mag) * sh["tokens"].sum()
    else:
        # longer sequences: more tokens per step, and attention grows faster than tokens
        grow = sf["tokens"].sum() / sh["tokens"].sum()
        assert grow > 1.0 + 0.9 * mag
        assert sf["attn_cost"].sum() / sh["attn_cost"].sum() > grow
    slower = np.median(step_ns(faulty)) / np.median(step_ns(healthy))
    assert slower > 1.0 + 0.5 * mag
    # the time per executed token barely moves: the system did not get slower
    per_token_f = step_ns(faulty).max(axis=1) / sf["tokens"].reshape(5, -1)[:, 0]
    per_token_h = step_ns(healthy).max(axis=1) / sh["tokens"].reshape(5, -1)[:, 0]
    assert 0.85 < np.median(per_token_f) / np.median(per_token_h) < 1.2


def test_healthy_run_has_no_straggler_and_no_fault_phases() -> None:
    cluster = Cluster(load_scenario("healthy"))
    warm = cluster.truth["warmup_steps"]
    tables = simulate(cluster, warm + 8)[warm:]
    inst = instances(tables)
    # Some rank always arrives last; in a healthy run it is late by little.
    s = step_ns(tables)
    assert np.median(inst["skew"]) < 0.01 * np.median(s)
    assert np.percentile(inst["skew"], 99) < 0.1 * np.median(s)
    samples = concat(tables, "samples")
    assert np.all(samples["throttle"] == 0)
    for phase in ("memory", "checkpoint", "pp_wait"):
        assert phase_per_rank(tables, phase).sum() == 0
    assert s.max() / np.median(s) < 1.3
    assert cluster.truth == {
        "mechanism": "healthy",
        "scenario_mechanism": "healthy",
        "present": True,
        "ranks": [],
        "hosts": [],
        "rails": [],
        "magnitude": 1.0,
        "warmup_steps": warm,
    }


def test_worked_example_replays_on_512_gpus_and_on_one_node() -> None:
    """The seed's example: the new packer makes steps ~0.2 s slower on 512 GPUs, all-reduce
    entry spread rises by a few hundred ms, post-arrival transfer does not move; one node
    replays the same compute skew without any inter-node link."""
    for scope in ("full", "one-node"):
        figures = {}
        for name in ("seed-example", "seed-example-baseline"):
            cluster = Cluster(load_scenario(name), scope)
            tables = simulate(cluster, 6)[1:]
            first = _first_bucket(instances(tables))
            figures[name] = (
                np.median(step_ns(tables).max(axis=1)),
                np.median(first["skew"]),
                np.median(first["transfer"]),
            )
        (step_new, skew_new, xfer_new) = figures["seed-example"]
        (step_old, skew_old, xfer_old) = figures["seed-example-baseline"]
        assert skew_new - skew_old > (150e6 if scope == "full" else 50e6)
        assert 0.9 < xfer_new / xfer_old < 1.1
        assert step_new > step_old
        if scope == "full":
            assert 1.6e9 < step_old < 2.0e9 and 1.05 < step_new / step_old < 1.3


# -- pipeline, experts, host side -----------------------------------------------------------


def steady(name: str, steps: int, seed: int | None = None, scope=None, **kw):
    """Tables of a scenario and its healthy twin after the warm-up, and the faulty cluster."""
    warm = load_scenario(name, seed=seed, **kw).noise.warmup_steps
    faulty, healthy, cluster = twin_tables(
        name, scope or ScopeSpec("full"), warm + steps, seed, **kw
    )
    assert cluster.truth["warmup_steps"] == warm
    return faulty[warm:], healthy[warm:], cluster


def outside_phases(tables: list[StepTables]) -> np.ndarray:
    """(steps, ranks) step wall time not covered by any recorded phase."""
    inside = sum(phase_per_rank(tables, p) for p in schema.PHASES)
    return step_ns(tables) - inside


def gaps_before_phases(tables: list[StepTables], rank: int) -> np.ndarray:
    """(steps, phases) host time of one rank before each of its phases (from the step's
    start or the previous phase's end)."""
    out = []
    for t in tables:
        p = t.phases
        m = p["rank"] == rank
        t0, t1 = np.sort(p["t0"][m]), p["t1"][m][np.argsort(p["t0"][m])]
        start = t.steps["t_start"][rank]
        out.append(t0 - np.concatenate([[start], t1[:-1]]))
    return np.stack(out).astype(float)


def stage_of(cluster: Cluster) -> np.ndarray:
    lay = cluster.layout
    return np.arange(lay.world_size) // (lay.dp * lay.tp)


@pytest.mark.parametrize("seed", [None, 31])
def test_pipeline_imbalance_lengthens_one_stage_and_the_others_wait(seed: int | None) -> None:
    faulty, healthy, cluster = steady("pipeline-imbalance", 5, seed)
    truth, lay = cluster.truth, cluster.layout
    assert lay.pp >= 2 and truth["mechanism"] == "pipeline_imbalance"
    stage = stage_of(cluster)
    heavy = truth["stage"]
    assert sorted(truth["ranks"]) == np.flatnonzero(stage == heavy).tolist()
    layers = truth["layers"]
    assert (
        sum(layers)
        == load_scenario("pipeline-imbalance", seed=seed).model.layers // lay.pp * lay.pp
    )
    assert layers[heavy] == max(layers) and layers.count(max(layers)) == 1
    others = np.delete(np.array(layers), heavy)
    assert truth["magnitude"] == pytest.approx(layers[heavy] / others.mean())

    def compute(tables: list[StepTables]) -> np.ndarray:
        return phase_per_rank(tables, "forward") + phase_per_rank(tables, "backward")

    c_bad, c_good = compute(faulty), compute(healthy)
    on = stage == heavy
    # the heavy stage's compute is longer, in proportion to its layers
    ratio = np.median(c_bad[:, on]) / np.median(c_bad[:, ~on])
    assert ratio > 1.15, ratio
    assert 0.9 < np.median(c_good[:, on]) / np.median(c_good[:, ~on]) < 1.1
    # the other stages idle more in pipeline bubbles than the heavy one, and more than before
    wait_bad = phase_per_rank(faulty, "pp_wait")
    wait_good = phase_per_rank(healthy, "pp_wait")
    assert np.median(wait_bad[:, ~on]) > np.median(wait_bad[:, on])
    assert np.median(wait_bad[:, ~on]) > np.median(wait_good[:, ~on])
    assert np.median(step_ns(faulty)) > np.median(step_ns(healthy))
    # the heavy stage executes more FLOPs per step
    flops = concat(faulty, "steps")["flops"].reshape(len(faulty), -1)
    assert flops[:, on].mean() > 1.15 * flops[:, ~on].mean()


def test_an_even_pipeline_split_is_the_healthy_twin() -> None:
    sc = load_scenario("pipeline-imbalance", fault="healthy")
    cluster = Cluster(sc)
    assert len(set(cluster.stage_layers)) == 1 and cluster.truth["mechanism"] == "healthy"


@pytest.mark.parametrize("seed", [None, 5])
def test_expert_imbalance_routes_more_tokens_to_one_ep_rank_and_all_to_alls_wait(
    seed: int | None,
) -> None:
    faulty, healthy, cluster = steady("expert-imbalance", 5, seed)
    truth, lay = cluster.truth, cluster.layout
    assert lay.ep >= 2 and truth["ep"] == lay.ep
    ep_coord = np.array([i["mesh"]["ep"] for i in cluster.identities])
    hot = ep_coord == truth["ep_rank"]
    assert sorted(truth["ranks"]) == np.flatnonzero(hot).tolist()
    tokens = concat(faulty, "steps")["expert_tokens"].reshape(len(faulty), -1).astype(float)
    even = concat(healthy, "steps")["expert_tokens"].reshape(len(healthy), -1).astype(float)
    assert np.all(tokens >= 0) and np.all(even >= 0)
    # every step, the favoured rank's experts get more tokens than any other's
    assert np.all(tokens[:, hot].min(axis=1) > 1.2 * tokens[:, ~hot].max(axis=1))
    assert np.all(even.max(axis=1) < 1.5 * even.min(axis=1))
    # routing moves tokens, it does not make them: the block's total is the same
    assert abs(tokens.sum() - even.sum()) <= 1e-6 * even.sum() + tokens.size
    # the all-to-alls wait for the busiest experts: the favoured ranks arrive last
    ep_groups = {g["id"] for g in cluster.groups if g["name"].startswith("ep")}
    for tables, most in ((faulty, 0.4), (healthy, None)):
        inst = instances(tables)
        a2a = np.isin(inst["group"], list(ep_groups))
        assert a2a.sum() > 0
        assert np.all(inst["flags"][a2a] & schema.FLAG_DEVICE_TIMED)
        share = np.mean(hot[inst["last_rank"][a2a]])
        if most is None:
            assert share < 2.5 / lay.ep
        else:
            assert share > most, share
    ops = concat(faulty, "colls")["op"]
    assert np.any(ops == schema.OP_INDEX["all_to_all"])


def test_dense_models_report_no_expert_tokens() -> None:
    tables = simulate(Cluster(load_scenario("healthy", ranks=16)), 2)
    assert np.all(concat(tables, "steps")["expert_tokens"] == -1)
    assert not any(
        i["mesh"].get("ep") is not None for i in Cluster(load_scenario("healthy")).identities
    )


@pytest.mark.parametrize("seed", [None, 8])
def test_host_pauses_land_outside_phases_on_varying_ranks(seed: int | None) -> None:
    faulty, healthy, cluster = steady("host-pause", 16, seed)
    sc = cluster.scenario
    truth = cluster.truth
    assert truth["ranks"] == [] and truth["every"] == sc.fault.every
    steps = concat(faulty, "steps")
    n = len(faulty)
    gc = steps["gc_ns"].reshape(n, -1).astype(float)
    gc_count = steps["gc_count"].reshape(n, -1)
    long = gc > 5e6
    # every rank pauses about once every `every` steps, each at its own times
    rate = long.mean()
    assert 0.4 / sc.fault.every < rate < 2.0 / sc.fault.every
    assert np.unique(np.nonzero(long)[1]).size > 0.5 * gc.shape[1]
    paused_sets = {tuple(np.flatnonzero(row)) for row in long}
    assert len(paused_sets) > n // 2
    assert not np.any(long.all(axis=0))
    assert np.median(gc[long]) == pytest.approx(sc.fault.magnitude * 1e6, rel=0.35)
    assert np.all(gc_count >= long) and np.all(gc_count >= 0)
    # the pause is host time outside every phase, and CPU work
    outside = outside_phases(faulty)
    assert np.all(outside[long] >= gc[long])
    cpu = steps["cpu_ns"].reshape(n, -1)
    assert np.all(cpu[long] >= gc[long])
    # the healthy twin only has young collections: short ones
    gc_h = concat(healthy, "steps")["gc_ns"]
    assert gc_h.max() < 5e6 and np.all(concat(healthy, "steps")["gc_count"] >= 0)
    assert np.median(step_ns(faulty).max(axis=1)) > np.median(step_ns(healthy).max(axis=1))


def _first_forward_gap(tables: list[StepTables]) -> np.ndarray:
    """(steps, ranks) host time between the end of input and the first forward span."""
    out = []
    for t in tables:
        p = t.phases
        world = t.steps["step"].shape[0]
        end_input = np.zeros(world)
        first_fwd = np.full(world, np.inf)
        inp = p["phase"] == PH["input"]
        end_input[p["rank"][inp]] = p["t1"][inp]
        fwd = p["phase"] == PH["forward"]
        np.minimum.at(first_fwd, p["rank"][fwd], p["t0"][fwd].astype(float))
        out.append(first_fwd - end_input)
    return np.stack(out)


def test_cpu_contention_starves_one_host_thread_and_its_gpus() -> None:
    faulty, healthy, cluster = steady("cpu-contention", 5)
    sc = cluster.scenario
    on = cluster.layout.host == sc.fault.host
    assert sorted(cluster.truth["ranks"]) == np.flatnonzero(on).tolist()
    assert cluster.truth["hosts"] == [f"node{sc.fault.host:03d}"]

    def phase_cpu(tables: list[StepTables], phase: str) -> tuple[np.ndarray, np.ndarray]:
        p = concat(tables, "phases")
        m = p["phase"] == PH[phase]
        world = cluster.layout.world_size
        wall = np.bincount(p["rank"][m], weights=(p["t1"] - p["t0"])[m], minlength=world)
        cpu = np.bincount(p["rank"][m], weights=p["cpu_ns"][m], minlength=world)
        return wall, cpu

    for phase in ("forward", "backward", "optimizer"):
        wall, cpu = phase_cpu(faulty, phase)
        wall_h, cpu_h = phase_cpu(healthy, phase)
        ratio = cpu / wall
        # the starved thread's phases take longer while their CPU time does not grow
        assert ratio[on].max() < 0.5 * ratio[~on].min(), phase
        assert np.all(wall[on] > 1.1 * wall_h[on]), phase
        assert np.all(cpu[on] <= 1.05 * cpu_h[on]), phase
    steps = concat(faulty, "steps")
    step_ratio = (steps["cpu_ns"] / (steps["t_end"] - steps["t_start"])).reshape(5, -1)
    assert np.median(step_ratio[:, on]) < 0.6 * np.median(step_ratio[:, ~on])
    # host gaps between phases grow on that host only
    gap, gap_h = _first_forward_gap(faulty), _first_forward_gap(healthy)
    assert np.median(gap[:, on]) > 2.0 * np.median(gap_h[:, on])
    assert 0.7 < np.median(gap[:, ~on]) / np.median(gap_h[:, ~on]) < 1.4
    samples = concat(faulty, "samples")
    s_on = np.tile(on, 5)
    assert samples["cpu_pct"][s_on].min() > 95 and samples["cpu_pct"][~s_on].max() < 60
    assert np.median(samples["gpu_util"][s_on]) < 0.8 * np.median(samples["gpu_util"][~s_on])
    assert samples["sm_clock_mhz"].min() > 0.97 * sc.topology.sm_clock_mhz
    assert np.all(samples["throttle"] == 0)
    # the fault lives on its host: elsewhere the run is the healthy twin's
    elsewhere = ScopeSpec("one-node", hosts=(other_host(sc.fault.host, sc.topology.hosts),))
    one, one_h, c1 = twin_tables("cpu-contention", elsewhere, 3)
    assert not c1.truth["present"] and c1.truth["mechanism"] == "healthy"
    assert_same_tables(one, one_h)


@pytest.mark.parametrize("seed", [None, 23])
def test_unexplained_straggler_blocks_outside_phases_without_cpu_or_gc(seed: int | None) -> None:
    faulty, healthy, cluster = steady("host-gap", 6, seed)
    sc = cluster.scenario
    truth = cluster.truth
    assert truth["mechanism"] == "unexplained_straggler" and truth["category"] == "host_gap"
    (r,) = truth["ranks"]
    assert cluster.layout.device[r] == sc.fault.device
    # one of its gaps between phases grows by the blocking time, every step
    extra = (gaps_before_phases(faulty, r) - gaps_before_phases(healthy, r)).max(axis=1)
    # (that gap may also hold a wait for gradient buckets, which moves with the others)
    assert np.all(extra > 0.5 * sc.fault.magnitude * 1e6), extra
    assert np.median(extra) > 0.75 * sc.fault.magnitude * 1e6, extra
    s_bad, s_good = concat(faulty, "steps"), concat(healthy, "steps")
    # no collection and no CPU behind it: the same GC and about the same thread CPU time
    np.testing.assert_array_equal(s_bad["gc_ns"], s_good["gc_ns"])
    mine = s_bad["rank"] == r
    assert np.all(s_bad["cpu_ns"][mine] < s_good["cpu_ns"][mine] + 0.05 * sc.fault.magnitude * 1e6)
    # its own phases did not grow: the time is between them
    inside = sum(phase_per_rank(faulty, p) for p in schema.PHASES)[:, r]
    inside_h = sum(phase_per_rank(healthy, p) for p in schema.PHASES)[:, r]
    assert np.all(inside < inside_h + 0.1 * sc.fault.magnitude * 1e6)
    # its host looks ordinary
    samples = concat(faulty, "samples")
    assert samples["cpu_pct"].max() < 60 and np.all(samples["throttle"] == 0)
    assert np.median(step_ns(faulty)) > np.median(step_ns(healthy))
    host = sc.fault.device // sc.topology.gpus_per_host
    elsewhere = ScopeSpec("one-node", hosts=(other_host(host, sc.topology.hosts),))
    one, one_h, c1 = twin_tables("host-gap", elsewhere, 3, seed)
    assert not c1.truth["present"]
    assert_same_tables(one, one_h)


@pytest.mark.parametrize("name", ["cpu-contention", "host-gap"])
def test_host_faults_take_an_onset(name: str) -> None:
    faulty, healthy, cluster = twin_tables(name, ScopeSpec("full"), 6, fault__onset=3)
    assert cluster.truth["onset"] == 3
    assert_same_tables(faulty[:3], healthy[:3])
    assert np.median(step_ns(faulty[3:])) > np.median(step_ns(healthy[3:]))
