"""In the simulated cluster, for each fault the ladder's first scope matches its mechanism.

Each case records a full run of a fault scenario, then — exactly as a user would — runs
``rankscope rerun PATH --scope ... --launcher simulated --yes`` at one-rank, one-node and
two-node (each rerun is a separate process started from the ``simulated`` template,
reporting to the hub as a child run), and reads ``rankscope ladder PATH --json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simrec import record_sim

from rankscope.cli import main
from rankscope.hub import replay
from rankscope.hub.server import Hub

RANKS = 32
STEPS = 10

CASES = [
    # scenario, expected first scope, a mechanism it must implicate
    ("slow-device", "one-rank", "slow_device"),
    ("data-imbalance", "one-node", "data_imbalance"),
    ("local-fabric", "one-node", "local_fabric"),
    ("network-rail", "two-node", "network_rail"),
    ("placement", "two-node", "placement"),
    ("healthy", None, None),
]


def _record_parent(scenario: str, rec: Path, **overrides: object) -> None:
    record_sim(scenario, rec, ranks=RANKS, steps=STEPS, **overrides)


@pytest.mark.parametrize(("scenario", "first", "mechanism"), CASES)
def test_first_scope_matches_the_fault(
    scenario: str,
    first: str | None,
    mechanism: str | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rec = tmp_path / "rec"
    _record_parent(scenario, rec)
    with Hub(record_dir=str(rec)):
        for scope in ("one-rank", "one-node", "two-node"):
            code = main(
                [
                    "rerun",
                    str(rec),
                    "--scope",
                    scope,
                    "--launcher",
                    "simulated",
                    "--rerun-steps",
                    str(STEPS),
                    "--yes",
                    "--json",
                ]
            )
            out = json.loads(capsys.readouterr().out)
            assert code == 0, out
            assert out["launched"] and out["plan"]["scope"] == scope
            assert out["commands"][0]["argv"][2] == "rankscope.launch.simulated"
            log = Path(out["log"])
            assert log.parent == rec / "reruns" and log.exists()
    assert main(["ladder", str(rec), "--json"]) == 0
    ladder = json.loads(capsys.readouterr().out)
    scopes = [r["scope"] for r in ladder["rungs"]]
    assert scopes == ["one-rank", "one-node", "two-node", "full"]
    assert all(r["run"].startswith("parent") for r in ladder["rungs"])
    assert ladder["first_scope"] == first, json.dumps(ladder["rungs"], indent=1)
    if mechanism is not None:
        assert mechanism in ladder["implicated"]
        # The diagnosis of the full run agrees with the fault it was built with.
        assert ladder["rungs"][-1]["verdict"] == mechanism


def test_a_rerun_reproduces_the_parent_as_it_ran_overrides_included(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The parent is the "healthy" scenario with a slow device put in by override: a rerun
    # that reloaded the scenario by name would come back healthy.
    rec = tmp_path / "rec"
    _record_parent("healthy", rec, fault="slow_device")
    with Hub(record_dir=str(rec)):
        argv = ["rerun", str(rec), "--scope", "one-rank", "--launcher", "simulated"]
        assert main([*argv, "--rerun-steps", str(STEPS), "--yes", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        spec = Path(out["commands"][0]["argv"][4].partition("=")[2])
        assert spec.suffix == ".json" and spec.parent == rec / "reruns"
    assert main(["ladder", str(rec), "--json"]) == 0
    ladder = json.loads(capsys.readouterr().out)
    assert [r["scope"] for r in ladder["rungs"]] == ["one-rank", "full"]
    assert ladder["first_scope"] == "one-rank", json.dumps(ladder["rungs"], indent=1)
    store = replay.load(str(rec))
    specs = {r: store.window(r).manifest["sim"]["spec"] for r in store.run_ids()}
    assert len(specs) == 2
    assert len({json.dumps(v, sort_keys=True) for v in specs.values()}) == 1
    assert next(iter(specs.values()))["fault"]["mechanism"] == "slow_device"
