"""CSV export: tables, documented columns, exact times and the §6 numbers."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from rankscope.collector.schema import OP_INDEX, PHASE_INDEX, empty_table
from rankscope.diagnosis.arrivals import build_window
from rankscope.diagnosis.window import Window
from rankscope.hub.export_csv import TABLE_COLUMNS, write_csv

T0 = 1_700_000_000_123_456_789
MS = 1_000_000
MIB = 1 << 20
LATE = {5: 2, 6: 2, 7: 1}
"""Step -> the rank that enters the step's all_reduce 0.5 ms late."""


def toy_tables() -> dict:
    """Raw tables of a 4-rank run on two hosts, steps 5-7: forward then an all_reduce of
    1 MiB over everyone that one rank enters 0.5 ms late; service takes 0.2 ms after the
    last arrival."""
    ranks, steps = range(4), (5, 6, 7)
    n = len(ranks) * len(steps)
    st = empty_table("steps", n)
    st["rank"] = np.zeros(n, np.int64)
    ph = empty_table("phases", n)
    ph["rank"] = np.zeros(n, np.int64)
    co = empty_table("colls", n)
    co["rank"] = np.zeros(n, np.int64)
    for i, (r, s) in enumerate((r, s) for r in ranks for s in steps):
        base = T0 + (s - 5) * 10 * MS
        st["rank"][i], st["step"][i] = r, s
        st["t_start"][i], st["t_end"][i] = base, base + 9 * MS
        st["tokens"][i] = 4096
        ph["rank"][i], ph["step"][i], ph["phase"][i] = r, s, PHASE_INDEX["forward"]
        ph["t0"][i], ph["t1"][i] = base, base + 7 * MS
        enter = base + 7 * MS + (MS // 2 if LATE[s] == r else 0)
        co["rank"][i], co["step"][i], co["op"][i] = r, s, OP_INDEX["all_reduce"]
        co["group"][i], co["seq"][i], co["nbytes"][i] = 0, s, MIB
        co["t_enter"][i], co["t_exit"][i] = enter, base + 7 * MS + MS // 2 + MS // 5
        co["flags"][i] = 0
    identities = {
        r: {
            "rank": r,
            "world_size": 4,
            "local_rank": r % 2,
            "host": f"node{r // 2}",
            "node_rank": r // 2,
            "pid": 100 + r,
            "rail": r % 2,
        }
        for r in ranks
    }
    groups = [{"id": 0, "name": "world, all", "ranks": [0, 1, 2, 3]}]
    return dict(
        job="toy",
        run="run-7",
        identities=identities,
        groups=groups,
        steps=st,
        phases=ph,
        colls=co,
    )


def toy_run() -> Window:
    return build_window(**toy_tables())


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_tables_written_and_every_column_documented(tmp_path) -> None:
    summary = write_csv(tmp_path, toy_run())
    assert summary.rows["ranks.csv"] == 4
    assert summary.rows["rank_steps.csv"] == 12
    assert summary.rows["collectives.csv"] == 3
    assert summary.rows["collective_calls.csv"] == 12
    docs = {(d["table"], d["column"]) for d in _read(tmp_path / "columns.csv")}
    for table in TABLE_COLUMNS:
        with (tmp_path / table).open(encoding="utf-8") as fh:
            header = next(csv.reader(fh))
        missing = [c for c in header if (table, c) not in docs]
        assert not missing, f"{table}: undocumented columns {missing}"
    assert ("rank_steps.csv", "phase_forward_ms") in docs


def test_rank_steps_keep_exact_clock_times_and_aggregates(tmp_path) -> None:
    write_csv(tmp_path, toy_run())
    rows = _read(tmp_path / "rank_steps.csv")
    first = next(r for r in rows if r["rank"] == "3" and r["step"] == "6")
    assert int(first["t_start_ns"]) == T0 + 10 * MS
    assert int(first["t_end_ns"]) == T0 + 19 * MS
    assert float(first["step_ms"]) == pytest.approx(9.0)
    assert float(first["phase_forward_ms"]) == pytest.approx(7.0)
    assert first["host"] == "node1" and first["run"] == "run-7" and first["tokens"] == "4096"
    assert first["sm_clock_mhz"] == ""  # not measured: empty, never a made-up zero
    times_last = {r: 0 for r in range(4)}
    for row in rows:
        times_last[int(row["rank"])] += int(row["times_last"])
    assert times_last == {0: 0, 1: 1, 2: 2, 3: 0}
    late = next(r for r in rows if r["rank"] == "2" and r["step"] == "5")
    assert float(late["late_ms"]) == pytest.approx(0.5)
    assert float(late["wait_ms"]) == pytest.approx(0.0)
    waiter = next(r for r in rows if r["rank"] == "0" and r["step"] == "5")
    assert float(waiter["wait_ms"]) == pytest.approx(0.5)


def test_collectives_table_names_last_arriver_and_bandwidth(tmp_path) -> None:
    write_csv(tmp_path, toy_run())
    inst = {int(r["seq"]): r for r in _read(tmp_path / "collectives.csv")}
    assert {s: int(r["last_rank"]) for s, r in inst.items()} == LATE
    row = inst[5]
    assert row["group_name"] == "world, all"  # quoted, read back intact
    assert row["op"] == "all_reduce" and int(row["nbytes"]) == MIB
    assert int(row["first_ns"]) == T0 + 7 * MS and int(row["last_ns"]) == T0 + 7 * MS + MS // 2
    assert float(row["skew_us"]) == pytest.approx(500.0)
    assert float(row["transfer_us"]) == pytest.approx(200.0)
    # nccl-tests all_reduce: algbw = S / t, busbw = algbw * 2(n-1)/n.
    algbw = MIB / 200e-6 / 1e9
    assert float(row["algbw_gbps"]) == pytest.approx(algbw, rel=1e-3)
    assert float(row["busbw_gbps"]) == pytest.approx(algbw * 1.5, rel=1e-3)


def test_collective_calls_carry_lateness_and_last_flag(tmp_path) -> None:
    write_csv(tmp_path, toy_run())
    calls = _read(tmp_path / "collective_calls.csv")
    for c in calls:
        late = LATE[int(c["step"])] == int(c["rank"])
        assert c["last_arriver"] == ("1" if late else "0")
        assert float(c["lateness_us"]) == pytest.approx(500.0 if late else 0.0)
        assert float(c["wait_us"]) == pytest.approx(0.0 if late else 500.0)
        assert float(c["transfer_us"]) == pytest.approx(200.0)
        assert c["t_start_ns"] == ""  # no device times in this run


def test_ranks_table_and_bad_output(tmp_path) -> None:
    write_csv(tmp_path / "new" / "dir", toy_run())
    ranks = _read(tmp_path / "new" / "dir" / "ranks.csv")
    assert [(r["rank"], r["host"], r["rail"]) for r in ranks] == [
        ("0", "node0", "0"),
        ("1", "node0", "1"),
        ("2", "node1", "0"),
        ("3", "node1", "1"),
    ]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        write_csv(tmp_path / "file", toy_run())


def test_fixed_point_cells() -> None:
    from rankscope.hub.export_csv import _floats

    values = np.array([1.5, -0.25, np.nan, 1e20, 0.0, -0.0004, 123456.7891, np.inf])
    assert _floats(values, 1.0, 3) == [
        "1.500",
        "-0.250",
        "",
        "1e+20",
        "0.000",
        "0.000",
        "123456.789",
        "",
    ]
    assert _floats(np.array([2.5e6]), 1e6, 6) == ["2.500000"]
    assert _floats(np.array([np.nan, np.nan]), 1.0, 3) == ["", ""]
    assert _floats(np.array([]), 1.0, 3) == []
