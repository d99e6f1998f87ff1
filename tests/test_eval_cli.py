"""``rankscope eval`` on the command line: what it prints, what it writes (only when
asked), and the real-job suite hook (a fake ``examples/faultcases.py``, no torch)."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rankscope.cli import main
from rankscope.commands import eval_
from rankscope.commands.eval_ import BEGIN, END, write_section

SMALL = ["eval", "--scales", "16", "--seeds", "1", "--steps", "12"]


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    """A stand-in for the checkout's benchmarks/RESULTS.md."""
    path = tmp_path / "bench" / "RESULTS.md"
    path.parent.mkdir()
    path.write_text(f"# Benchmark results\n\nhub: fast\n\n{BEGIN}\nold\n{END}\n")
    monkeypatch.setattr(eval_, "RESULTS", path)
    return path


def test_plain_eval_prints_and_writes_nothing(tmp_path, monkeypatch, results, capsys) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = results.read_text()
    assert main([*SMALL, "--scenarios", "healthy,slow-device"]) == 0
    out = capsys.readouterr().out
    assert "### Simulated scenarios" in out
    assert "top-1 mechanism correct: 2/2" in out
    assert "faults called healthy (missed): 0/1" in out
    assert "Confusion matrix" in out
    assert list(cwd.iterdir()) == []
    assert results.read_text() == before


def test_json_prints_the_scores(results, capsys) -> None:
    assert main([*SMALL, "--scenarios", "healthy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "rankscope.eval/1" and "real" not in doc
    assert doc["sim"]["scores"]["false_alarms"]["n"] == 1
    assert doc["sim"]["cases"][0]["outcome"] == "correct"
    assert "old" in results.read_text()


def test_write_results_default_and_path(tmp_path, results, capsys) -> None:
    assert main([*SMALL, "--scenarios", "healthy", "--write-results"]) == 0
    text = results.read_text()
    assert "hub: fast" in text and "old" not in text and "### Simulated scenarios" in text
    other = tmp_path / "elsewhere.md"
    assert main([*SMALL, "--scenarios", "healthy", "--write-results", str(other)]) == 0
    assert BEGIN in other.read_text() and "Confusion matrix" in other.read_text()


def test_write_results_needs_a_checkout(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(eval_, "RESULTS", tmp_path / "benchmarks" / "RESULTS.md")
    assert main([*SMALL, "--scenarios", "healthy", "--write-results"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give a path" in err
    assert not (tmp_path / "benchmarks").exists()


def test_write_section_keeps_the_rest(tmp_path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Benchmark results\n\nhub: fast\n\n{BEGIN}\nold\n{END}\n\ntail\n")
    write_section(path, "new section\n")
    text = path.read_text()
    assert "hub: fast" in text and "tail" in text
    assert "old" not in text and f"{BEGIN}\nnew section\n{END}" in text
    fresh = tmp_path / "NEW.md"
    write_section(fresh, "x")
    assert BEGIN in fresh.read_text()


def test_eval_rejects_bad_arguments(capsys) -> None:
    assert main(["eval", "--scales", "sixty"]) == 2
    assert "--scales" in capsys.readouterr().err
    assert main(["eval", "--scenarios", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
    assert main(["eval", "--no-sim"]) == 2
    assert "--real" in capsys.readouterr().err


def test_results_default_path_is_benchmarks() -> None:
    assert eval_.RESULTS.name == "RESULTS.md" and eval_.RESULTS.parent.name == "benchmarks"
    assert eval_.RESULTS.parent.parent == eval_.REPO


def test_real_without_examples_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(eval_, "REPO", tmp_path)
    assert main([*SMALL, "--real"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert "--real needs a source checkout" in err and "faultcases.py" in err
    assert captured.out == ""


FAKE_FAULTJOBS = '''
"""A stand-in for the real fault jobs: simulated windows, hand-written truths."""
from dataclasses import dataclass

from rankscope.commands.eval_ import baseline_of, simulate_window
from rankscope.sim.spec import load_scenario

SEEN_HUBS = []


@dataclass(frozen=True)
class Case:
    scenario: str
    truth: dict


CASES = {
    "slow": Case("slow-device", {}),
    # A healthy job said to carry a GC pause: the diagnosis calls it healthy, a miss.
    "gc": Case("healthy", {"mechanism": "host_pause", "ranks": [1]}),
    "broken": Case("", {}),
}


def run_case(name, hub):
    SEEN_HUBS.append(hub.endpoint)
    case = CASES[name]
    if not case.scenario:
        raise RuntimeError("torchrun exited 1")
    sc = load_scenario(case.scenario, seed=2, ranks=16)
    window, truth = simulate_window(sc, 12, f"real-{name}")
    base, _ = simulate_window(baseline_of(sc), 12, f"real-{name}-base")
    return window, base, case.truth or truth
'''


def test_real_jobs_are_scored_in_their_own_section(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "faultcases.py").write_text(textwrap.dedent(FAKE_FAULTJOBS))
    monkeypatch.setattr(eval_, "REPO", tmp_path)
    # The loader puts examples/ on sys.path and the module in sys.modules: undo both.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "faultcases", None)
    rc = main(["eval", "--real", "--no-sim"])
    captured = capsys.readouterr()
    assert rc == 1  # one job did not run
    out = captured.out
    assert "### Simulated scenarios" not in out
    real = out.split("### Real jobs")[1]
    assert "top-1 mechanism correct: 1/2 (50.0 %)" in real
    assert "faults called healthy (missed): 1/2" in real
    assert "Missed faults (injected, called healthy):\n\n- gc @ 16 ranks: truth host_pause" in real
    assert "Jobs that did not run:\n\n- broken: RuntimeError: torchrun exited 1" in real
    assert "real job broken did not run" in captured.err
    import faultcases  # the module eval loaded

    assert len(faultcases.SEEN_HUBS) == 3 and len(set(faultcases.SEEN_HUBS)) == 1
    assert faultcases.SEEN_HUBS[0].startswith("tcp://127.0.0.1:")

    assert main(["eval", "--real", "--no-sim", "--real-cases", "slow,gc", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "sim" not in doc and doc["real"]["errors"] == []
    assert doc["real"]["missed"] == ["gc @ 16 ranks"]
    assert doc["real"]["cases"][0]["suite"] == "real"

    assert main(["eval", "--real", "--no-sim", "--real-cases", "nope"]) == 2
    assert "unknown real case(s)" in capsys.readouterr().err


def test_summarize_puts_real_jobs_in_their_own_section() -> None:
    from rankscope.commands.eval_scoring import Case

    def case(truth: str, predicted: str, suite: str = "sim") -> Case:
        return Case(
            scenario=truth,
            scale=8,
            seed=1,
            truth=truth,
            predicted=predicted,
            score=0.9,
            runner_up="",
            rank_ok=None,
            host_ok=None,
            rail_ok=None,
            magnitude=0.5,
            seconds=1.0,
            suite=suite,
        )

    text = eval_.summarize(
        [case("healthy", "healthy"), case("slow_device", "slow_device")],
        "rankscope eval --real",
        3.0,
        real=[case("host_pause", "healthy", "real")],
        real_errors=[("broken", "RuntimeError: no")],
    )
    assert text.startswith("## Diagnosis accuracy (`rankscope eval`)")
    assert "3 runs in 3 s" in text
    sim, real = text.split("### Simulated scenarios")[1].split("### Real jobs")
    assert "top-1 mechanism correct: 2/2" in sim and "Missed faults" not in sim
    assert "Missed faults (injected, called healthy):\n\n- host_pause @ 8 ranks: truth" in real
    assert "- broken: RuntimeError: no" in real
