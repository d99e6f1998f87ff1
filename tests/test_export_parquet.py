"""Parquet export: the recording's tables, streamed in row groups, read by DuckDB."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from test_hub_job import job

from rankscope.cli import main
from rankscope.hub import replay
from rankscope.hub.recording import RecordingWriter

pq = pytest.importorskip("pyarrow.parquet")

from rankscope.hub.export_parquet import (  # noqa: E402 - needs pyarrow
    FILES,
    QUERIES,
    ParquetUnavailable,
    write_parquet,
)

WORLD, STEPS, COLLS = 4, 6, 5


def record(path, messages) -> None:
    w = RecordingWriter(path)
    for i, m in enumerate(messages):
        w.append(m, 1000 + i)
    w.close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("pq")
    j = job(world=WORLD, steps=STEPS, colls=COLLS)
    record(base / "rec", j.messages)
    summary = write_parquet(base / "out", base / "rec", batch_rows=7)
    return base, j, summary


def read(base, name: str) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in pq.read_table(base / "out" / name).to_pydict().items()}


def test_every_table_holds_every_row_in_several_row_groups(exported) -> None:
    base, j, summary = exported
    assert summary.rows["steps.parquet"] == WORLD * STEPS
    assert summary.rows["collectives.parquet"] == j.raw["colls"]["op"].shape[0]
    assert summary.rows["phases.parquet"] == j.raw["phases"]["phase"].shape[0]
    for name in FILES:
        meta = pq.ParquetFile(base / "out" / name).metadata
        assert meta.num_rows == summary.rows[name]
        assert meta.num_row_groups == summary.row_groups[name] > 1, name
    steps = read(base, "steps.parquet")
    order = np.lexsort((steps["step"], steps["rank"]))
    raw = j.raw["steps"]
    raw_order = np.lexsort((raw["step"], raw["rank"]))
    assert (steps["t_end"][order] == raw["t_end"][raw_order]).all()
    assert set(steps["run"].tolist()) == {"r1"}
    phases = read(base, "phases.parquet")
    assert "mine" in set(phases["phase"].tolist())  # a user phase keeps its name


def test_instances_are_the_hubs_instances(exported) -> None:
    base, _, summary = exported
    _, window = replay.load_run(base / "rec", None, STEPS)
    inst = window.instances
    got = read(base, "instances.parquet")
    assert summary.rows["instances.parquet"] == inst.group.shape[0]
    mine = {(int(g), int(s)): i for i, (g, s) in enumerate(zip(got["group"], got["seq"]))}
    for k in range(inst.group.shape[0]):
        i = mine[(int(inst.group[k]), int(inst.seq[k]))]
        assert got["complete"][i] and got["n_arrived"][i] == inst.n_arrived[k]
        assert got["n_members"][i] == inst.n_members[k]
        assert got["first_ns"][i] - window.t0_ns == inst.first[k]
        assert got["last_ns"][i] - window.t0_ns == inst.last[k]
        assert got["skew_ns"][i] == inst.skew[k]
        assert got["last_rank"][i] == inst.last_rank[k]
        assert got["margin_ns"][i] == inst.margin[k]
        assert got["transfer_ns"][i] == pytest.approx(inst.transfer[k])


def test_the_documented_queries_run_and_find_the_slow_rank(exported) -> None:
    duckdb = pytest.importorskip("duckdb")
    base, _, _ = exported
    out = {name: duckdb.sql(q.format(dir=base / "out")).fetchall() for name, q in QUERIES.items()}
    assert len(out["steps.parquet"]) == WORLD
    assert {row[0] for row in out["phases.parquet"]} >= {"forward", "backward"}
    assert out["collectives.parquet"][0][0] == 2  # job() makes rank 2 enter late
    assert out["instances.parquet"][0][0] == 2 and out["instances.parquet"][0][1] > 0


def test_an_instance_a_rank_never_reported_is_written_incomplete(tmp_path) -> None:
    j = job(world=WORLD, steps=STEPS, colls=COLLS)
    gone = j.steps[1][-1]  # rank 1's last steps message
    record(tmp_path / "rec", [m for m in j.messages if m != gone])
    write_parquet(tmp_path / "out", tmp_path / "rec", batch_rows=5, lag_steps=1)
    got = {
        k: np.asarray(v)
        for k, v in pq.read_table(tmp_path / "out" / "instances.parquet").to_pydict().items()
    }
    open_ = ~got["complete"]
    assert open_.any() and (got["n_arrived"][open_] == got["n_members"][open_] - 1).all()
    assert (got["step"][open_] == STEPS - 1).all()
    assert got["complete"][got["step"] < STEPS - 1].all()


def test_the_command_writes_the_tables_and_names_them(tmp_path, capsys) -> None:
    record(tmp_path / "rec", job(world=2, steps=3, colls=2, slow=1).messages)
    assert main(["export", str(tmp_path / "rec"), "--parquet", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "parquet:" in said and "instances.parquet (" in said
    assert all((tmp_path / "out" / name).is_file() for name in FILES)
    assert (
        main(["export", str(tmp_path / "rec"), "--parquet", str(tmp_path / "o2"), "--run", "x"])
        == 2
    )
    assert "run 'x' is not in" in capsys.readouterr().err


def test_without_pyarrow_the_command_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    record(tmp_path / "rec", job(world=2, steps=2, colls=2, slow=1).messages)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ParquetUnavailable, match=r"rankscope\[parquet\]"):
        write_parquet(tmp_path / "out", tmp_path / "rec")
    assert main(["export", str(tmp_path / "rec"), "--parquet", str(tmp_path / "out")]) == 2
    assert "pip install 'rankscope[parquet]'" in capsys.readouterr().err
