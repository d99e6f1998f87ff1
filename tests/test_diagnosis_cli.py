"""``rankscope diagnose`` on recordings (``rankscope eval``: tests/test_eval_*.py)."""

import json
import time

import pytest

from rankscope.cli import main
from rankscope.diagnosis.verdict import MECHANISMS


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("rec")
    out = {}
    for name, scenario in (("fault", "slow-device"), ("base", "healthy")):
        path = root / name
        rc = main(
            [
                "demo",
                "--scenario",
                scenario,
                "--ranks",
                "32",
                "--seed",
                "4",
                "--headless",
                "--pace",
                "fast",
                "--steps",
                "16",
                "--record",
                str(path),
            ]
        )
        assert rc == 0
        out[name] = path
    return out


def test_diagnose_json_schema(recordings, capsys) -> None:
    capsys.readouterr()
    rc = main(
        ["diagnose", str(recordings["fault"]), "--json", "--baseline", str(recordings["base"])]
    )
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "rankscope.diagnosis/1"
    assert data["run"]["world_size"] == 32 and data["run"]["n_steps"] == 16
    hyps = data["verdict"]["hypotheses"]
    assert {h["mechanism"] for h in hyps} == set(MECHANISMS)
    for h in hyps:
        for key in ("mechanism", "score", "ranks", "hosts", "evidence", "next_experiment"):
            assert key in h
        assert set(h["next_experiment"]) >= {"scope", "change", "supports", "rejects"}
    top = hyps[0]
    assert data["verdict"]["top"] == top["mechanism"] == "slow_device"
    assert len(top["ranks"]) >= 1 and top["evidence"]
    assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
    cats = {c["category"] for c in data["decomposition"]["categories"]}
    assert {"compute", "arrival_wait", "exposed_comm", "other"} <= cats
    assert "2(n-1)/n" in data["curves"]["convention"]
    assert data["distributions"]["baseline"]["p50"] > 0


def test_diagnose_text(recordings, capsys) -> None:
    capsys.readouterr()
    assert main(["diagnose", str(recordings["fault"])]) == 0
    out = capsys.readouterr().out
    assert "VERDICT: slow_device" in out
    assert "NEXT EXPERIMENT (one-rank)" in out
    assert "WALL TIME" in out and "CRITICAL PATH" in out
    assert "no baseline" in out


def test_diagnose_bad_input(tmp_path, capsys) -> None:
    assert main(["diagnose", str(tmp_path / "missing")]) == 2
    assert "no recording" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path), "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_diagnose_unknown_run(recordings, capsys) -> None:
    assert main(["diagnose", str(recordings["fault"]), "--run", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "runs:" in err


def test_baseline_path_and_run_mean_the_same_as_everywhere(recordings, capsys) -> None:
    # --baseline is a recording; --baseline-run a run id: in --baseline when given, else in
    # PATH (where the healthy run of this fixture is not).
    assert main(["inspect", str(recordings["base"]), "--json"]) == 0
    base_run = json.loads(capsys.readouterr().out)["runs"][0]["run"]
    argv = ["diagnose", str(recordings["fault"]), "--json"]
    assert main([*argv, "--baseline", str(recordings["base"]), "--baseline-run", base_run]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["baseline_run"] == base_run
    assert main([*argv, "--baseline-run", base_run]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rankscope: error: ") and f"unknown run {base_run!r}" in err
    assert main([*argv, "--baseline", base_run]) == 2  # a run id is not a recording here
    assert "a run id goes in --baseline-run" in capsys.readouterr().err


def test_a_run_without_any_step_is_an_error_not_a_healthy_verdict(tmp_path, capsys) -> None:
    # A recording whose ranks said hello but whose every steps message the replay refused
    # (here: collective rows without entry times): nothing to judge, so no verdict.
    from rankscope.collector import schema
    from rankscope.hub.recording import RecordingWriter

    writer = RecordingWriter(tmp_path / "rec")
    now = time.time_ns()
    for rank in range(2):
        ident = {"rank": rank, "world_size": 2, "local_rank": rank, "host": "h", "node_rank": 0}
        header = {"job": "j", "run": "r", "rank": rank, "inc": 1, "batch": 0}
        writer.append(schema.hello_message(header, {**ident, "pid": 7 + rank}), now)
    writer.close()
    rc = main(["diagnose", str(tmp_path / "rec")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no complete step of any rank to diagnose" in err, err
    # The snapshot and the live view say the same, not "healthy".
    assert main(["snapshot", str(tmp_path / "rec"), "--out", str(tmp_path / "snap")]) == 0
    out = capsys.readouterr().out
    assert "verdict: none (the window holds no complete step" in out, out
    md = (tmp_path / "snap" / "snapshot.md").read_text()
    assert "No verdict: the window holds no complete step of any rank" in md
    assert "healthy" not in md.split("## Verdict", 1)[1].split("##", 1)[0]
    from rankscope.hub.replay import load_run
    from rankscope.tui.analysis import analyse

    _, window = load_run(tmp_path / "rec", None, 30)
    view = analyse(window)
    assert view.hypotheses == () and "no complete step" in view.note
