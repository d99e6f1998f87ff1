"""Flight Recorder import: real gloo dumps written by torch (``_dump_fr_trace`` and
``_dump_fr_trace_json``) of a 2-rank job where rank 1 never enters the last all-reduce,
the restricted unpickler, bad files, and the hang in ``rankscope diagnose``; dumps in the
same layout holding values of the wrong type or values that cannot be (each entry left
out and named, the rest imported)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rankscope.hub import replay
from rankscope.hub.importers import ImportReport, write_recording
from rankscope.hub.importers.flight_recorder import DumpError, load_dump
from rankscope.hub.recording import ReadReport

WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    rank, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(256)
    for _ in range(12):
        dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.empty(512), t)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # rank 1 never enters this one
    import time
    # Dumped past the stall judge's floor (6 s without progress), as a watchdog dumps at
    # its timeout: a dump taken at once shows no stall yet.
    time.sleep(7)
    import torch._C._distributed_c10d as c
    with open(os.path.join(out, f"rank_{rank}.pkl"), "wb") as f:
        f.write(c._dump_fr_trace())
    with open(os.path.join(out, f"json_rank_{rank}.json"), "wb") as f:
        f.write(c._dump_fr_trace_json())
    open(os.path.join(out, f"done{rank}"), "w").close()
    import time
    deadline = time.monotonic() + 60
    # Neither process leaves before both dumped: a closed peer would end the pending work.
    while not os.path.exists(os.path.join(out, f"done{1 - rank}")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("fr")
    script = out / "worker.py"
    script.write_text(WORKER)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(out), str(port)], env=env)
        for r in (0, 1)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return out


def test_real_gloo_dump_pickle_and_json_agree(dumps: Path) -> None:
    pk = load_dump(dumps / "rank_0.pkl")
    js = load_dump(dumps / "json_rank_0.json")
    assert pk["version"] == js["version"]
    assert len(pk["entries"]) == len(js["entries"]) == 14
    last = pk["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["collective_seq_id"] == 14
    assert not last["retired"]


def _import(dumps: Path, pattern: str, tmp_path: Path) -> tuple[ImportReport, Path]:
    rec = tmp_path / "rec"
    rep = write_recording("flight-recorder", [str(dumps / pattern)], rec, job="j", run="r")
    return rep, rec


@pytest.mark.parametrize("pattern", ["rank_*.pkl", "json_rank_*.json"])
def test_import_names_the_rank_that_never_entered(
    dumps: Path, tmp_path: Path, pattern: str
) -> None:
    rep, rec = _import(dumps, pattern, tmp_path)
    assert rep.problems == []
    assert rep.ranks == 2 and rep.colls == 14 + 13
    hang = rep.details["hang"]
    assert len(hang) == 1
    assert hang[0]["seq"] == 14
    assert hang[0]["entered_not_finished"] == [0]
    assert hang[0]["never_entered"] == [1]
    assert any("steps" in lack for lack in rep.lacks)
    if pattern.endswith(".json"):
        return  # same rows as the pickle's: diagnose is run once
    res = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(rec), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["stall"]["stalled"] is True
    assert out["stall"]["culprits"] == [1]
    culprit = out["stall"]["hang"]["culprits"][0]
    assert culprit["rank"] == 1 and culprit["seq"] == 14 and culprit["op"] == "all_reduce"
    text = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(rec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "STALLED" in text.stdout and "culprit rank 1" in text.stdout


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_pickle_with_a_global_is_refused_and_the_rest_imported(dumps: Path, tmp_path: Path) -> None:
    evil = tmp_path / "in" / "rank_1.pkl"
    evil.parent.mkdir()
    evil.write_bytes(pickle.dumps({"entries": [_Boom()]}))
    with pytest.raises(DumpError, match="refused global"):
        load_dump(evil)
    (tmp_path / "in" / "rank_0.pkl").write_bytes((dumps / "rank_0.pkl").read_bytes())
    (tmp_path / "in" / "rank_2.pkl").write_bytes((dumps / "rank_1.pkl").read_bytes()[:100])
    (tmp_path / "in" / "rank_3.json").write_text('{"version": "2.10"}')
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    why = dict(rep.problems)
    assert "refused global" in why[str(evil)]
    assert "truncated or corrupt" in why[str(tmp_path / "in" / "rank_2.pkl")]
    assert "no 'entries' list" in why[str(tmp_path / "in" / "rank_3.json")]
    assert rep.files_read == [str(tmp_path / "in" / "rank_0.pkl")] and rep.colls == 14


# -- hostile dumps: each bad entry left out and named, the rest imported -----------------

T0_NS = 1_796_608_152_000_000_000
SKEW_NS = 3_000_000
"""Rank 1's clock runs this far ahead of rank 0's."""
ENTRIES = 20


def entry(rank: int, seq: int) -> dict[str, Any]:
    """One finished all-reduce entry as ``_dump_fr_trace_json`` writes it (NCCL: the
    watchdog discovered its start and completion)."""
    created = T0_NS + seq * 1_000_000 + (SKEW_NS if rank == 1 else 0)
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": "nccl:all_reduce",
        "time_created_ns": created,
        "duration_ms": 0.4,
        "input_sizes": [[256]],
        "input_dtypes": ["Float"],
        "output_sizes": [[256]],
        "output_dtypes": ["Float"],
        "state": "completed",
        "time_discovered_started_ns": created + 10_000,
        "time_discovered_completed_ns": created + 500_000,
        "retired": True,
        "timeout_ms": 600_000,
        "is_p2p": False,
    }


def dump(rank: int) -> dict[str, Any]:
    """A rank's dump of `ENTRIES` finished all-reduces."""
    return {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {},
        "entries": [entry(rank, seq) for seq in range(1, ENTRIES + 1)],
    }


def write_changed(
    dir_: Path, change: Callable[[dict[str, Any]], Any], *, pickled: bool = False
) -> Path:
    """The two ranks' dumps, with ``change`` applied to rank 1's dump (it changes it in
    place or returns the new one). Returns rank 1's file."""
    dir_.mkdir(parents=True)
    (dir_ / "rank_0.json").write_text(json.dumps(dump(0)))
    doc = dump(1)
    out = change(doc)
    doc = doc if out is None else out
    if pickled:
        f = dir_ / "rank_1.pkl"
        f.write_bytes(pickle.dumps(doc))
    else:
        f = dir_ / "rank_1.json"
        f.write_text(json.dumps(doc))
    return f


def in_entry(key: str, value: Any, at: int = 4) -> Callable[[dict[str, Any]], None]:
    """A change putting ``value`` at ``key`` of rank 1's entry ``at``."""

    def change(doc: dict[str, Any]) -> None:
        doc["entries"][at][key] = value

    return change


def refused(rec: Path) -> list[str]:
    """What the hub refuses when it replays ``rec`` (each refused record's reason)."""
    read = ReadReport()
    replay.load(rec, report=read)
    return [s.detail for s in read.skipped]


def import_changed(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], *, pickled: bool = False
) -> tuple[ImportReport, str]:
    """Import the dumps with rank 1's changed; the report and what it says about rank 1's
    file. What was imported must replay whole."""
    bad = write_changed(tmp_path / "in", change, pickled=pickled)
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert refused(tmp_path / "rec") == []
    return rep, "; ".join(what for f, what in rep.problems if f == str(bad))


def imported_with(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], *, pickled: bool = False
) -> tuple[ImportReport, str]:
    """`import_changed`, where one entry of rank 1 is left out and every other imported."""
    rep, why = import_changed(tmp_path, change, pickled=pickled)
    assert rep.ranks == 2 and rep.colls == 2 * ENTRIES - 1
    return rep, why


@pytest.mark.parametrize(
    "sizes", [[["256"]], [[[256]]], [[float("inf")]], [[-1]]], ids=["text", "list", "inf", "neg"]
)
def test_an_entry_whose_input_sizes_are_not_sizes_is_skipped_and_named(
    tmp_path: Path, sizes: list[Any]
) -> None:
    # Read unchecked, this raises ValueError, TypeError or OverflowError on int() of a size.
    _, why = imported_with(tmp_path, in_entry("input_sizes", sizes))
    assert why == "1 entry whose input_sizes hold something other than sizes left out"


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("time_created_ns", 2**64, "whose time_created_ns is not a time in 0..2**62 ns"),
        ("collective_seq_id", 2**63, "whose collective_seq_id is not an integer in -1..2**62"),
        ("record_id", 2**64, "whose record_id is not an integer in 0..2**63-1"),
        (
            "time_discovered_completed_ns",
            2**63,
            "whose time_discovered_completed_ns is not a time in 0..2**62 ns",
        ),
    ],
    ids=["created", "seq", "record", "completed"],
)
def test_an_entry_holding_an_integer_past_int64_is_skipped_and_named(
    tmp_path: Path, key: str, value: int, named: str
) -> None:
    # Read unchecked, this raises OverflowError building its int64 columns.
    _, why = imported_with(tmp_path, in_entry(key, value))
    assert why == f"1 entry {named} left out"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda doc: doc["entries"].__setitem__(4, 7), "that are not maps"),
        (in_entry("time_created_ns", True), "whose time_created_ns is not a time"),
        (in_entry("is_p2p", "false"), "whose is_p2p is not a boolean"),
        (in_entry("state", 5), "whose state is not a string"),
        (in_entry("process_group", [{"name": "0"}, "default_pg"]), "whose process_group is not"),
    ],
    ids=["number", "bool-time", "text-bool", "number-state", "map-name"],
)
def test_an_entry_with_a_value_of_the_wrong_type_is_skipped_and_named(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], named: str
) -> None:
    _, why = imported_with(tmp_path, change)
    assert why.startswith(f"1 entry {named}") and why.endswith("left out")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (in_entry("collective_seq_id", -5), "whose collective_seq_id is not"),
        (in_entry("time_discovered_completed_ns", T0_NS), "that complete before they were created"),
        (in_entry("time_created_ns", T0_NS - 8 * 86_400 * 10**9), "that last longer than 7 days"),
    ],
    ids=["negative-seq", "completed-first", "eight-days"],
)
def test_an_entry_the_hub_would_refuse_is_skipped_so_its_rank_replays(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], named: str
) -> None:
    # Imported unchecked, these rows make the replay refuse the rank's whole
    # steps message: every collective of the rank was lost.
    _, why = imported_with(tmp_path, change)
    assert named in why


def test_a_step_spanning_weeks_is_left_out_and_named_so_its_rank_replays(tmp_path: Path) -> None:
    # Each entry is good alone, but one lies 30 days after its step's others: written
    # as it is, the step makes the replay refuse the rank's whole steps message.
    month_ns = 30 * 86_400 * 10**9

    def later(doc: dict[str, Any]) -> None:
        e = doc["entries"][4]
        for key in (
            "time_created_ns",
            "time_discovered_started_ns",
            "time_discovered_completed_ns",
        ):
            e[key] += month_ns

    rep, why = import_changed(tmp_path, later)
    assert rep.colls == 2 * ENTRIES - 10
    assert why == (
        "1 step(s) longer than 7 days (10 entries further apart than the hub takes) left out"
    )


def test_a_pickled_process_group_name_past_int_to_text_is_skipped_and_named(
    tmp_path: Path,
) -> None:
    # Python will not write an integer of 5001 digits as text: str() raises.
    _, why = imported_with(tmp_path, in_entry("process_group", [10**5000, "pg"]), pickled=True)
    assert why == "1 entry whose process_group is not [name, description] left out"


@pytest.mark.parametrize(
    "ranks", [["x"], [0, [1]], [0, 2**40], [0, 0]], ids=["text", "list", "huge", "twice"]
)
def test_pg_config_ranks_that_are_not_ranks_are_named_and_the_dump_imported(
    tmp_path: Path, ranks: Any
) -> None:
    # Read unchecked, int("x") raises ValueError and int([1]) TypeError, 2**40 becomes a
    # member (a world the hub refuses) and 0 twice a group the hub refuses.
    def change(doc: dict[str, Any]) -> None:
        doc["pg_config"]["0"]["ranks"] = ranks

    rep, why = import_changed(tmp_path, change)
    assert rep.ranks == 2 and rep.colls == 2 * ENTRIES
    assert why == "pg_config '0': ranks are not distinct ranks in 0..131071; members unknown"


def test_a_rank_that_is_not_a_rank_is_named_and_the_file_name_numbers_it(tmp_path: Path) -> None:
    # Unchecked, 2**40 is taken as the rank: a world size the hub refuses.
    rep, why = import_changed(tmp_path, lambda doc: doc.update(rank=2**40))
    assert rep.ranks == 2 and rep.colls == 2 * ENTRIES
    assert why.startswith("rank is not an integer in 0..131071; numbered by its file name")


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80\x05\x96" + (2**64 - 1).to_bytes(8, "little") + b".",
        b"\x80\x04\x8e" + (2**62).to_bytes(8, "little") + b".",
    ],
    ids=["bytearray-past-int64", "bytes-of-4-eib"],
)
def test_a_pickle_asking_for_more_memory_than_there_is_is_named(tmp_path: Path, raw: bytes) -> None:
    # Unchecked, the OverflowError and the MemoryError get out.
    bad = write_changed(tmp_path / "in", lambda doc: None, pickled=True)
    bad.write_bytes(raw)
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == ENTRIES
    assert dict(rep.problems)[str(bad)].startswith("truncated or corrupt pickle")


def test_json_nested_too_deeply_is_named_and_the_other_dump_imported(tmp_path: Path) -> None:
    # Read unchecked, this raises RecursionError.
    bad = write_changed(tmp_path / "in", lambda doc: None)
    bad.write_text('{"entries": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == ENTRIES
    assert dict(rep.problems)[str(bad)] == "JSON nested too deeply to read; left out"


def test_a_gzip_dump_cut_short_is_named_and_the_other_dump_imported(tmp_path: Path) -> None:
    # Read unchecked, this raises EOFError out of the gzip stream.
    bad = write_changed(tmp_path / "in", lambda doc: None)
    packed = gzip.compress(bad.read_bytes())
    bad.unlink()
    cut = bad.with_name(bad.name + ".gz")
    cut.write_bytes(packed[: len(packed) // 2])
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    assert rep.colls == ENTRIES
    assert dict(rep.problems)[str(cut)].startswith("cannot be read (gzip data cut short")


HOSTILE = (None, True, -1, 0, 2**63, 2**64, 1e20, float("inf"), "", "7", [], {}, [[1]])
"""Values put in place of an entry's own by the seeded test."""


@pytest.mark.parametrize("seed", range(4))
def test_seeded_hostile_values_never_raise_and_keep_every_other_entry(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    for case in range(10):
        key = rng.choice(sorted(entry(1, 5)))
        value = rng.choice(HOSTILE)
        rep, why = import_changed(tmp_path / str(case), in_entry(key, value))
        # Either the entry is left out and named, or it is still good (a field unused).
        left_out = rep.colls == 2 * ENTRIES - 1 and why.endswith("left out")
        assert left_out or (rep.colls == 2 * ENTRIES and why == ""), (key, value, why)
