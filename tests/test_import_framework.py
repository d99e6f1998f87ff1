"""The import framework: paths, gzip, the command's errors and exit codes, clock alignment."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from rankscope.cli import main
from rankscope.hub import importers
from rankscope.hub.importers import (
    IMPORTERS,
    ImportError_,
    ImportReport,
    expand_paths,
    open_binary,
    open_text,
    write_recording,
)
from rankscope.hub.importers.align import estimate_offsets
from rankscope.hub.recording import read_meta

DATA = Path(__file__).parent / "data" / "kineto"


def test_expand_paths_takes_files_globs_and_directories_sorted(tmp_path: Path) -> None:
    (tmp_path / "a" / "deep").mkdir(parents=True)
    files = [tmp_path / "a" / "deep" / "r1.json", tmp_path / "a" / "r0.json", tmp_path / "x.txt"]
    for f in files:
        f.write_text("{}")
    (tmp_path / "a" / ".hidden").write_text("")
    assert expand_paths([str(tmp_path / "a")]) == sorted(files[:2])
    assert expand_paths([str(tmp_path / "*.txt"), str(files[1])]) == sorted([files[2], files[1]])
    assert expand_paths([str(tmp_path / "nosuch")]) == []
    # The same file named twice is read once.
    assert expand_paths([str(files[2]), str(files[2])]) == [files[2]]


def test_open_reads_gzip_by_suffix_and_by_magic(tmp_path: Path) -> None:
    plain = tmp_path / "t.json"
    plain.write_text('{"a": 1}')
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(b'{"a": 2}'))
    hidden = tmp_path / "t2.json"  # gzip without the suffix
    hidden.write_bytes(gzip.compress(b'{"a": 3}'))
    with open_text(plain) as f:
        assert json.load(f) == {"a": 1}
    with open_text(gz) as f:
        assert json.load(f) == {"a": 2}
    with open_binary(hidden) as f:
        assert json.loads(f.read()) == {"a": 3}


def test_unknown_kind_lists_the_kinds(capsys, tmp_path: Path) -> None:
    rc = main(["import", "nosuch", str(tmp_path), "--record", str(tmp_path / "rec")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown import kind 'nosuch'" in err
    for kind in IMPORTERS:
        assert kind in err
    assert not (tmp_path / "rec").exists()


def test_a_kind_without_its_module_says_so(monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setitem(IMPORTERS, "later", "rankscope.hub.importers.not_written_yet")
    rc = main(["import", "later", str(tmp_path), "--record", str(tmp_path / "rec")])
    assert rc == 2
    assert "'later' is not available in this build yet" in capsys.readouterr().err
    with pytest.raises(ImportError_, match="not available"):
        importers.load_importer("later")


def test_no_input_file_is_an_error(capsys, tmp_path: Path) -> None:
    rc = main(["import", "kineto", str(tmp_path / "none*.json"), "--record", str(tmp_path / "r")])
    assert rc == 2
    assert "no input file" in capsys.readouterr().err


def _fake_importer(monkeypatch) -> None:
    """A tiny importer of its own kind: one rank per file holding a step number."""
    from rankscope.collector import schema

    mod = types.ModuleType("rankscope_test_fake_importer")

    def messages(files, report, *, job, run):
        for rank, f in enumerate(files):
            try:
                step = int(f.read_text())
            except ValueError:
                report.problem(f, "not a step number")
                continue
            h = importers.header(job, run, rank)
            ident = {
                "rank": rank,
                "world_size": len(files),
                "local_rank": 0,
                "host": "h",
                "node_rank": 0,
                "pid": 1,
            }
            yield schema.hello_message(importers.next_header(h), ident)
            st = schema.empty_table("steps", 1)
            st["step"][:] = step
            st["t_start"][:] = 1_000_000_000
            st["t_end"][:] = 1_100_000_000
            yield schema.steps_message(importers.next_header(h), st)
            report.files_read.append(str(f))
        report.lack("collectives")

    mod.messages = messages  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(IMPORTERS, "fake", mod.__name__)


def test_bad_files_are_one_line_each_and_the_rest_is_imported(
    monkeypatch, capsys, tmp_path: Path
) -> None:
    _fake_importer(monkeypatch)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a").write_text("7")
    (tmp_path / "in" / "b").write_text("garbage")
    rec = tmp_path / "rec"
    rc = main(["import", "fake", str(tmp_path / "in"), "--record", str(rec), "--run", "r1"])
    out = capsys.readouterr()
    assert rc == 0
    lines = [ln for ln in out.err.splitlines() if ln]
    assert lines == [f"rankscope: import: {tmp_path / 'in' / 'b'}: not a step number"]
    assert "1 step rows" in out.out
    meta = read_meta(rec)
    source = meta["sessions"][-1]["source"]
    assert source["kind"] == "fake"
    assert source["files"] == [str(tmp_path / "in" / "a")]
    assert source["lacks"] == ["collectives"]
    # The recording reads back as an ordinary run.
    from rankscope.hub import replay

    store = replay.load(rec)
    assert store.run_ids() == ["r1"]


def test_nothing_importable_exits_nonzero(monkeypatch, capsys, tmp_path: Path) -> None:
    _fake_importer(monkeypatch)
    (tmp_path / "b").write_text("garbage")
    rc = main(["import", "fake", str(tmp_path / "b"), "--record", str(tmp_path / "rec")])
    assert rc == 1
    assert "not a step number" in capsys.readouterr().err


def test_write_recording_keeps_problems_and_the_report(monkeypatch, tmp_path: Path) -> None:
    _fake_importer(monkeypatch)
    (tmp_path / "a").write_text("3")
    rep = write_recording("fake", [tmp_path / "a"], tmp_path / "rec", job="j", run="r")
    assert isinstance(rep, ImportReport)
    assert (rep.ranks, rep.steps, rep.messages) == (1, 1, 2)
    assert rep.to_dict()["files_read"] == [str(tmp_path / "a")]
    rep.alignment = 1500.0
    assert rep.alignment_ns == 1500 and rep.to_dict()["alignment_ns"] == 1500


def test_a_truncated_kineto_file_is_named_and_the_others_imported(capsys, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    shutil.copy(DATA / "sampled_rank-0.json.gz", tmp_path / "in")
    data = gzip.decompress((DATA / "sampled_rank-1.json.gz").read_bytes())
    cut = tmp_path / "in" / "sampled_rank-1.json"
    cut.write_bytes(data[: len(data) // 2])
    (tmp_path / "in" / "notes.txt").write_text("hello")
    rc = main(["import", "kineto", str(tmp_path / "in"), "--record", str(tmp_path / "rec")])
    err = capsys.readouterr().err
    assert rc == 0
    assert f"{cut}: ends early or is not JSON" in err
    assert "notes.txt: not a .json" in err


def test_alignment_recovers_offsets_and_reports_the_residual() -> None:
    rng = np.random.default_rng(3)
    n_inst, ranks = 200, 4
    true_end = np.cumsum(rng.uniform(1e5, 1e6, n_inst)).astype(np.int64)
    offsets = np.array([0, 5_000_000, -3_000_000, 70_000_000])
    rank, group, seq, t_end = [], [], [], []
    for r in range(ranks):
        keep = rng.random(n_inst) > 0.1  # each rank misses some instances
        jitter = rng.normal(0, 2_000, n_inst).astype(np.int64)
        rank.append(np.full(keep.sum(), r))
        group.append(np.zeros(keep.sum(), np.int64))
        seq.append(np.flatnonzero(keep))
        t_end.append((true_end + offsets[r] + jitter)[keep])
    al = estimate_offsets(*(np.concatenate(x) for x in (rank, group, seq, t_end)))
    rel = np.array([al.offset_of(r) for r in range(ranks)]) - al.offset_of(0)
    assert np.abs(rel - offsets).max() < 2_000
    assert 0 < al.max_error_ns < 10_000
    # Outliers (a rank that arrived late in some instances) do not move the median.
    assert al.matches.min() > 100


def test_alignment_without_shared_instances_aligns_nothing() -> None:
    al = estimate_offsets(
        np.array([0, 0, 1, 1]), np.zeros(4), np.array([0, 1, 5, 6]), np.array([1, 2, 3, 4])
    )
    assert al.max_error_ns == 0  # only the reference
    assert (al.error_ns == -1).sum() == 1
