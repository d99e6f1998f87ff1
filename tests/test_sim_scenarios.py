"""Scenario files: every shipped scenario loads, ranges are drawn per seed, overrides work,
and a bad file or value gets an error naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.sim import MECHANISMS, Cluster, ScenarioError, list_scenarios, load_scenario
from rankscope.sim.spec import build_scenario


def test_every_mechanism_has_a_shipped_scenario() -> None:
    names = dict(list_scenarios())
    assert "_base" not in names
    found = {load_scenario(n).fault.mechanism for n in names}
    assert found == set(MECHANISMS)
    assert {"healthy", "seed-example", "seed-example-baseline"} <= set(names)
    assert all(desc and len(desc) < 120 for desc in names.values())


def test_seed_example_and_its_baseline_differ_only_in_the_packer() -> None:
    new, old = load_scenario("seed-example"), load_scenario("seed-example-baseline")
    assert new.world_size == old.world_size == 512
    assert (new.layout.tp, new.layout.pp) == (1, 1)
    assert new.job == old.job
    m_new = Cluster(new, "one-node").manifest
    m_old = Cluster(old, "one-node").manifest
    diff = {
        (section, key)
        for section in m_new
        if section != "sim"
        for key in m_new[section]
        if m_new[section][key] != m_old[section][key]
    }
    assert diff == {("job_config", "packer")}
    assert m_new["job_config"]["packer"] == "token_balanced"
    assert m_old["job_config"]["packer"] == "attn_balanced"
    assert m_new["sim"]["truth"]["mechanism"] == "data_imbalance"
    assert m_old["sim"]["truth"]["mechanism"] == "healthy"


def test_ranges_are_drawn_per_seed_and_stay_inside() -> None:
    mags = {load_scenario("slow-device", seed=s).fault.magnitude for s in range(8)}
    assert len(mags) == 8 and all(0.55 <= m <= 0.85 for m in mags)
    devices = {load_scenario("slow-device", seed=s).fault.device for s in range(8)}
    assert len(devices) > 1
    a, b = load_scenario("slow-device", seed=5), load_scenario("slow-device", seed=5)
    assert a == b
    tps = {load_scenario("healthy", seed=s).layout.tp for s in range(12)}
    assert tps == {4, 8}


def test_each_field_draws_from_its_own_stream() -> None:
    base = {
        "seed": 4,
        "noise": {"chunk_sigma": [0.0, 1.0]},
        "workload": {"pad_fraction": [0.0, 1.0]},
    }
    one = build_scenario(base)
    more = build_scenario({**base, "topology": {"nic_gbps": [10.0, 20.0]}})
    assert one.noise.chunk_sigma == more.noise.chunk_sigma
    assert one.workload.pad_fraction == more.workload.pad_fraction


def test_overrides() -> None:
    sc = load_scenario("healthy", ranks=16, seed=3, workload__packer="token_balanced")
    assert (sc.topology.hosts, sc.topology.gpus_per_host, sc.seed) == (2, 8, 3)
    assert sc.workload.packer == "token_balanced"
    small = load_scenario("healthy", ranks=4, layout__tp=2)
    assert (small.topology.hosts, small.topology.gpus_per_host) == (1, 4)
    twin = load_scenario("network-rail", fault="healthy")
    rail = load_scenario("network-rail")
    assert twin.fault.mechanism == "healthy"
    assert (twin.topology, twin.workload, twin.noise) == (rail.topology, rail.workload, rail.noise)
    pinned = load_scenario("slow-host-input", fault__host=2)
    assert pinned.fault.host == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ranks": 12}, "not a multiple of gpus_per_host"),
        ({"ranks": 4, "layout__tp": 8}, "world size 4 is not divisible by tp"),
        ({"topology__hostz": 3}, r"unknown key\(s\) \['hostz'\]"),
        ({"workload__packer": "greedy"}, "packer 'greedy' is not one of"),
        ({"layout__tp": 3}, "not divisible by tp\\*pp"),
        ({"noise__jitter": 1}, "unknown key"),
        ({"fault": "broken_gpu"}, "not one of"),
        ({"fault__host": 99}, "fault.host = 99 is outside 0..7"),
        ({"fault__speed": 0.5}, "does not take \\['speed'\\]"),
        ({"model__layers": "many"}, "expected int"),
        ({"bogus": 1}, "unknown override"),
    ],
)
def test_bad_overrides_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        load_scenario("slow-host-input", **overrides)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed = -1", "seed must be a non-negative int"),
        ("[topology]\nhosts = [4, 2]", "lo > hi"),
        ("[topology]\nhosts = [2.5, 4]", "whole numbers"),
        ("[model]\nmfu = [0.1, 0.2, 0.3]", r"\[lo, hi\]"),
        ("[layout]\ntp = {pick = [1, 2]}", "choice"),
        ("[fault]\nmechanism = 'gremlins'", "fault.mechanism 'gremlins' is not one of"),
        ("colour = 'red'", r"unknown key\(s\) \['colour'\]"),
        ("base = 'nope'", "does not exist"),
        ("[topology\nhosts = 2", "not valid TOML"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=message):
        load_scenario(path)


def test_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ScenarioError, match=r"no scenario named 'nope'.*healthy"):
        load_scenario("nope")


def test_a_file_can_start_from_a_shipped_scenario(tmp_path: Path) -> None:
    (tmp_path / "_mine.toml").write_text("seed = 5\n[topology]\nhosts = 2\n")
    (tmp_path / "big.toml").write_text("base = '_mine'\n[topology]\ngpus_per_host = 4\n")
    sc = load_scenario(tmp_path / "big.toml")
    assert (sc.seed, sc.topology.hosts, sc.topology.gpus_per_host) == (5, 2, 4)
    assert sc.name == "big"


def test_a_saved_spec_rebuilds_the_scenario_exactly(tmp_path) -> None:
    from rankscope.sim.spec import write_spec

    sc = load_scenario("data-imbalance", ranks=16, seed=4, workload__packer="attn_balanced")
    path = write_spec(tmp_path / "parent.scenario.json", sc.name, sc.raw)
    again = load_scenario(path)
    assert dataclasses.replace(again, source=sc.source) == sc
    assert again.name == "data-imbalance" and again.raw == sc.raw
    (tmp_path / "bad.json").write_text('{"spec": 3}')
    with pytest.raises(ScenarioError, match=r"bad\.json"):
        load_scenario(tmp_path / "bad.json")


# -- variation across seeds -----------------------------------------------------------------


def test_seeds_vary_warmup_tails_and_gpus_per_host() -> None:
    scs = [load_scenario("healthy", seed=s) for s in range(24)]
    warm = {sc.noise.warmup_steps for sc in scs}
    assert 0 in warm and len(warm - {0}) >= 3 and all(0 <= w <= 8 for w in warm)
    assert {sc.topology.gpus_per_host for sc in scs} == {4, 8}
    assert len({sc.noise.warmup_factor for sc in scs}) == len(scs)
    assert all(2.0 <= sc.noise.warmup_factor <= 5.0 for sc in scs)
    assert len({sc.noise.spike_prob for sc in scs}) == len(scs)
    assert len({sc.noise.spike_alpha for sc in scs}) == len(scs)
    # tensor parallelism stays inside a host whatever its size
    assert all(sc.layout.tp <= sc.topology.gpus_per_host for sc in scs)
    rail = [load_scenario("network-rail", seed=s) for s in range(8)]
    assert all(sc.layout.tp == sc.topology.gpus_per_host for sc in rail)
    # a fixed world size draws the host size too, and keeps the world
    sized = [load_scenario("healthy", seed=s, ranks=64) for s in range(12)]
    assert {sc.topology.gpus_per_host for sc in sized} == {4, 8}
    assert all(sc.world_size == 64 for sc in sized)
    for sc in sized:
        again = load_scenario("healthy", seed=sc.seed)
        assert again.topology.gpus_per_host == sc.topology.gpus_per_host


def test_every_truth_lists_the_warmup_and_a_healthy_warmup_stays_healthy() -> None:
    for name, _ in list_scenarios():
        sc = load_scenario(name, ranks=16)
        assert Cluster(sc).truth["warmup_steps"] == sc.noise.warmup_steps, name
    seed = next(s for s in range(50) if load_scenario("healthy", seed=s).noise.warmup_steps >= 4)
    truth = Cluster(load_scenario("healthy", seed=seed)).truth
    assert truth["mechanism"] == "healthy" and truth["present"] and truth["warmup_steps"] >= 4


def test_warmup_steps_are_slower_on_every_rank() -> None:
    seed = next(s for s in range(50) if load_scenario("healthy", seed=s).noise.warmup_steps >= 4)
    sc = load_scenario("healthy", seed=seed, ranks=32)
    n = sc.noise.warmup_steps
    cluster = Cluster(sc)
    tables = [cluster.step() for _ in range(n + 6)]
    walls = np.stack([t.steps["t_end"] - t.steps["t_start"] for t in tables]).astype(float)
    steady = np.median(walls[n:])
    assert np.all(walls[0] > 1.5 * steady)  # every rank, not a straggler
    assert np.all(np.median(walls[:n], axis=1) > steady)
    assert np.all(np.diff(np.median(walls[: n + 1], axis=1)) < 0)  # it decays
    assert walls[n:].max() < 1.3 * steady
    flat = Cluster(load_scenario("healthy", seed=seed, ranks=32, noise__warmup_steps=0))
    first = [flat.step() for _ in range(4)]
    w0 = np.stack([t.steps["t_end"] - t.steps["t_start"] for t in first]).astype(float)
    assert np.median(w0[0]) < 1.2 * np.median(w0[1:])


def test_spikes_are_rare_heavy_tailed_and_compute() -> None:
    def compute(prob: float) -> np.ndarray:
        sc = load_scenario("data-imbalance", seed=3, ranks=64, noise__spike_prob=prob)
        cluster = Cluster(sc)
        tables = [cluster.step() for _ in range(8)]
        out = np.zeros((8, 64))
        for i, t in enumerate(tables):
            p = t.phases
            m = np.isin(p["phase"], [schema.PHASE_INDEX["forward"], schema.PHASE_INDEX["backward"]])
            np.add.at(out[i], p["rank"][m], (p["t1"] - p["t0"])[m])
        return out

    sc = load_scenario("data-imbalance", seed=3)
    base, spiky = compute(0.0), compute(0.05)
    excess = spiky - base
    hit = excess > 0.5 * sc.noise.spike_ms * 1e6
    assert 0.01 < hit.mean() < 0.12
    assert np.all(np.abs(excess[~hit]) < 1e3)  # the rest is untouched, to the rounding
    assert excess[hit].max() > 2.5 * np.median(excess[hit])
    assert excess.max() <= 100 * sc.noise.spike_ms * 1e6 + 1e3
