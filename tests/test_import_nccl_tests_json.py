"""nccl-tests ``-J`` JSON import: a file in the layout ``src/util.cu`` writes (version 2:
``config.devices`` one entry per process, ``results`` rows with ``out_of_place`` /
``in_place`` objects, ``%lf`` numbers) gives the same recording figures as the equivalent
text table; JSON or text is told by content; a file cut short keeps its complete rows; a
bad file is one problem naming it; values of the wrong type or that cannot be are left out
and named, the rest imported."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rankscope.commands.grammar import load_run
from rankscope.diagnosis.curves import message_curves
from rankscope.hub import replay
from rankscope.hub.importers import ImportReport, write_recording
from rankscope.hub.recording import ReadReport

SIZES = [1024, 4096, 16384, 65536, 262144, 1048576, 4194304]
# Times exact to two decimals, so the text table (%7.2f) and the JSON (%lf) say the same.
TIME_US = {s: round(20.0 + s / 2000.0, 2) for s in SIZES}
HOSTS = ["sw53", "sw54"]  # two processes of two GPUs each: 4 ranks
NGPUS = 2
N = NGPUS * len(HOSTS)


def _bw(s: int, t: float) -> tuple[float, float]:
    alg = s / t / 1e3
    return alg, alg * 2 * (N - 1) / N


def text_table() -> str:
    out = [
        "# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703",
        "# Collective test starting: all_reduce_perf",
        "# nThread 1 nGpus 2 minBytes 1024 maxBytes 4194304 step: 4(factor) warmup iters: 1 "
        "iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    for p, h in enumerate(HOSTS):
        for g in range(NGPUS):
            r = p * NGPUS + g
            out.append(
                f"#  Rank {r:2} Group  0 Pid {1000 + p:6} on {h:>10} device {g:2} [0000:1b:00] H100"
            )
    out += [
        "#",
        "#                                                       out-of-place                       in-place          ",
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong ",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         ",
    ]
    for s in SIZES:
        t = TIME_US[s]
        ti = round(t * 1.5, 2)
        a, b = _bw(s, t)
        ai, bi = _bw(s, ti)
        out.append(
            f"{s:12}  {s // 4:12}  {'float':>8}  {'sum':>6}  {-1:6}  {t:7.2f}  {a:6.2f}  {b:6.2f}"
            f"  {0:6}  {ti:7.2f}  {ai:6.2f}  {bi:6.2f}  {0:6}"
        )
    out += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 3.21 ", "#", ""]
    return "\n".join(out)


def _place(t: float, s: int) -> str:
    a, b = _bw(s, t)
    return f'{{"time":{t:f},"alg_bw":{a:f},"bus_bw":{b:f},"nwrong":{0.0:f}}}'


def json_doc(*, cpu_time: bool = False, null_oop_at: int | None = None) -> str:
    """The -J file of the same run, written the way util.cu's writer writes it: compact,
    keys in its order, doubles as %lf, booleans as strings."""
    head = (
        '{"version":2,"start_time":"2026-12-03 16:00:00",'
        '"args":["./build/all_reduce_perf","-b","1K","-e","4M","-f","4","-g","2",'
        '"-J","out.json"],"env":["NCCL_DEBUG=WARN"],"nccl_version":22703,'
        '"config":{"nthreads":1,"ngpus":2,"minimum_bytes":1024,"maximum_bytes":4194304,'
        '"step_factor":4,"warmup_iters":1,"iterations":20,"aggregated_iterations":1,'
        '"validation":1,"graph":0,"blocking_collectives":"false","per_iter_timing":"false",'
        '"parallel_init":"false","devices":['
        + ",".join(
            f'{{"rank":{p * NGPUS},"group":0,"pid":{1000 + p},"hostname":"{h}","device":0,'
            f'"device_hex":"0000:1b:00","device_info":"H100"}}'
            for p, h in enumerate(HOSTS)
        )
        + "]},"
        '"results":['
    )
    rows = []
    for k, s in enumerate(SIZES):
        t = TIME_US[s]
        oop = "null" if k == null_oop_at else _place(t, s)
        inp = _place(round(t * 1.5, 2), s)
        if cpu_time:
            oop, inp = oop.replace('"time"', '"cpu_time"'), inp.replace('"time"', '"cpu_time"')
        rows.append(
            f'{{"size":{s},"count":{s // 4},"type":"float","redop":"sum","root":"    -1",'
            f'"out_of_place":{oop},"in_place":{inp},'
            f'"actual_iterations":20,"experiment_name":""}}'
        )
    tail = (
        '],"out_of_bounds":{"count":0,"okay":"true"},'
        '"average_bus_bandwidth":{"bandwidth":3.210000,"okay":"unchecked"},'
        '"errors":[],"end_time":"2026-12-03 16:00:05"}'
    )
    return head + ",".join(rows) + tail


def _curve(rec: Path) -> dict[tuple[str, int], tuple[float, float, int]]:
    _, w = load_run(str(rec), None, 100)
    c = message_curves(w.instances)
    return {
        (w.groups[int(c.group[i])].name, int(c.bucket[i])): (
            float(c.busbw_gbps[i]),
            float(c.nbytes[i]),
            int(c.count[i]),
        )
        for i in range(len(c))
    }


def test_json_gives_the_figures_of_the_text_table(tmp_path: Path) -> None:
    txt = tmp_path / "all_reduce_perf.txt"
    txt.write_text(text_table())
    # Named .log and .out: the kind is told by content, not by the name.
    js = tmp_path / "run.out"
    js.write_text(json_doc())
    rep_t = write_recording("nccl-tests", [txt], tmp_path / "t", run="t")
    rep_j = write_recording("nccl-tests", [js], tmp_path / "j", run="j")
    assert rep_t.problems == [] and rep_j.problems == []
    assert rep_j.ranks == rep_t.ranks == N
    assert rep_j.colls == rep_t.colls == N * 2 * len(SIZES)
    dt, dj = rep_t.details["nccl_tests"][0], rep_j.details["nccl_tests"][0]
    assert dj["op"] == dt["op"] == "all_reduce" and dj["ranks"] == dt["ranks"] == N
    assert dj["avg_busbw_gbps"] == dt["avg_busbw_gbps"] == 3.21
    for pt, pj in zip(dt["points"], dj["points"], strict=True):
        assert pt["size"] == pj["size"]
        for side in ("out_of_place", "in_place"):
            assert pt[side]["time_us"] == pj[side]["time_us"]
            for key in ("algbw_gbps", "busbw_gbps"):  # text: 2 decimals, JSON: 6
                assert abs(pt[side][key] - pj[side][key]) <= 0.006
    ct, cj = _curve(tmp_path / "t"), _curve(tmp_path / "j")
    assert ct.keys() == cj.keys() and len(ct) == 2 * len(SIZES)
    for key, (bw, nb, count) in ct.items():
        assert cj[key] == (bw, nb, count)
    # And they are nccl-tests' own numbers: busbw = S/t * 2(n-1)/n.
    for s in SIZES:
        want = _bw(s, TIME_US[s])[1]
        got = cj[("nccl-tests out-of-place", s.bit_length() - 1)][0]
        assert abs(got - want) / want < 1e-6
    _, w = load_run(str(tmp_path / "j"), None, 100)
    assert list(w.ranks.hosts) == HOSTS


def test_cpu_time_null_placement_truncated_and_bad_files(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json_doc(cpu_time=True, null_oop_at=0))
    full = json_doc()
    cut = tmp_path / "cut.json"
    # Killed while writing the fifth row: the four before it are complete.
    at = full.index(f'{{"size":{SIZES[4]}') + 30
    cut.write_text(full[:at])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": []}))
    broken = tmp_path / "broken.json"
    broken.write_text('{"version":2,"config":')
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{ not json at all }")
    files = [cpu, cut, other, broken, garbage]
    rep = write_recording("nccl-tests", files, tmp_path / "rec", run="r")
    why = dict(rep.problems)
    assert set(rep.files_read) == {str(cpu), str(cut)}
    assert "cut short" in why[str(cut)] and "4 complete size row(s)" in why[str(cut)]
    assert "not nccl-tests -J output" in why[str(other)]
    assert "cut short before its first complete size row" in why[str(broken)]
    assert "is not JSON" in why[str(garbage)]
    assert len(rep.problems) == 4  # one line per bad file
    assert str(cpu) not in why
    by_file = {d["file"]: d for d in rep.details["nccl_tests"]}
    pts = by_file["cpu.json"]["points"]
    assert pts[0]["out_of_place"]["time_us"] != pts[0]["out_of_place"]["time_us"]  # NaN: not run
    assert pts[1]["out_of_place"]["time_us"] == TIME_US[SIZES[1]]
    assert [p["size"] for p in by_file["cut.json"]["points"]] == SIZES[:4]
    # The size row without an out-of-place time gives its in-place instance only.
    assert rep.colls == N * ((2 * len(SIZES) - 1) + 2 * 4)


# -- hostile files: what cannot be is left out and named, the rest imported --------------


def refused(rec: Path) -> list[str]:
    """What the hub refuses when it replays ``rec`` (each refused record's reason)."""
    read = ReadReport()
    replay.load(rec, report=read)
    return [s.detail for s in read.skipped]


def import_changed(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any]
) -> tuple[ImportReport, str]:
    """Import `json_doc` changed in place by ``change`` (written back with Python's JSON
    writer: inf as Infinity); the report and its problem lines. What was imported must
    replay whole."""
    doc = json.loads(json_doc())
    change(doc)
    tmp_path.mkdir(exist_ok=True)
    f = tmp_path / "all_reduce.json"
    f.write_text(json.dumps(doc))
    rep = write_recording("nccl-tests", [f], tmp_path / "rec", run="r")
    assert refused(tmp_path / "rec") == []
    return rep, "; ".join(what for _, what in rep.problems)


def in_row(key: str, value: Any, *, at: int = 2) -> Callable[[dict[str, Any]], None]:
    """A change putting ``value`` at ``key`` of result row ``at``."""

    def change(doc: dict[str, Any]) -> None:
        doc["results"][at][key] = value

    return change


def in_time(value: Any) -> Callable[[dict[str, Any]], None]:
    """A change putting ``value`` as the out-of-place time of result row 2."""

    def change(doc: dict[str, Any]) -> None:
        doc["results"][2]["out_of_place"]["time"] = value

    return change


@pytest.mark.parametrize(
    "size", [2**64, float("inf"), -5, True], ids=["2**64", "inf", "-5", "true"]
)
def test_a_result_row_whose_size_is_not_a_byte_count_is_skipped_and_named(
    tmp_path: Path, size: Any
) -> None:
    # Read unchecked, 2**64 and Infinity raise OverflowError, -5 makes a row the replay
    # refuses with every other, and true reads as 1 byte.
    rep, why = import_changed(tmp_path, in_row("size", size))
    assert why == "1 result row(s) whose size is not an integer in 0..2**62 left out"
    assert rep.colls == N * 2 * (len(SIZES) - 1)


@pytest.mark.parametrize(
    "time", [1e308, float("inf"), -3.0, 1e12], ids=["1e308", "inf", "-3", "1e12"]
)
def test_a_result_time_that_cannot_be_is_skipped_and_named(tmp_path: Path, time: float) -> None:
    # Read unchecked, 1e308 raises OverflowError, inf and -3 pass unsaid, and 1e12 µs
    # (11 days) makes a step the replay refuses with every other step.
    rep, why = import_changed(tmp_path, in_time(time))
    assert why == "1 time(s) that are zero, negative, infinite or over 3.5 days left out"
    assert rep.colls == N * (2 * len(SIZES) - 1)


def _config(**values: Any) -> Callable[[dict[str, Any]], None]:
    """A change setting ``values`` in ``config``."""

    def change(doc: dict[str, Any]) -> None:
        doc["config"].update(values)

    return change


def _first_device(**values: Any) -> Callable[[dict[str, Any]], None]:
    """A change setting ``values`` in the first of ``config.devices``."""

    def change(doc: dict[str, Any]) -> None:
        doc["config"]["devices"][0].update(values)

    return change


@pytest.mark.parametrize(
    ("change", "ranks", "named"),
    [
        (_config(nthreads=float("inf")), 2, "config nthreads x ngpus is not a rank count"),
        (_config(ngpus=2**31), 2, "config nthreads x ngpus is not a rank count"),
        (_config(nthreads=70_000), 2, "config devices hold more than 131072 ranks"),
        (_config(devices=5), 1, "config devices is not a list; hosts unknown"),
        (_first_device(rank=float("inf")), N, "1 config device(s) whose rank is not"),
    ],
    ids=["inf-threads", "2**31-gpus", "past-world", "number-devices", "inf-rank"],
)
def test_config_values_that_are_not_rank_counts_are_named_and_the_results_imported(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], ranks: int, named: str
) -> None:
    # Read unchecked, Infinity raises OverflowError, a number of devices TypeError, and
    # 2**31 GPUs run a loop of 2**32 hosts.
    rep, why = import_changed(tmp_path, change)
    assert rep.ranks == ranks and rep.colls == ranks * 2 * len(SIZES)
    assert why.startswith(named)


def test_json_nested_too_deeply_is_named_not_a_traceback(tmp_path: Path) -> None:
    # Read unchecked, this raises RecursionError.
    f = tmp_path / "deep.json"
    f.write_text('{"results": ' + "[" * 100_000 + "]" * 100_000 + "}")
    good = tmp_path / "all_reduce.json"
    good.write_text(json_doc())
    rep = write_recording("nccl-tests", [f, good], tmp_path / "rec", run="r")
    assert rep.files_read == [str(good)] and rep.colls == N * 2 * len(SIZES)
    assert dict(rep.problems)[str(f)].startswith("is not JSON (maximum recursion depth")


HOSTILE = (None, True, -1, 0, 2**63, 2**64, 1e20, float("inf"), "", "7", [], {}, [1])
"""Values put in place of a result row's own by the seeded test."""


@pytest.mark.parametrize("seed", range(4))
def test_seeded_hostile_values_never_raise_and_keep_every_other_row(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    row = json.loads(json_doc())["results"][2]
    leaves = [(k,) for k in row] + [(k, j) for k in ("out_of_place", "in_place") for j in row[k]]
    for case in range(8):
        leaf, value = rng.choice(leaves), rng.choice(HOSTILE)

        def change(doc: dict[str, Any], leaf: tuple[str, ...] = leaf, value: Any = value) -> None:
            at = doc["results"][2]
            for key in leaf[:-1]:
                at = at[key]
            at[leaf[-1]] = value

        rep, why = import_changed(tmp_path / str(case), change)
        # The row is left out, a placement of it is, or the value is one the import
        # does not use; whatever was left out is named.
        assert N * 2 * (len(SIZES) - 1) <= rep.colls <= N * 2 * len(SIZES), (leaf, value)
        assert (rep.colls == N * 2 * len(SIZES)) == (why == ""), (leaf, value, why)
