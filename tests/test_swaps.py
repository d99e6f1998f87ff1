"""Swaps as rerun perturbations: two ranks exchange their data shards (``--swap-shards``) or
their devices (``--swap-placement``); where the slowness goes says data, hardware or
topology."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rankscope.cli import main
from rankscope.commands.demo import start_demo
from rankscope.hub.server import Hub
from rankscope.sim import ScopeSpec, load_scenario
from rankscope.sim.topology import build_layout

RANKS = 16
STEPS = 12


# -- topology ------------------------------------------------------------------------------


def test_shard_swap_permutes_the_two_data_parallel_indices() -> None:
    sc = load_scenario("data-imbalance", ranks=RANKS)
    plain = build_layout(sc)
    lay = build_layout(sc, ScopeSpec("full", swap_shards=(3, 9)))
    want = np.arange(RANKS)
    want[[3, 9]] = [9, 3]
    assert lay.shard_of_dp.tolist() == want.tolist()
    assert plain.shard_of_dp.tolist() == list(range(RANKS))


def test_shard_swap_of_two_ranks_in_one_replica_is_refused() -> None:
    sc = load_scenario("slow-device", ranks=RANKS)  # tensor parallel: ranks 0 and 1 share a shard
    lay = build_layout(sc)
    tp = RANKS // lay.shard_of_dp.size
    assert tp > 1
    with pytest.raises(ValueError, match="same data shard"):
        build_layout(sc, ScopeSpec("full", swap_shards=(0, 1)))


def _shape(lay) -> list[tuple[str, int]]:
    return sorted((str(g.get("kind", g.get("name", ""))), len(g["ranks"])) for g in lay.groups)


def test_placement_swap_exchanges_devices_and_keeps_every_group() -> None:
    sc = load_scenario("network-rail", ranks=RANKS)
    plain = build_layout(sc)
    lay = build_layout(sc, ScopeSpec("full", swap_placement=(0, 15)))
    assert [g["ranks"] for g in lay.groups] == [g["ranks"] for g in plain.groups]
    assert (lay.host[0], lay.gpu[0]) == (plain.host[15], plain.gpu[15])
    assert (lay.host[15], lay.gpu[15]) == (plain.host[0], plain.gpu[0])
    keep = [r for r in range(RANKS) if r not in (0, 15)]
    assert (lay.host[keep] == plain.host[keep]).all()


@pytest.mark.parametrize(
    ("pair", "match"), [((3,), "two different"), ((2, 2), "two different"), ((1, 99), "outside")]
)
def test_bad_swap_pairs_say_what_is_wrong(pair: tuple[int, ...], match: str) -> None:
    sc = load_scenario("data-imbalance", ranks=RANKS)
    for field in ("swap_shards", "swap_placement"):
        with pytest.raises(ValueError, match=match):
            build_layout(sc, ScopeSpec("full", **{field: pair}))


# -- simulated end to end ------------------------------------------------------------------


def _record(rec: Path, scenario: str) -> None:
    handles = start_demo(
        load_scenario(scenario, ranks=RANKS), STEPS, pace="fast", record_dir=str(rec), run_id="p"
    )
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()


def _pair(rec: Path) -> tuple[int, int]:
    # The slowest rank, and the least busy rank that reads another shard.
    from rankscope.commands.grammar import read_store, window_of
    from rankscope.launch.experiments import _mean_busy_ns

    store = read_store(str(rec), STEPS)
    window = window_of(store, str(rec), "p", STEPS)
    busy = _mean_busy_ns(window)
    slow = int(np.nanargmax(busy))
    shard = window.ranks.shard
    other = np.flatnonzero(shard != shard[slow])
    return slow, int(other[np.nanargmin(busy[other])])


def _peer_across_hosts(rec: Path) -> tuple[int, int]:
    # The slowest rank, and the rank with the same GPU index on another host.
    from rankscope.commands.grammar import read_store, window_of
    from rankscope.launch.experiments import _mean_busy_ns

    window = window_of(read_store(str(rec), STEPS), str(rec), "p", STEPS)
    slow = int(np.nanargmax(_mean_busy_ns(window)))
    info = window.ranks
    peers = np.flatnonzero(
        (info.host != info.host[slow]) & (info.gpu_index == info.gpu_index[slow])
    )
    return slow, int(peers[0])


def _swap_verdict(
    rec: Path, pair: tuple[int, int], capsys: pytest.CaptureFixture[str], kind: str = "shards"
) -> dict:
    with Hub(record_dir=str(rec)) as hub:
        seen = hub.health["messages"]
        argv = ["rerun", str(rec), "--scope", "full", "--run", "p", "--launcher", "simulated"]
        argv += ["--hub", hub.endpoint, "--yes", "--rerun-steps", str(STEPS), "--new-run", "sw"]
        assert main([*argv, f"--swap-{kind}", f"{pair[0]},{pair[1]}", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)["plan"]
        assert plan["swap"]["kind"] == kind and plan["swap"]["ranks"] == list(pair)
        deadline = time.monotonic() + 30
        while hub.health["messages"] <= seen and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    assert main(["experiment", "swap", str(rec), "--before", "p", "--after", "sw", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_data_imbalance_follows_the_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    _record(rec, "data-imbalance")
    out = _swap_verdict(rec, _pair(rec), capsys)
    assert out["outcome"] == "follows the shard", out
    assert out["verdict"] == "follows the shard → data"


def test_slow_device_stays_with_the_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    _record(rec, "slow-device")
    out = _swap_verdict(rec, _pair(rec), capsys)
    assert out["outcome"] == "stays with the device", out
    assert out["verdict"] == "stays with the device → hardware"


def test_slow_device_follows_the_device_in_a_placement_swap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    _record(rec, "slow-device")
    out = _swap_verdict(rec, _peer_across_hosts(rec), capsys, "placement")
    assert out["verdict"] == "follows the device → hardware", out


def test_misplaced_group_moves_with_the_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Swapping a rank of a group split across two hosts with its twin on a healthy host
    # changes which groups cross hosts: the pair's gap goes, it was the placement.
    rec = tmp_path / "rec"
    _record(rec, "placement")
    out = _swap_verdict(rec, _peer_across_hosts(rec), capsys, "placement")
    assert out["verdict"] == "moves with the placement → topology", out


# -- CLI -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("3", "two ranks R1,R2"),
        ("1,99", "outside the rerun's 16 ranks"),
        ("a,b", "two ranks R1,R2"),
        ("2,2", "two different ranks"),
    ],
)
def test_rerun_bad_swap_is_one_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, match: str
) -> None:
    rec = tmp_path / "rec"
    _record(rec, "healthy")
    capsys.readouterr()
    argv = ["rerun", str(rec), "--scope", "full", "--launcher", "simulated"]
    assert main([*argv, "--swap-shards", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_torchrun_gets_the_shard_swap_in_its_environment_and_refuses_a_placement_swap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = tmp_path / "rec"
    _record(rec, "healthy")
    capsys.readouterr()
    argv = ["rerun", str(rec), "--scope", "one-node", "--script", "train.py", "--json"]
    assert main([*argv, "--swap-shards", "0,1"]) == 0
    out = json.loads(capsys.readouterr().out)
    # One node over ssh: the variable travels in the remote command line's environment.
    (cmd,) = out["commands"]
    assert cmd["host"] is not None
    assert "env RANKSCOPE_SWAP_SHARDS=0,1 " in cmd["argv"][-1], cmd["argv"]
    assert main([*argv, "--swap-placement", "0,1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not supported by the torchrun template" in err[0], err
