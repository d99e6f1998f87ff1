"""nccl-tests import: an ``all_reduce_perf`` text table in nccl-tests' own layout (header,
rank lines, out-of-place and in-place columns, MPI prefixes) becomes a recording whose
curves carry the table's busbw per message size; numbers and lines that cannot be are left
out and named, the rest imported."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rankscope.hub import replay
from rankscope.hub.importers import ImportReport, write_recording
from rankscope.hub.recording import ReadReport

HEAD = """\
# nThread 1 nGpus 1 minBytes 1024 maxBytes 1048576 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  58680 on       sw53 device  0 [0xb1] Tesla V100-PCIE-32GB
#  Rank  1 Group  0 Pid 928295 on       sw54 device  0 [0xb1] Tesla V100-PCIE-32GB
#
#                                                              out-of-place                       in-place~~~~~~~~~~
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)~~~~~~~
"""
# nccl-tests pads these two header lines with trailing spaces ("~" here).
HEAD = HEAD.replace("~", " ")
SIZES = [1024, 4096, 16384, 65536, 262144, 1048576]
TIME_US = {s: 20.0 + s / 2000.0 for s in SIZES}


def table(prefix: str = "") -> str:
    out = [prefix + line for line in HEAD.splitlines()]
    for s in SIZES:
        t = TIME_US[s]
        alg = s / t / 1e3
        bus = alg * 2 * (2 - 1) / 2
        out.append(
            f"{prefix}{s:>12}{s // 4:>14}{'float':>10}{'sum':>8}{-1:>8}"
            f"{t:>9.2f}{alg:>8.2f}{bus:>8.2f}{0:>7}{t * 1.01:>9.2f}{alg / 1.01:>8.2f}{bus / 1.01:>8.2f}{0:>7}"
        )
    out.append(prefix + "# Out of bounds values : 0 OK")
    out.append(prefix + "# Avg bus bandwidth    : 9.876 ")
    out.append(prefix + "#")
    return "\n".join(out) + "\n"


def test_all_reduce_table_becomes_the_recordings_curve(tmp_path: Path) -> None:
    f = tmp_path / "all_reduce_perf.txt"
    f.write_text(table("[1,0]<stdout>:"))
    bad = tmp_path / "broken_perf.txt"
    bad.write_text("# nothing here\n  1024  256  float\n")
    rep = write_recording("nccl-tests", [f, bad], tmp_path / "rec", run="r")
    assert rep.files_read == [str(f)]
    why = [w for p, w in rep.problems if p == str(bad)]
    assert any("do not parse" in w for w in why) and any("no nccl-tests size row" in w for w in why)
    assert rep.ranks == 2 and rep.colls == 2 * 2 * len(SIZES)
    pts = rep.details["nccl_tests"][0]["points"]
    assert [p["size"] for p in pts] == SIZES
    assert rep.details["nccl_tests"][0]["avg_busbw_gbps"] == 9.876
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankscope",
            "diagnose",
            str(tmp_path / "rec"),
            "--json",
            "--steps",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    curves = json.loads(res.stdout)["curves"]["points"]
    oop = {p["nbytes"]: p for p in curves if p["group"] == "nccl-tests out-of-place"}
    inp = {p["nbytes"]: p for p in curves if p["group"] == "nccl-tests in-place"}
    assert sorted(oop) == SIZES and sorted(inp) == SIZES
    for s in SIZES:
        want = s / TIME_US[s] / 1e3  # busbw = algbw for a 2-rank all-reduce
        assert abs(oop[s]["busbw_gbps"] - want) / want < 0.01
        assert abs(inp[s]["busbw_gbps"] - want / 1.01) / want < 0.01
        assert oop[s]["op"] == "all_reduce"


# -- hostile tables: what cannot be is left out and named, the rest imported -------------


def table_with(token: str, *, column: int, size: int = SIZES[2]) -> str:
    """`table` with ``column`` of the row of ``size`` replaced by ``token``."""
    lines = table().splitlines()
    for i, line in enumerate(lines):
        tok = line.split()
        if tok and tok[0] == str(size):
            tok[column] = token
            lines[i] = " ".join(tok)
    return "\n".join(lines) + "\n"


def refused(rec: Path) -> list[str]:
    """What the hub refuses when it replays ``rec`` (each refused record's reason)."""
    read = ReadReport()
    replay.load(rec, report=read)
    return [s.detail for s in read.skipped]


def imported(tmp_path: Path, text: str) -> tuple[ImportReport, str]:
    """Import ``text`` as ``all_reduce_perf.txt``; the report and its problem lines. What
    was imported must replay whole."""
    f = tmp_path / "all_reduce_perf.txt"
    f.write_text(text)
    rep = write_recording("nccl-tests", [f], tmp_path / "rec", run="r")
    assert rep.ranks == 2 and refused(tmp_path / "rec") == []
    return rep, "; ".join(what for _, what in rep.problems)


def test_a_size_row_whose_size_is_past_int64_is_skipped_and_named(tmp_path: Path) -> None:
    # Read unchecked, this raises OverflowError building its int64 rows.
    rep, why = imported(tmp_path, table_with("99999999999999999999999", column=0))
    assert why == "1 table row(s) whose size is not an integer in 0..2**62 left out"
    assert rep.colls == 2 * 2 * (len(SIZES) - 1)


@pytest.mark.parametrize("token", ["1e308", "inf", "-5", "0", "1e12"])
def test_a_time_that_is_infinite_negative_zero_or_weeks_is_skipped_and_named(
    tmp_path: Path, token: str
) -> None:
    # Read unchecked, 1e308 raises OverflowError, inf, 0 and -5 pass unsaid, and 1e12 µs
    # (11 days) makes a step the replay refuses with every other step.
    rep, why = imported(tmp_path, table_with(token, column=5))
    assert why == "1 time(s) that are zero, negative, infinite or over 3.5 days left out"
    assert rep.colls == 2 * (2 * len(SIZES) - 1)


def test_a_rank_line_of_5000_digits_is_named_and_the_table_imported(tmp_path: Path) -> None:
    # Python will not read an integer of 5000 digits from text: int() raises.
    text = table().replace("#  Rank  1 Group", "#  Rank " + "9" * 5000 + " Group")
    f = tmp_path / "all_reduce_perf.txt"
    f.write_text(text)
    rep = write_recording("nccl-tests", [f], tmp_path / "rec", run="r")
    assert rep.problems == [(str(f), "1 rank line(s) naming a rank over 131071 left out")]
    assert rep.ranks == 1 and rep.colls == 2 * len(SIZES)


BROKEN_MEMBER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff\x07"
"""A gzip member whose deflate data opens with a reserved block type (zlib: "invalid block
type")."""


@pytest.mark.parametrize("broken", ["cut", "corrupt"])
def test_a_gzip_table_cut_short_or_corrupt_keeps_the_rows_before(
    tmp_path: Path, broken: str
) -> None:
    # Read unchecked, this raises EOFError or zlib.error out of the gzip stream once past the
    # first 4 KiB.
    padding = "".join(f"# {i:08x} {i * 2654435761 % 2**32:08x}\n" for i in range(3000))
    packed = gzip.compress((table() + padding).encode())
    f = tmp_path / "all_reduce_perf.txt.gz"
    if broken == "cut":
        f.write_bytes(packed[: len(packed) * 2 // 3])
    else:
        f.write_bytes(packed + BROKEN_MEMBER)
    rep = write_recording("nccl-tests", [f], tmp_path / "rec", run="r")
    assert rep.colls == 2 * 2 * len(SIZES)
    (why,) = [what for _, what in rep.problems]
    assert why.startswith("cannot be read to its end (gzip data cut short or corrupt")
    assert why.endswith(f"the {len(SIZES)} size row(s) before imported")
