"""``rankscope diagnose`` on recordings and ``rankscope eval`` on the simulator."""

import json
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.commands.eval_ import BEGIN, END, Case, summarize, write_section
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


def _case(truth: str, predicted: str, scale: int = 64, **kw) -> Case:
    return Case(
        scenario=truth.replace("_", "-"),
        scale=scale,
        seed=1,
        truth=truth,
        predicted=predicted,
        score=0.9,
        runner_up="healthy",
        rank_ok=kw.get("rank_ok"),
        host_ok=kw.get("host_ok"),
        rail_ok=None,
        magnitude=0.5,
        seconds=1.0,
    )


def test_summarize_counts_by_hand() -> None:
    cases = [
        _case("slow_device", "slow_device", rank_ok=True, host_ok=True),
        _case("slow_device", "data_imbalance"),
        _case("healthy", "healthy"),
        _case("healthy", "checkpoint", scale=512),
    ]
    text = summarize(cases, "rankscope eval --scales 64,512 --seeds 1", 10.0)
    assert "top-1 mechanism correct: 2/4 (50.0 %)" in text
    assert "false alarms on healthy runs: 1/2 (50.0 %)" in text
    assert "faults called healthy (missed): 0/2" in text
    assert "implicated ranks correct (where the truth names them): 1/1" in text
    # Columns in vocabulary order: data_imbalance, slow_device, checkpoint, healthy.
    assert "| slow_device | 1 | 1 | · | · |" in text
    assert "| healthy | · | · | 1 | 1 |" in text
    assert "slow-device @ 64 ranks, seed 1: truth slow_device" in text


def test_write_section_keeps_the_rest(tmp_path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark results\n\nhub: fast\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    write_section(results, "new section\n")
    text = results.read_text()
    assert "hub: fast" in text and "tail" in text
    assert "old" not in text and f"{BEGIN}\nnew section\n{END}" in text
    fresh = tmp_path / "NEW.md"
    write_section(fresh, "x")
    assert BEGIN in fresh.read_text()


def test_eval_runs_and_writes(tmp_path, capsys) -> None:
    results = tmp_path / "RESULTS.md"
    rc = main(
        [
            "eval",
            "--scales",
            "16",
            "--seeds",
            "1",
            "--steps",
            "12",
            "--scenarios",
            "healthy,slow-device",
            "--results",
            str(results),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "top-1 mechanism correct: 2/2" in out
    text = results.read_text()
    assert BEGIN in text and END in text and "Confusion matrix" in text


def test_eval_rejects_bad_arguments(capsys) -> None:
    assert main(["eval", "--scales", "sixty"]) == 2
    assert "--scales" in capsys.readouterr().err
    assert main(["eval", "--scenarios", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_results_default_path_is_benchmarks() -> None:
    from rankscope.commands.eval_ import RESULTS

    assert RESULTS.name == "RESULTS.md" and RESULTS.parent.name == "benchmarks"
    assert Path(RESULTS).parent.exists()
