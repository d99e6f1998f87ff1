"""The method walked as a user would, on the simulated catalogue: record a run, diagnose it,
run the controlled experiment the diagnosis proposes (its own command line, plus ``--yes``),
run the evaluation it proposes, and check that the answer names the injected mechanism.

Each pair the experiments are meant to separate is here: a slow device against a data
imbalance (a shard swap: the slowness stays with the device, or follows the shard), and a
slow network rail against a misplaced group (a pairwise sweep names the rail; a placement
swap moves the gap with the placement). The answer is checked against the scenario's
injected fault, not against the diagnosis, which the experiment is there to test.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rankscope.cli import build_parser, main
from rankscope.commands.demo import start_demo
from rankscope.diagnosis.controlled import Perturbation, command_lines
from rankscope.hub.server import Hub
from rankscope.sim import load_scenario

STEPS = 12

WALKS = [
    # scenario, ranks, what the final evaluation must name
    pytest.param("slow-device", 16, "hardware", id="slow-device"),
    pytest.param("data-imbalance", 16, "data", id="data-imbalance"),
    pytest.param("network-rail", 16, "rail", id="network-rail"),
    # At 16 ranks the scenario's slow host fabric is within the healthy spread; at 64 the
    # diagnosis names it.
    pytest.param("local-fabric", 64, "host", id="local-fabric"),
    # At 16 ranks (four hosts of four GPUs) the scenario splits two of the four
    # tensor-parallel groups: with no majority of intra-host groups to compare them with,
    # no diagnosis can call them misplaced. At 32 ranks two of eight are split (twice the
    # ranks: the slow tier).
    pytest.param("placement", 32, "topology", id="placement", marks=pytest.mark.slow),
]


def _record(rec: Path, scenario: str, ranks: int) -> dict[str, Any]:
    handles = start_demo(
        load_scenario(scenario, ranks=ranks), STEPS, pace="fast", record_dir=str(rec), run_id="p"
    )
    try:
        handles.wait(timeout=120)
        assert handles.wait_ingested()
    finally:
        handles.stop()
    from rankscope.hub import replay

    return replay.load(rec).window("p").manifest["sim"]["truth"]


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, (argv, out.err)
    return json.loads(out.out)


def _settle(hub: Hub, seen: int) -> None:
    # The rerun has exited once main returns; wait for its messages to stop arriving.
    deadline = time.monotonic() + 30
    last, quiet = seen, time.monotonic()
    while time.monotonic() < deadline:
        now = hub.health["messages"]
        if now != last:
            last, quiet = now, time.monotonic()
        elif now > seen and time.monotonic() - quiet > 0.5:
            return
        time.sleep(0.05)
    raise AssertionError(f"the rerun sent nothing to the hub ({last} messages, {seen} before)")


def _proposed(capsys: pytest.CaptureFixture[str], rec: Path) -> dict[str, Any]:
    diag = _json(capsys, ["diagnose", str(rec), "--json"])
    top = diag["verdict"]["hypotheses"][0]
    nx = top["next_experiment"]
    assert nx["perturbation"] is not None, top["mechanism"]
    assert nx["command"] is not None, nx["notes"]
    for argv in (nx["command"], *nx["then"]):
        # Every proposed line is a rankscope command line the parser takes as it is.
        assert argv[0] == "rankscope" and str(rec) in argv
        build_parser(only=argv[1]).parse_args(argv[1:])
    return top


@pytest.mark.parametrize(("scenario", "ranks", "names"), WALKS)
def test_the_proposed_experiment_names_the_injected_mechanism(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scenario: str, ranks: int, names: str
) -> None:
    rec = tmp_path / "rec"
    truth = _record(rec, scenario, ranks)
    with Hub(record_dir=str(rec)) as hub:
        top = _proposed(capsys, rec)
        nx = top["next_experiment"]
        p = nx["perturbation"]
        if p["kind"] == "sweep_pairwise":
            # A sweep judges itself: its finding is the answer.
            assert nx["then"] == []
            found = _json(capsys, [*nx["command"][1:], "--yes", "--json"])["found"]
            if names == "host":
                assert found["finding"] == "local_fabric", found
                assert [found["host"]] == truth["hosts"], (found, truth)
                return
            assert names == "rail"
            assert found["finding"] == "network_rail", found
            assert found["rail"] == truth["rails"][0], (found, truth)
            return
        slow, peer = p["ranks"]
        if truth["ranks"] and names != "data":
            # The slow side of the pair is an injected rank, the other side is not.
            assert slow in truth["ranks"] and peer not in truth["ranks"], (p, truth)
        seen = hub.health["messages"]
        plan = _json(capsys, [*nx["command"][1:], "--hub", hub.endpoint, "--yes", "--json"])
        assert plan["launched"] is True and plan["plan"]["swap"]["ranks"] == [slow, peer]
        _settle(hub, seen)
    (then,) = nx["then"]
    verdict = _json(capsys, [*then[1:], "--json"])
    assert verdict["means"] == names, verdict
    assert verdict["ranks"] == [slow, peer]


@pytest.fixture(scope="module")
def spaced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rec = tmp_path_factory.mktemp("walk") / "my rec"
    _record(rec, "slow-device", 16)
    return rec


def test_a_path_the_launchers_refuse_gets_no_command(
    spaced: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A space in the recording path fails the launcher templates' path check: the
    # perturbation is still described, but no command line is shown for it.
    diag = _json(capsys, ["diagnose", str(spaced), "--json"])
    nx = diag["verdict"]["hypotheses"][0]["next_experiment"]
    assert nx["perturbation"]["kind"] == "swap_shards"
    assert nx["command"] is None and nx["then"] == []
    assert any(n.startswith("no command:") and "recording" in n for n in nx["notes"]), nx
    assert main(["diagnose", str(spaced)]) == 0
    text = capsys.readouterr().out
    assert "  controlled: swap the data shards" in text
    assert "  run:  " not in text and "  note: no command:" in text


def test_a_placement_swap_is_proposed_only_where_the_launcher_applies_it(spaced: Path) -> None:
    from rankscope.diagnosis.controlled import Busy, perturbation
    from rankscope.hub import replay
    from rankscope.launch.ladder import decomposition

    window = replay.load(spaced).window("p")
    busy = Busy.of(window, decomposition(window))
    slow = window.manifest["sim"]["truth"]["ranks"][0]
    sim = perturbation("placement", window, busy)
    assert sim is not None and sim.kind == "swap_placement"
    a, b = sim.ranks
    info = window.ranks
    assert a == slow and info.gpu_index[a] == info.gpu_index[b] and info.host[a] != info.host[b]
    # A real run's launchers cannot exchange devices: the pairwise sweep stands in.
    real = dataclasses.replace(window, manifest={})
    swept = perturbation("placement", real, busy)
    assert swept is not None and swept.kind == "sweep_pairwise" and swept.ranks == ()
    shards = perturbation("slow_device", real, busy)
    assert shards is not None and shards.kind == "swap_shards" and shards.ranks[0] == slow
    assert info.shard[shards.ranks[0]] != info.shard[shards.ranks[1]]
    assert perturbation("checkpoint", window, busy) is None


def test_a_real_run_gets_the_torchrun_rerun_only_when_its_script_is_known(spaced: Path) -> None:
    # Without the simulated scenario in its manifest, the run is a real job: the rerun goes
    # through the default torchrun template, which needs the script the ranks ran.
    from rankscope.commands.proposed import propose_commands
    from rankscope.diagnosis.engine import diagnose
    from rankscope.hub import replay

    window = replay.load(spaced).window("p")
    for manifest, runs in (({}, False), ({"argv": ["train.py", "--lr=3e-4"]}, True)):
        real = dataclasses.replace(window, manifest=manifest)
        diag = diagnose(real)
        top = diag.verdict.top
        p = top.next_experiment.perturbation
        assert p is not None and p.kind == "swap_shards"
        cmds = propose_commands(diag, "rec", ["p"])[top.mechanism]
        if not runs:
            assert cmds.command == () and cmds.then == ()
            assert "needs {script}" in cmds.notes[0], cmds.notes
            continue
        assert "--launcher" not in cmds.command and "--rerun-steps" not in cmds.command
        assert cmds.command[:7] == ("rankscope", "rerun", "rec", "--scope", "full", "--run", "p")
        build_parser(only="rerun").parse_args(list(cmds.command[1:]))


def test_a_rerun_id_the_recording_holds_is_not_reused() -> None:
    p = Perturbation("swap_shards", (3, 9), "", "", ())
    cmds = command_lines(p, "rec", "p", simulated=True, steps=40, taken={"p-swap-shards"})
    assert cmds.new_run == "p-swap-shards-2"
    assert cmds.command[-4:] == ("--launcher", "simulated", "--rerun-steps", "40")
    assert cmds.then == (
        ("rankscope", "experiment", "swap", "rec", "--before", "p", "--after", "p-swap-shards-2"),
    )
    real = command_lines(p, "rec", "p", steps=40)
    assert "--launcher" not in real.command and "--rerun-steps" not in real.command
