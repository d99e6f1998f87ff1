"""nccl-tests import: an ``all_reduce_perf`` text table in nccl-tests' own layout (header,
rank lines, out-of-place and in-place columns, MPI prefixes) becomes a recording whose
curves carry the table's busbw per message size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rankscope.hub.importers import write_recording

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
