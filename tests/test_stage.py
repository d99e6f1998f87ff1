"""Staged scale-up: an experiment's change applied at one node, two nodes, then the full
job on the simulated cluster, checked after each stage (workload, memory, tails, metric),
stopping with the rollback condition at the first failing check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.commands.demo import start_demo
from rankscope.hub import replay
from rankscope.hub.server import Hub
from rankscope.launch.experiments import load_experiment, record_experiment, save_evaluation
from rankscope.launch.stage import apply_sim_set, parse_sim_set
from rankscope.sim import load_scenario

RANKS = 16
STEPS = 24
PREDICTION = dict(
    hypothesis="data_imbalance",
    change="packer balances attention cost as well as tokens",
    metric="entry_spread",
    direction="down",
    rejection="entry spread unchanged at the stage",
)


def _parent(tmp_path: Path) -> Path:
    # 16 ranks on 4 hosts of 4: one node, two nodes and the full job are three scopes.
    rec = tmp_path / "rec"
    handles = start_demo(
        load_scenario("data-imbalance", ranks=RANKS, topology__gpus_per_host=4),
        STEPS,
        pace="fast",
        record_dir=str(rec),
        run_id="p",
    )
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()
    record_experiment(rec, **PREDICTION, id="e1", parent_run="p")
    return rec


def _stage(rec: Path, *extra: str) -> list[str]:
    argv = ["experiment", "stage", str(rec), "--id", "e1", "--run", "p"]
    return [*argv, "--launcher", "simulated", "--rerun-steps", str(STEPS), *extra]


# -- the change ----------------------------------------------------------------------------


def test_sim_set_reads_values_as_json_and_replaces_a_fault_whole() -> None:
    assert parse_sim_set("fault.every=12") == ("fault.every", 12)
    assert parse_sim_set("workload.packer=attn_balanced") == ("workload.packer", "attn_balanced")
    raw = {"seed": 2, "fault": {"mechanism": "checkpoint", "every": [4, 6]}, "workload": {}}
    out = apply_sim_set(raw, [parse_sim_set("fault=healthy"), ("workload.seq_len", 8192)])
    assert out["fault"] == {"mechanism": "healthy"}
    assert out["workload"] == {"seq_len": 8192}
    assert raw["fault"]["mechanism"] == "checkpoint"  # the parent's spec is not touched
    for bad in ("every=12", "fault.every", "Fault.x=1"):
        with pytest.raises(ValueError, match=r"section\.key=value"):
            parse_sim_set(bad)


# -- dry run and errors --------------------------------------------------------------------


def test_the_dry_run_shows_every_stage_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _parent(tmp_path)
    before = (rec / "experiments" / "e1.json").read_text()
    capsys.readouterr()
    assert main([*_stage(rec, "--sim-set", "fault=healthy", "--json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["launched"] is False
    assert [s["scope"] for s in out["stages"]] == ["one-node", "two-node", "full"]
    assert [s["reference_kind"] for s in out["stages"]] == ["control", "control", "parent"]
    one = out["stages"][0]
    # Below full the changed run is a perturbation of its control, not a rung of the ladder.
    assert one["launch"]["plan"]["parent_run"] == one["reference"] == "p-one-node"
    assert one["control"]["plan"]["parent_run"] == "p"
    assert out["stages"][2]["launch"]["plan"]["world_size"] == RANKS
    assert not (rec / "reruns").exists()
    assert (rec / "experiments" / "e1.json").read_text() == before
    # Without a change the plan says that the stages rerun the parent unchanged.
    assert main(_stage(rec)) == 0
    text = capsys.readouterr().out
    assert "rerun the parent unchanged" in text and "dry run" in text
    assert "1. one-node" in text and "3. full" in text
    # On a real launcher the change is the changed runs' script arguments only.
    argv = [*_stage(rec)[:7], "--script", "train.py", "--script-arg=--packer=attn", "--json"]
    assert main(argv) == 0
    real = json.loads(capsys.readouterr().out)["stages"][0]
    assert "--packer=attn" in " ".join(real["launch"]["commands"][0]["argv"])
    assert "--packer=attn" not in " ".join(real["control"]["commands"][0]["argv"])
    # A recorded interval makes each stage run long enough to cover it twice and more.
    record_experiment(rec, **PREDICTION, id="e2", parent_run="p", interval=20)
    argv = ["experiment", "stage", str(rec), "--id", "e2", "--launcher", "simulated", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["stages"][0]
    assert "--steps=60" in plan["launch"]["commands"][0]["argv"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (("--sim-set", "every=3"), "section.key=value"),
        (("--sim-set", "fault=no_such_fault"), "no_such_fault"),
        (("--stages", "one-node,half"), "unknown stage 'half'"),
        (("--stages", "full,full"), "each scope once"),
        (("--sim-set", "fault=healthy", "--launcher", "torchrun"), "takes the change as"),
    ],
)
def test_bad_stage_requests_are_one_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], match: str
) -> None:
    rec = _parent(tmp_path)
    capsys.readouterr()
    argv = _stage(rec)
    if "--launcher" in extra:
        argv = [*argv[: argv.index("--launcher")], "--script", "train.py"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_a_rejected_experiment_is_not_staged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _parent(tmp_path)
    save_evaluation(rec, "e1", before_run="p", after_run="p", evaluation={"verdict": "rejected"})
    capsys.readouterr()
    assert main(_stage(rec, "--sim-set", "fault=healthy")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evaluated rejected" in err[0], err


# -- staged on the simulated cluster -------------------------------------------------------


def test_a_packer_fix_passes_every_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = _parent(tmp_path)
    capsys.readouterr()
    with Hub(record_dir=str(rec)) as hub:
        argv = _stage(rec, "--sim-set", "fault=healthy", "--hub", hub.endpoint, "--yes", "--json")
        assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["rollback"] is None, json.dumps(out, indent=1)
    assert [r["scope"] for r in out["results"]] == ["one-node", "two-node", "full"]
    for r in out["results"]:
        status = {c["name"]: c["status"] for c in r["checks"]}
        assert status == dict.fromkeys(("workload", "memory", "tails", "metric"), "pass"), r
        metric = next(c for c in r["checks"] if c["name"] == "metric")
        assert metric["after"] < metric["before"]
    # The record keeps its prediction and gains the attempt.
    saved = load_experiment(rec, "e1")
    assert saved.change == PREDICTION["change"] and saved.evaluation is None
    assert saved.stages is not None and saved.stages[-1]["passed"] is True
    # What ran is in the manifests: the changed runs' scenario has no imbalance.
    store = replay.load(str(rec))
    spec = {r: store.window(r).manifest["sim"]["spec"]["fault"] for r in store.run_ids()}
    assert spec["p-e1-full"]["mechanism"] == "healthy"
    assert spec["p-one-node"]["mechanism"] == "data_imbalance"
    assert store.window("p-e1-one-node").parent_run == "p-one-node"
    # A second plan reuses the recorded control as the one-node reference.
    assert main([*_stage(rec, "--sim-set", "fault=healthy", "--json")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["stages"][0]["reference_kind"] == "rerun"
    assert again["stages"][0]["reference"] == "p-one-node"


def test_a_change_that_halves_the_work_stops_at_the_first_stage_with_the_rollback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Shorter rows make every step faster, but the job no longer does the same work.
    rec = _parent(tmp_path)
    capsys.readouterr()
    with Hub(record_dir=str(rec)) as hub:
        argv = _stage(rec, "--sim-set", "workload.seq_len=8192", "--hub", hub.endpoint, "--yes")
        assert main(argv) == 1
    text = capsys.readouterr().out
    assert "stage one-node" in text and "FAILED" in text
    rollback = [line for line in text.splitlines() if line.startswith("rollback:")]
    assert len(rollback) == 1
    assert "workload check failed at one-node" in rollback[0]
    assert PREDICTION["rejection"] in rollback[0]
    attempt = (load_experiment(rec, "e1").stages or [])[-1]
    assert attempt["stopped_at"] == "one-node" and attempt["failed_check"] == "workload"
    checks = {c["name"]: c for c in attempt["results"][0]["checks"]}
    assert checks["workload"]["tokens"]["change"] == pytest.approx(-0.5, abs=0.05)
    assert checks["metric"]["status"] == "not checked"
    assert len(attempt["results"]) == 1
    assert "p-e1-full" not in replay.load(str(rec)).run_ids()


def test_a_run_that_fails_stops_the_staging_like_a_failed_check(tmp_path: Path) -> None:
    from rankscope.commands.grammar import load_run
    from rankscope.launch.runner import LaunchSettings
    from rankscope.launch.stage import StageChange, StageLaunchError, plan_stages, run_stages
    from rankscope.launch.templates import find_launcher

    rec = _parent(tmp_path)
    _, parent = load_run(str(rec), "p", STEPS)
    exp = load_experiment(rec, "e1")
    change = StageChange(sim_set=(("fault", "healthy"),))
    stages, _ = plan_stages(
        parent,
        [],
        ("one-node", "full"),
        experiment=exp,
        change=change,
        template=find_launcher("simulated"),
        settings=LaunchSettings(hub="tcp://127.0.0.1:1"),
        record=rec,
    )
    started = []

    def execute(launch):
        started.append(launch.plan.run)
        raise StageLaunchError(f"{launch.plan.run} exited with code 2")

    attempt = run_stages(exp, parent, stages, change, execute=execute, window=lambda r: parent)
    assert started == ["p-one-node"]  # the control failed: nothing after it ran
    assert attempt["passed"] is False and attempt["failed_check"] == "launch"
    assert attempt["stopped_at"] == "one-node"
    assert "exited with code 2" in attempt["rollback"]
    json.dumps(attempt, allow_nan=False)


@pytest.mark.slow  # ~9 s in a busy suite; the default tier stages the packer fix and a halving
def test_rarer_longer_checkpoints_fail_the_tail_check_at_the_first_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Checkpointing every 20 steps for 2.5 s instead of every 5 for 1 s: fewer stalls, a
    # worse p99. The stage says so before the change reaches the full job.
    rec = tmp_path / "rec"
    scenario = load_scenario(
        "checkpoint", ranks=RANKS, topology__gpus_per_host=4, fault__every=5, fault__magnitude=1.0
    )
    handles = start_demo(scenario, 40, pace="fast", record_dir=str(rec), run_id="p")
    handles.wait(timeout=120)
    assert handles.wait_ingested()
    handles.stop()
    record_experiment(
        rec,
        hypothesis="checkpoint",
        change="checkpoint every 20 steps",
        metric="step_time",
        direction="down",
        rejection="checkpoint stalls cost as much or more",
        id="e1",
        parent_run="p",
        interval=5,
    )
    capsys.readouterr()
    with Hub(record_dir=str(rec)) as hub:
        argv = ["experiment", "stage", str(rec), "--id", "e1", "--launcher", "simulated"]
        argv += ["--sim-set", "fault.every=20", "--sim-set", "fault.magnitude=2.5"]
        assert main([*argv, "--rerun-steps", "40", "--hub", hub.endpoint, "--yes"]) == 1
    attempt = (load_experiment(rec, "e1").stages or [])[-1]
    assert attempt["stopped_at"] == "one-node" and attempt["failed_check"] == "tails", attempt
    tails = next(c for c in attempt["results"][0]["checks"] if c["name"] == "tails")
    assert tails["tails"]["p99_worse"] is True and tails["covers_interval"] is True
    assert "rollback:" in capsys.readouterr().out
