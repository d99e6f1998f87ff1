"""NCCL Inspector import: files written in the documented v4.0 output format (pretty-printed
and one object per line, verbose and not), matched by (communicator, coll_sn), aligned
from kernel ends, with partial and corrupt files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from rankscope.collector import schema
from rankscope.hub.importers import write_recording
from rankscope.hub.importers.nccl_inspector import iter_objects
from rankscope.hub.recording import read_frames

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


def test_without_verbose_arrival_order_is_said_unknown(tmp_path: Path) -> None:
    write(tmp_path / "in", verbose=False)
    rep = write_recording("nccl-inspector", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.problems == [] and rep.colls == 60
    assert any("arrival order" in lack for lack in rep.lacks)
    co = colls(tmp_path / "rec")
    assert (co[0]["t_enter"] == schema.NO_TIME).all()
    dur = co[0]["t_end"] - co[0]["t_start"]
    assert (dur > 900_000).all()


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
