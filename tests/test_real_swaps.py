"""Shard swaps of real torch jobs: a data-driven slow rank follows its shard, a CPU-quota
throttled rank stays put.

Each case is ``examples/faultjobs.py`` under ``torchrun`` (gloo, CPU, two ranks) reporting
to a real hub, then rerun through the rerun command (``rankscope rerun PATH --swap-shards
R1,R2 --yes``), whose environment carries ``RANKSCOPE_SWAP_SHARDS`` to the workload
(`rankscope.collector.shards.shard_of`), and judged by ``rankscope experiment swap``.

The rerun goes through the shipped ``torchrun`` template: on this machine its command
names this host, and the swap travels in the command's environment.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("torch")
if shutil.which("torchrun") is None:
    pytest.skip("torchrun is not installed", allow_module_level=True)

import faultcases  # noqa: E402
from ports import free_port_pair  # noqa: E402

from rankscope.cli import main  # noqa: E402
from rankscope.collector.shards import SWAP_ENV  # noqa: E402
from rankscope.hub import replay  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

STEPS = 14
"""Steps per run; the swap judge leaves warm-up steps out on its own."""
RUN_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def swap_hub(tmp_path_factory: pytest.TempPathFactory):
    rec = tmp_path_factory.mktemp("real-swaps") / "record"
    with faultcases.local_hub(rec) as hub:
        yield hub, rec


def _spec(run: str, flags: tuple[str, ...]) -> faultcases.RunSpec:
    return faultcases.RunSpec(run, flags, 2, STEPS, script=faultcases.WORKLOAD, job=faultcases.JOB)


def _recorded(rec: Path, run: str, timeout: float = 30.0) -> None:
    # The commands read the recording from disk, which the hub writes a moment after its
    # store holds the rows.
    deadline = time.monotonic() + timeout
    while True:
        try:
            w = replay.load(rec, history_steps=STEPS).window(run)
            if int(w.present.sum()) >= w.world_size * STEPS:
                return
        except KeyError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run} is not complete in {rec} after {timeout:.0f} s")
        time.sleep(0.3)


def _swap_rerun(hub, rec: Path, run: str, pair: str, capsys) -> tuple[str, dict]:
    """Rerun ``run`` with its shards swapped through the torchrun template; its id and the
    plan's JSON."""
    new = f"{run}-swapped"
    argv = ["rerun", str(rec), "--run", run, "--scope", "one-node"]
    argv += ["--launcher", "torchrun"]
    # The parent's script comes from its manifest (telemetry): naming it confirms it.
    argv += ["--script", str(faultcases.WORKLOAD), "--swap-shards", pair, "--new-run", new]
    argv += ["--hub", hub.endpoint, "--master-port", str(free_port_pair()), "--yes", "--json"]
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert out, (code, err)
    plan = json.loads(out)
    log = Path(plan["log"])
    assert code == 0, log.read_text()[-3000:] if log.exists() else plan
    faultcases.settled_window(hub.store, _spec(new, ()), warmup=0, timeout=60.0)
    return new, plan


def _judge(rec: Path, before: str, after: str, pair: str, capsys) -> dict:
    _recorded(rec, before)
    _recorded(rec, after)
    capsys.readouterr()
    argv = ["experiment", "swap", str(rec), "--before", before, "--after", after]
    code = main([*argv, "--swap-shards", pair, "--steps", str(STEPS), "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def _swap_env(hub, run: str) -> str | None:
    """RANKSCOPE_SWAP_SHARDS as the run's manifest recorded it (rank 0's environment)."""
    return (hub.store.window(run).manifest.get("env") or {}).get(SWAP_ENV)


# Measured at load 3 on 2 cores: ~23 s (two 2-rank runs of 14 steps and the rerun command);
# the throttled case ~40 s (a quarter of a core stretches the throttled rank's start-up and
# exit too). The limits only catch a hang on a loaded machine.
@pytest.mark.timeout(600)
def test_a_data_driven_slow_rank_follows_its_shard(swap_hub, capsys) -> None:
    hub, rec = swap_hub
    # Shard 1 holds four times the samples per batch: rank 1 is slow for its data.
    parent = _spec("swap-data", ("--fault=data", "--fault-rank=1", "--shard-scale=4"))
    faultcases.run_local(hub.endpoint, parent, timeout=RUN_TIMEOUT_S)
    faultcases.settled_window(hub.store, parent, warmup=0)
    after, plan = _swap_rerun(hub, rec, parent.run, "1,0", capsys)
    assert plan["commands"][0]["env"][SWAP_ENV] == "1,0"
    assert _swap_env(hub, after) == "1,0" and _swap_env(hub, parent.run) is None
    # The work each rank reported moved with the shard: rank 0 now reads shard 1.
    w0, w1 = hub.store.window(parent.run), hub.store.window(after)
    samples0, samples1 = np.nanmean(w0.work["samples"], 1), np.nanmean(w1.work["samples"], 1)
    assert samples0[1] > 2 * samples0[0] and samples1[0] > 2 * samples1[1], (samples0, samples1)
    assert list(w0.ranks.shard) == [0, 1]  # the explicit API recorded each rank's shard
    got = _judge(rec, parent.run, after, "1,0", capsys)
    assert got["slow_rank"] == 1, got
    assert got["outcome"] == "follows the shard", got
    assert got["means"] == "data"


@pytest.mark.timeout(600)
def test_a_cpu_quota_throttled_rank_stays_put(swap_hub, capsys) -> None:
    hub, rec = swap_hub
    parent = _spec("swap-throttle", ("--fault=throttle", "--fault-rank=0"))
    # Both runs go under the same quota: the rerun's recorded arguments name its cgroup.
    with faultcases.cpu_throttle() as (extra, info):
        spec = faultcases.RunSpec(
            parent.run, (*parent.flags, *extra), 2, STEPS, script=parent.script, job=parent.job
        )
        faultcases.run_local(hub.endpoint, spec, timeout=RUN_TIMEOUT_S)
        faultcases.settled_window(hub.store, parent, warmup=0)
        after, plan = _swap_rerun(hub, rec, parent.run, "0,1", capsys)
    assert plan["commands"][0]["env"][SWAP_ENV] == "0,1"
    if info["method"].startswith("cgroup"):
        assert info["nr_throttled"] > 0, info
    assert _swap_env(hub, after) == "0,1"
    got = _judge(rec, parent.run, after, "0,1", capsys)
    assert got["slow_rank"] == 0, (got, info)
    assert got["outcome"] == "stays with the device", (got, info)
    assert got["means"] == "hardware"
