"""NCCL Inspector import: files written in the documented v4.0 output format (pretty-printed
and one object per line, verbose and not), matched by (communicator, coll_sn), aligned
from kernel ends, with partial and corrupt files, and records holding values of the wrong
type or values that cannot be (each left out and named, the rest imported)."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.hub import replay
from rankscope.hub.importers import ImportReport, write_recording
from rankscope.hub.importers.nccl_inspector import iter_objects
from rankscope.hub.recording import ReadReport, read_frames

COMM = "0x7f8c496ae9f661"
T0_US = 1_752_867_229_000_000
SKEW_US = 5_000
"""Rank 1's clock runs this far ahead of rank 0's."""


def record(rank: int, sn: int, *, verbose: bool, late_us: int = 0) -> dict:
    start = T0_US + sn * 10_000 + late_us + (SKEW_US if rank == 1 else 0)
    last_arrival = T0_US + sn * 10_000 + (SKEW_US if rank == 1 else 0) + (300 if sn == 7 else 0)
    kstart = start + 20
    kstop = max(kstart, last_arrival + 20) + 1_000
    perf = {
        "coll": "AllReduce",
        "coll_sn": sn,
        "coll_msg_size_bytes": 1 << 20,
        "coll_exec_time_us": kstop - kstart,
        "coll_timing_source": "kernel_gpu",
        "coll_algobw_gbs": 1.0,
        "coll_busbw_gbs": 1.0,
    }
    if verbose:
        perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": []}
        perf["event_trace_ts"] = {
            "coll_start_ts": start,
            "coll_stop_ts": start + 5,
            "kernel_events": [
                {
                    "channel_id": ch,
                    "kernel_start_ts": kstart + ch,
                    "kernel_stop_ts": kstop - ch,
                    "kernel_record_ts": kstop - ch,
                }
                for ch in range(2)
            ],
        }
    return {
        "header": {"id": COMM, "rank": rank, "n_ranks": 2, "nnodes": 1},
        "metadata": {
            "inspector_output_format_version": "v4.0",
            "git_rev": "",
            "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": kstop + 400,
            "hostname": f"node{rank}",
            "pid": 1000 + rank,
        },
        "coll_perf": perf,
    }


def write(dir_: Path, *, verbose: bool) -> None:
    dir_.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        recs = [
            record(rank, sn, verbose=verbose, late_us=300 if (rank == 1 and sn == 7) else 0)
            for sn in range(1, 31)
        ]
        with open(dir_ / f"node{rank}-pid{1000 + rank}.log", "w") as f:
            for r in recs:
                # rank 0 pretty-printed, rank 1 one object per line: both occur
                f.write(json.dumps(r, indent=2 if rank == 0 else None) + "\n")


def colls(rec: Path) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for fr in read_frames(rec):
        m = schema.decode(fr.payload)
        if m.kind == "steps" and "colls" in m.tables:
            out[m.header["rank"]] = m.tables["colls"]
    return out


def test_verbose_files_are_matched_aligned_and_device_timed(tmp_path: Path) -> None:
    write(tmp_path / "in", verbose=True)
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.problems == [] and rep.ranks == 2 and rep.colls == 60
    assert not any("arrival order" in lack for lack in rep.lacks)
    co = colls(tmp_path / "rec")
    assert co[0]["flags"].tolist() == [schema.FLAG_DEVICE_TIMED] * 30
    # Rank 1's 5 ms clock offset is found from the kernel ends and taken out.
    assert abs(int(rep.details["clock_offsets_ns"]["1"]) - SKEW_US * 1000) < 50_000
    late = co[1]["t_enter"] - co[0]["t_enter"]
    i = int(np.flatnonzero(co[1]["seq"] == 7)[0])
    assert abs(int(late[i]) - 300_000) < 50_000
    assert np.all(np.abs(np.delete(late, i)) < 50_000)
    assert co[0]["nbytes"].tolist() == [1 << 20] * 30
    assert set(co[0]["op"].tolist()) == {schema.OP_INDEX["all_reduce"]}
    res = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(tmp_path / "rec"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


def test_output_without_verbose_timestamps_is_named_and_left_out(tmp_path: Path) -> None:
    # Without event_trace_ts no row has an entry time, which every reader needs: each file
    # is named with the setting that gives one, nothing is imported, and the command fails.
    write(tmp_path / "in", verbose=False)
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == 0 and rep.ranks == 0
    assert sorted(Path(f).name for f, _ in rep.problems) == [
        "node0-pid1000.log",
        "node1-pid1001.log",
    ]
    assert all("NCCL_INSPECTOR_DUMP_VERBOSE=1" in what for _, what in rep.problems)
    res = subprocess.run(
        [sys.executable, "-m", "rankscope", "import", "nccl-inspector", str(tmp_path / "in"),
         "--record", str(tmp_path / "rec2")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 1 and "NCCL_INSPECTOR_DUMP_VERBOSE=1" in res.stderr, res.stderr


def test_partial_and_corrupt_files_name_the_file_and_keep_the_rest(tmp_path: Path) -> None:
    write(tmp_path / "in", verbose=True)
    good = (tmp_path / "in" / "node1-pid1001.log").read_text()
    (tmp_path / "in" / "node1-pid1001.log").write_text(good[: len(good) - 200])
    (tmp_path / "in" / "junk.log").write_text('{"header": {"id": 1}} not json at all')
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    why: dict[str, str] = {}
    for file, what in rep.problems:
        why[file] = why.get(file, "") + what + "; "
    assert "incomplete last record" in why[str(tmp_path / "in" / "node1-pid1001.log")]
    assert "not JSON" in why[str(tmp_path / "in" / "junk.log")]
    assert rep.colls == 30 + 29


def test_stream_reader_stops_at_an_unfinished_object() -> None:
    text = '{"a": 1}\n{"b": {"c": [1, 2'
    got = list(iter_objects(text))
    assert [o for o, _ in got] == [{"a": 1}]
    assert got[-1][1] == len('{"a": 1}')


# -- hostile records: each left out and named, the rest imported -----------------------


def write_changed(dir_: Path, change: Callable[[dict[str, Any]], Any]) -> Path:
    """The verbose pair of files, with rank 1's record of coll_sn 5 replaced by what
    ``change`` returns (or changed in place when it returns None). Returns rank 1's file."""
    write(dir_, verbose=True)
    recs: list[Any] = [
        record(1, sn, verbose=True, late_us=300 if sn == 7 else 0) for sn in range(1, 31)
    ]
    out = change(recs[4])
    recs[4] = recs[4] if out is None else out
    f = dir_ / "node1-pid1001.log"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return f


def refused(rec: Path) -> list[str]:
    """What the hub refuses when it replays ``rec`` (each refused record's reason)."""
    read = ReadReport()
    replay.load(rec, report=read)
    return [s.detail for s in read.skipped]


def problems_of(rep: ImportReport, file: Path) -> str:
    """The report's problem lines about ``file``, joined."""
    return "; ".join(what for f, what in rep.problems if f == str(file))


def import_changed(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any]
) -> tuple[ImportReport, str]:
    """Import the pair with rank 1's fifth record changed (`write_changed`); the report and
    what it says about rank 1's file. What was imported must replay whole."""
    bad = write_changed(tmp_path / "in", change)
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.ranks == 2
    assert refused(tmp_path / "rec") == []
    return rep, problems_of(rep, bad)


def imported_with(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any]
) -> tuple[ImportReport, str]:
    """`import_changed`, where the changed record is left out and every other imported."""
    rep, why = import_changed(tmp_path, change)
    assert rep.colls == 59
    return rep, why


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change putting ``value`` at ``path`` of the record."""

    def change(rec: dict[str, Any]) -> None:
        for key in path[:-1]:
            rec = rec[key]
        rec[path[-1]] = value

    return change


def test_a_record_whose_coll_sn_is_a_string_is_skipped_and_named(tmp_path: Path) -> None:
    _, why = imported_with(tmp_path, _set("coll_perf", "coll_sn", value="5"))
    assert why == "1 record(s) whose coll_sn is not an integer in 0..2**62 left out"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("coll_perf", "coll_sn"), 2**64),
        (("header", "rank"), 2**63 - 1),
        (("coll_perf", "coll_msg_size_bytes"), 2**64),
        (("coll_perf", "event_trace_ts", "kernel_events", 0, "kernel_stop_ts"), 2**63),
    ],
    ids=["coll_sn", "rank", "size", "kernel_stop"],
)
def test_a_record_holding_an_integer_past_int64_is_skipped_and_named(
    tmp_path: Path, path: tuple[Any, ...], value: int
) -> None:
    # Read unchecked, this raises OverflowError building its int64 columns.
    _, why = imported_with(tmp_path, _set(*path, value=value))
    assert f"1 record(s) whose {path[-1]} is not " in why and why.endswith("left out")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("coll_perf", "coll_exec_time_us"), float("inf")),
        (("coll_perf", "event_trace_ts", "coll_start_ts"), 1e20),
        (("coll_perf", "event_trace_ts", "kernel_events", 1, "kernel_start_ts"), float("nan")),
        (("metadata", "dump_timestamp_us"), -1.5),
    ],
    ids=["exec-inf", "start-1e20", "kernel-nan", "dump-negative"],
)
def test_a_record_whose_time_is_infinite_huge_or_negative_is_skipped_and_named(
    tmp_path: Path, path: tuple[Any, ...], value: float
) -> None:
    # Infinity and NaN are what Python's JSON writer puts for inf and nan.
    _, why = imported_with(tmp_path, _set(*path, value=value))
    assert why == f"1 record(s) whose {path[-1]} is not a number of µs in 0..2**52 left out"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda rec: 7, "that are not JSON objects"),
        (lambda rec: [rec], "that are not JSON objects"),
        (_set("coll_perf", value=[1]), "without header/coll_perf fields"),
        (_set("metadata", value="node1"), "whose metadata is not an object"),
        (_set("coll_perf", "event_trace_ts", value=5), "whose event_trace_ts is not an object"),
        (_set("header", "rank", value=True), "whose rank is not an integer in 0..131071"),
        (_set("coll_perf", "coll", value=None), "whose coll is not a string"),
    ],
    ids=["number", "list", "list-perf", "text-metadata", "number-trace", "bool-rank", "null-coll"],
)
def test_a_record_with_a_value_of_the_wrong_type_is_skipped_and_named(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], named: str
) -> None:
    _, why = imported_with(tmp_path, change)
    assert why == f"1 record(s) {named} left out"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_set("coll_perf", "coll_msg_size_bytes", value=-5), "whose coll_msg_size_bytes is not"),
        (_set("coll_perf", "coll_sn", value=-1), "whose coll_sn is not"),
        (
            _set(
                "coll_perf",
                "event_trace_ts",
                "kernel_events",
                value=[{"kernel_start_ts": T0_US + 57_000, "kernel_stop_ts": T0_US + 56_000}],
            ),
            "whose last kernel stops before the first starts",
        ),
        (
            _set("coll_perf", "event_trace_ts", "coll_start_ts", value=2e15),
            "end before coll_start_ts",
        ),
        (
            _set("coll_perf", "event_trace_ts", "coll_start_ts", value=1e9),
            "last longer than 7 days",
        ),
    ],
    ids=[
        "negative-size",
        "negative-sn",
        "kernel-backwards",
        "ends-before-coll-start",
        "eight-days",
    ],
)
def test_a_record_the_hub_would_refuse_is_skipped_so_its_rank_replays(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], named: str
) -> None:
    # Imported unchecked, these rows make the replay refuse the rank's whole
    # steps message: every collective of the rank was lost.
    _, why = imported_with(tmp_path, change)
    assert named in why


def test_a_step_spanning_weeks_is_left_out_and_named_so_its_rank_replays(tmp_path: Path) -> None:
    # Each record is good alone, but one lies 30 days after its step's others: written
    # as it is, the step makes the replay refuse the rank's whole steps message.
    month_us = 30 * 86_400 * 10**6

    def later(rec: dict[str, Any]) -> None:
        ts = rec["coll_perf"]["event_trace_ts"]
        ts["coll_start_ts"] += month_us
        ts["coll_stop_ts"] += month_us
        for k in ts["kernel_events"]:
            k["kernel_start_ts"] += month_us
            k["kernel_stop_ts"] += month_us

    rep, why = import_changed(tmp_path, later)
    assert rep.colls == 60 - 10
    assert why == (
        "1 step(s) longer than 7 days (10 record(s) further apart than the hub takes) left out"
    )


def test_a_verbose_record_without_kernel_times_is_skipped_and_the_import_stays_verbose(
    tmp_path: Path,
) -> None:
    # Unchecked, one such record makes the whole import read as not verbose: no arrival order anywhere.
    rep, why = imported_with(
        tmp_path, _set("coll_perf", "event_trace_ts", "kernel_events", value=[])
    )
    assert why == "1 record(s) without coll_start_ts or a kernel stop in verbose output left out"
    assert not any("arrival order" in lack for lack in rep.lacks)


def test_a_pid_past_int64_is_named_and_the_records_are_imported(tmp_path: Path) -> None:
    # Unchecked, it goes into the hello, which msgpack refuses with an OverflowError.
    write(tmp_path / "in", verbose=True)
    f = tmp_path / "in" / "node1-pid1001.log"
    f.write_text(f.read_text().replace('"pid": 1001', f'"pid": {2**64}'))
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == 60 and refused(tmp_path / "rec") == []
    assert problems_of(rep, f) == "metadata pid is not an integer in 0..2**63-1; pid unknown"


def test_json_nested_too_deeply_is_named_and_the_records_before_it_are_imported(
    tmp_path: Path,
) -> None:
    # Read unchecked, this raises RecursionError.
    write(tmp_path / "in", verbose=True)
    f = tmp_path / "in" / "node1-pid1001.log"
    f.write_text(f.read_text() + "[" * 100_000 + "]" * 100_000)
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == 60
    assert problems_of(rep, f).startswith("JSON nested too deeply to read at offset")


def test_a_gzip_file_cut_short_is_named_and_the_other_files_imported(tmp_path: Path) -> None:
    # Read unchecked, this raises EOFError out of the gzip stream.
    write(tmp_path / "in", verbose=True)
    f = tmp_path / "in" / "node1-pid1001.log"
    packed = gzip.compress(f.read_bytes())
    f.unlink()
    cut = tmp_path / "in" / "node1-pid1001.log.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == 30 and rep.files_read == [str(tmp_path / "in" / "node0-pid1000.log")]
    assert problems_of(rep, cut).startswith("cannot be read (gzip data cut short or corrupt")


HOSTILE = (None, True, -1, 2**63, 2**64, 1e20, float("inf"), float("nan"), "", "7", [], {}, [1])
"""Values put in place of a record's own, by `test_seeded_hostile_values_never_raise`."""


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of the values in ``obj`` that are not containers (and of empty lists)."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _leaves(v, (*path, k))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _leaves(v, (*path, i))] or [path]
    return [path]


@pytest.mark.parametrize("seed", range(4))
def test_seeded_hostile_values_never_raise_and_keep_every_other_record(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    for case in range(10):
        leaf = rng.choice(_leaves(record(1, 5, verbose=True)))
        value = rng.choice(HOSTILE)
        rep, why = import_changed(tmp_path / str(case), _set(*leaf, value=value))
        # Either the record is left out and named, or it is still good (a field unused).
        left_out = rep.colls == 59 and why.endswith("left out")
        assert left_out or (rep.colls == 60 and why == ""), (leaf, value, why)


def test_output_without_verbose_timestamps_still_names_the_last_arrival_from_kernel_times(
    tmp_path: Path,
) -> None:
    # The plugin's default output: no entry times, only each kernel's duration. A
    # collective's kernel runs until its last peer has arrived, so the rank that arrives
    # last has the shortest kernel and the others' extra time is their wait. Four ranks,
    # rank 2 late by 400 µs in 24 of 30 collectives (the others: no order to tell).
    def rec(rank: int, sn: int) -> dict:
        late = 400 if (sn % 5 != 0) else 0
        start = T0_US + sn * 10_000 + (late if rank == 2 else 0)
        kstop = T0_US + sn * 10_000 + late + 1_020
        r = record(rank, sn, verbose=False)
        r["header"]["n_ranks"] = 4
        r["coll_perf"]["coll_exec_time_us"] = kstop - (start + 20)
        return r

    src = tmp_path / "in"
    src.mkdir()
    for rank in range(4):
        with open(src / f"node{rank}.log", "w") as f:
            for sn in range(1, 31):
                f.write(json.dumps(rec(rank, sn)) + "\n")
    rep = write_recording("nccl-inspector", [src], tmp_path / "rec", run="r")
    assert rep.messages == 0 and len(rep.problems) == 4  # still nothing to replay
    (row,) = rep.details["last_by_kernel"]
    assert row["comm"] == COMM and row["ranks"] == 4 and row["collectives"] == 30
    assert row["rank"] == 2 and row["ordered"] == 24 and row["share"] == 1.0
    assert row["wait_us"] == pytest.approx(400.0)
    res = subprocess.run(
        [sys.executable, "-m", "rankscope", "import", "nccl-inspector", str(src),
         "--record", str(tmp_path / "rec2")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 1
    assert "rank 2 shortest in 100% of the 24 of 30 collectives" in res.stdout, res.stdout
    # The shortest kernel of each collective (the late rank's, 1,000 µs) times the transfer:
    # 1 MiB all-reduced over 4 ranks is 1.05 GB/s of algorithm and 1.57 of bus bandwidth.
    (bw,) = rep.details["bandwidth_by_size"]
    assert (bw["op"], bw["nbytes"], bw["ranks"], bw["collectives"]) == (
        "all_reduce",
        1 << 20,
        4,
        30,
    )
    assert bw["transfer_us"] == pytest.approx(1000.0)
    assert bw["busbw_gbs"] == pytest.approx((1 << 20) / 1e6 * 1.5)
    assert "all_reduce 1,048,576 B: busbw 1.57 GB/s, transfer 1000 µs" in res.stdout, res.stdout
    # Without one member's file the shortest of the others tells nothing.
    (src / "node2.log").unlink()
    rep = write_recording("nccl-inspector", [src], tmp_path / "rec3", run="r")
    assert "last_by_kernel" not in rep.details and "bandwidth_by_size" not in rep.details
