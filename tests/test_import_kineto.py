"""The Kineto importer on real traces (tests/data/kineto, from HolisticTraceAnalysis' own
test data), checked against HolisticTraceAnalysis where it is installed and against the
raw JSON everywhere."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.hub.importers import ImportReport, kineto, write_recording
from rankscope.hub.recording import read_frames, read_meta

DATA = Path(__file__).parent / "data" / "kineto"
PAIR = ["sampled_rank-0.json.gz", "sampled_rank-1.json.gz"]
NCCL = "nccl_data.json.gz"


def _messages(rec: Path) -> list[schema.Message]:
    return [schema.decode(f.payload) for f in read_frames(rec)]


def _colls(msgs: list[schema.Message], rank: int) -> dict[str, np.ndarray]:
    parts = [m.tables["colls"] for m in msgs if m.kind == "steps" and m.header["rank"] == rank]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    rec = tmp_path_factory.mktemp("pair") / "rec"
    write_recording("kineto", [DATA / f for f in PAIR], rec, job="dlrm", run="pair")
    return rec


@pytest.fixture(scope="module")
def nccl(tmp_path_factory) -> Path:
    rec = tmp_path_factory.mktemp("nccl") / "rec"
    write_recording("kineto", [DATA / NCCL], rec, job="resnet", run="r")
    return rec


def _hta_frames(names: list[str], tmp: Path):
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis not installed")
    for n in names:
        shutil.copy(DATA / n, tmp / n)
    logging.getLogger("hta").setLevel(logging.ERROR)
    ta = hta.TraceAnalysis(trace_dir=str(tmp))
    return ta.get_temporal_breakdown(visualize=False), ta.get_comm_comp_overlap(visualize=False)


@pytest.mark.parametrize("names", [PAIR, [NCCL]], ids=["sampled-pair", "nccl-metadata"])
def test_temporal_breakdown_and_overlap_agree_with_hta(names, tmp_path: Path) -> None:
    tb, ov = _hta_frames(names, tmp_path)
    for n in names:
        tr = kineto.parse_file(DATA / n, ImportReport())
        assert tr is not None
        ours = kineto.hta_breakdown(tr)
        row = tb[tb["rank"] == tr.rank].iloc[0]
        window_us = ours["window"] / 1e3
        assert abs(window_us - row["kernel_time(us)"]) <= 0.01 * window_us
        for mine, theirs in (
            ("idle", "idle_time(us)"),
            ("compute", "compute_time(us)"),
            ("non_compute", "non_compute_time(us)"),
        ):
            assert abs(ours[mine] / 1e3 - row[theirs]) <= 0.01 * window_us, (n, mine)
        overlap = ours["overlap"] / ours["communication"]
        theirs_ov = ov[ov["rank"] == tr.rank].iloc[0]["comp_comm_overlap_pctg"] / 100
        assert abs(overlap - theirs_ov) <= 0.01, n


def test_breakdown_categories_sum_to_each_step(pair: Path) -> None:
    source = read_meta(pair)["sessions"][-1]["source"]
    per_rank = source["gpu_breakdown"]
    assert sorted(per_rank) == ["0", "1"]
    for steps in per_rank.values():
        assert [s["step"] for s in steps] == [551, 552]
        for s in steps:
            assert s["idle"] + s["compute"] + s["non_compute"] == s["window"]
            assert s["communication"] > 0 and s["compute"] > 0
            assert s["overlap"] <= min(s["communication"], s["compute"])
    # Each rank's GPU time per step is taken from its own parsed trace (which the import
    # then lets go of): the same as the trace's breakdown read afresh.
    for name in PAIR:
        tr = kineto.parse_file(DATA / name, ImportReport())
        assert tr is not None
        assert per_rank[str(tr.info["rank"])] == kineto.step_breakdown(tr)


def _kernel_starts(name: str, stream: int) -> list[int]:
    ev = json.loads(gzip.decompress((DATA / name).read_bytes()))["traceEvents"]
    return sorted(
        round(e["ts"] * 1000)
        for e in ev
        if e.get("cat") == "kernel"
        and e["name"].startswith("nccl")
        and e["args"].get("stream") == stream
    )


def test_the_pair_keeps_rank_steps_and_the_late_rank_of_each_matched_collective(
    pair: Path,
) -> None:
    msgs = _messages(pair)
    hellos = {m.header["rank"]: m.header for m in msgs if m.kind == "hello"}
    assert sorted(hellos) == [0, 1]
    assert hellos[0]["identity"]["world_size"] == 128
    assert hellos[0]["manifest"]["source"]["kind"] == "kineto"
    groups = next(m for m in msgs if m.kind == "groups").header["groups"]
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"stream84", "stream203"}
    assert by_name["stream203"]["ranks"] == [0, 1]  # no metadata: the imported ranks
    # Stream 203's two SendRecv kernels are the same instances on both ranks (the trace
    # was sampled: stream 84 lost some kernels on one rank and not the other).
    late_in_trace = [
        int(np.argmax([a, b]))
        for a, b in zip(_kernel_starts(PAIR[0], 203), _kernel_starts(PAIR[1], 203))
    ]
    gid = by_name["stream203"]["id"]
    c0, c1 = _colls(msgs, 0), _colls(msgs, 1)
    e0 = c0["t_enter"][c0["group"] == gid]
    e1 = c1["t_enter"][c1["group"] == gid]
    assert [int(np.argmax([a, b])) for a, b in zip(e0, e1)] == late_in_trace == [1, 1]
    assert (c0["flags"] & schema.FLAG_DEVICE_TIMED).all()
    assert set(c0["step"].tolist()) == {551, 552}


def test_diagnose_names_the_rank_the_trace_shows_arriving_last(pair: Path, capsys) -> None:
    assert main(["diagnose", str(pair), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    arrivers = out["critical_path"]["last_arrivers"]
    assert arrivers[0]["rank"] == 1
    assert out["critical_path"]["complete"] == 10
    # The alignment residual (mismatched sampled instances) is reported, not hidden.
    assert out["critical_path"]["clock_error_ns"] > 0


def test_comm_metadata_gives_ops_bytes_groups_and_phases(nccl: Path) -> None:
    msgs = _messages(nccl)
    groups = next(m for m in msgs if m.kind == "groups").header["groups"]
    assert [(g["name"], g["ranks"], g["desc"]) for g in groups] == [("pg0", [0, 1], "default_pg")]
    co = _colls(msgs, 0)
    ops = [schema.OPS[o] for o in co["op"]]
    assert ops.count("all_reduce") == 15 and ops.count("broadcast") == 6
    raw = json.loads(gzip.decompress((DATA / NCCL).read_bytes()))
    base = raw["baseTimeNanoseconds"]
    kernels = sorted(
        (e for e in raw["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"]),
        key=lambda e: e["ts"],
    )
    first = kernels[0]
    size = {"Float": 4}.get(first["args"]["dtype"], 1)
    assert co["nbytes"][0] == first["args"]["In msg nelems"] * size
    assert co["t_start"][0] == base + round(first["ts"] * 1000)
    assert (co["seq"] == np.arange(21)).all()
    names = schema.PHASES
    phases = [m.tables["phases"] for m in msgs if m.kind == "steps"]
    codes = np.concatenate([p["phase"] for p in phases])
    steps = np.concatenate([p["step"] for p in phases])
    for step in (4, 5, 6):
        got = {names[c] for c in codes[steps == step]}
        assert {"forward", "backward", "optimizer"} <= got, (step, got)


def test_cpu_only_and_plain_json_import(tmp_path: Path) -> None:
    plain = tmp_path / "rank-34.json"
    plain.write_bytes(
        gzip.decompress((DATA / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz").read_bytes())
    )
    rep = write_recording("kineto", [plain], tmp_path / "rec")
    msgs = _messages(tmp_path / "rec")
    hello = next(m for m in msgs if m.kind == "hello").header
    assert (hello["rank"], hello["identity"]["world_size"]) == (34, 300)
    assert "NCCL kernels (collectives have host times only)" in rep.lacks
    assert rep.steps >= 1


def test_the_same_trace_gzipped_or_not_imports_the_same(tmp_path: Path) -> None:
    plain = tmp_path / "sampled_rank-0.json"
    plain.write_bytes(gzip.decompress((DATA / PAIR[0]).read_bytes()))
    write_recording("kineto", [plain], tmp_path / "a", run="x")
    write_recording("kineto", [DATA / PAIR[0]], tmp_path / "b", run="x")

    def body(rec: Path) -> list:
        out = []
        for m in _messages(rec):
            h = {k: v for k, v in m.header.items() if k != "manifest"}
            h.pop("identity", None)
            out.append(
                (
                    m.kind,
                    sorted(h),
                    {t: {c: a.tobytes() for c, a in cols.items()} for t, cols in m.tables.items()},
                )
            )
        return out

    assert body(tmp_path / "a") == body(tmp_path / "b")


def test_an_imported_pair_exports_as_one_perfetto_timeline(pair: Path, tmp_path: Path) -> None:
    """Both ranks on one clock in one trace, a track each; loaded by Perfetto's own trace
    processor where its binary can run (``RANKSCOPE_TRACE_PROCESSOR`` names a local one)."""
    import os
    import subprocess

    out = tmp_path / "t.json"
    assert main(["export", str(pair), "--perfetto", str(out)]) == 0
    doc = json.loads(out.read_text())
    evs = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e.get("name") == "thread_name"}
    assert {"rank 0", "rank 1"} <= set(names.values())
    msgs = _messages(pair)
    t0 = min(int(m.tables["steps"]["t_start"].min()) for m in msgs if m.kind == "steps")
    # Stream 203's first instance: each rank's slice starts at its own kernel start, on
    # the one timeline (a shared origin), so the two overlap as they did on the GPUs.
    starts = [_kernel_starts(f, 203)[0] for f in PAIR]
    colls = [
        e for e in evs if e.get("ph") == "X" and e.get("args", {}).get("group_name") == "stream203"
    ]
    by_rank: dict[str, list[float]] = {}
    for e in colls:
        by_rank.setdefault(f"rank {e['args']['rank']}", []).append(e["ts"])
    origin = doc["otherData"]["t0_ns"]
    assert origin == t0
    for r, start in enumerate(starts):
        assert min(by_rank[f"rank {r}"]) == pytest.approx((start - origin) / 1e3, abs=1e-3)
    tp_mod = pytest.importorskip("perfetto.trace_processor", reason="perfetto not installed")
    config = tp_mod.TraceProcessorConfig(bin_path=os.environ.get("RANKSCOPE_TRACE_PROCESSOR"))
    try:
        tp = tp_mod.TraceProcessor(trace=str(out), config=config)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(
            "perfetto's trace_processor_shell is downloaded on first use and this machine "
            f"cannot fetch it ({type(exc).__name__}); set RANKSCOPE_TRACE_PROCESSOR to a local "
            "binary to run this check"
        )
    try:
        threads = {row.name for row in tp.query("select name from thread where name is not null")}
    finally:
        tp.close()
    assert {"rank 0", "rank 1"} <= threads


def test_the_chunked_fast_path_and_the_ijson_stream_read_the_same(monkeypatch) -> None:
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 64 << 10)  # many chunks even in a small file
    fast = kineto.parse_file(DATA / NCCL, ImportReport())
    # The fast path does read this file (it raises rather than fall back when called alone).
    from rankscope.hub.importers import open_binary

    with open_binary(DATA / NCCL) as f:
        fast_events = sum(
            b.unparsed + len(b.events) for b in kineto._fast_events(kineto._EdgeReader(f))
        )
    monkeypatch.setattr(kineto, "_orjson", lambda: None)
    slow = kineto.parse_file(DATA / NCCL, ImportReport())
    assert fast is not None and slow is not None
    assert fast_events == fast.events == slow.events > 10_000
    for name in ("dev_t0", "dev_t1", "dev_cls", "dev_corr", "launch_corr", "launch_t0", "bwd"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert (fast.steps, fast.spans, fast.comm) == (slow.steps, slow.spans, slow.comm)
    assert (fast.rank, fast.world_size, fast.info) == (slow.rank, slow.world_size, slow.info)


def test_traces_of_two_hosts_export_as_two_host_processes_on_one_clock(tmp_path: Path) -> None:
    # The names tensorboard_trace_handler writes: {hostname}_{pid}.{time}.pt.trace.json.gz
    names = ["node-a_4037.1682725898.pt.trace.json.gz", "node-b_4100.1682725898.pt.trace.json.gz"]
    for src, dst in zip(PAIR, names):
        shutil.copy(DATA / src, tmp_path / dst)
    rec = tmp_path / "rec"
    write_recording("kineto", [tmp_path / n for n in names], rec, run="two-hosts")
    hellos = [m.header for m in _messages(rec) if m.kind == "hello"]
    assert [(h["identity"]["host"], h["identity"]["pid"]) for h in hellos] == [
        ("node-a", 4037),
        ("node-b", 4100),
    ]
    out = tmp_path / "t.json"
    assert main(["export", str(rec), "--perfetto", str(out)]) == 0
    evs = json.loads(out.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("name") == "process_name"}
    threads = {
        e["tid"]: (procs[e["pid"]], e["args"]["name"])
        for e in evs
        if e.get("name") == "thread_name"
    }
    assert ("node-a", "rank 0") in threads.values() and ("node-b", "rank 1") in threads.values()
    # One timeline: the ranks' steps start where the traces say, from one origin.
    steps = sorted((e["args"]["rank"], e["ts"]) for e in evs if e.get("cat") == "step")
    raw = [json.loads(gzip.decompress((DATA / f).read_bytes()))["traceEvents"] for f in PAIR]
    first = [min(e["ts"] for e in ev if e.get("name", "").startswith("ProfilerStep")) for ev in raw]
    assert steps[0][1] == 0.0
    r1 = min(ts for r, ts in steps if r == 1)
    assert r1 == pytest.approx(first[1] - first[0], abs=1e-3)


# The byte-level pre-filter of the fast path (kineto._prefilter) against the full parse.

_NAMES = [
    "aten::mm",
    "aten::foo}, {",
    "aten::bar},\n  {",
    'aten::q"uote',
    "aten::{",
    "aten::}",
    "ProfilerStep#3",
    "ProfilerStep#4 {}",
    "autograd::engine::evaluate_function: MmBackward0",
    "## forward ##",
    "## backward ##",
    "DistributedDataParallel.forward",
    "Optimizer.step#SGD.step",
    "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
    "record_param_comms",
    "c10d::allreduce_",
    "nccl:all_reduce",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    "ampere_sgemm_128x64_nn",
    "Memcpy HtoD (Pinned -> Device)",
    'void k<{1}>("x")',
    "naïve é",
    "ph",
    '"ph": "X"',
]
_META = {
    "Collective name": "allreduce",
    "In msg nelems": 1024,
    "dtype": "Float",
    "Process Group Name": "0",
    "Process Group Ranks": "[0, 1]",
}


def _random_events(rng: np.random.Generator, n: int, escapes: bool) -> list[dict]:
    """Events of every kind the importer reads or skips, interleaved at random; names and
    args with braces, quotes, separators and (``escapes``) newlines and escaped quotes."""
    names = [s for s in _NAMES if escapes or ('"' not in s and "\n" not in s)]
    cats = [
        "kernel",
        "gpu_memcpy",
        "gpu_memset",
        "cuda_runtime",
        "cuda_driver",
        "user_annotation",
        "cpu_op",
        "python_function",
        "gpu_user_annotation",
        "ac2g",
    ]
    out: list[dict] = []
    t = 1_700_000_000_000_000
    for i in range(n):
        t += int(rng.integers(1, 50))
        kind = rng.integers(0, 11)
        name = names[rng.integers(len(names))]
        if kind == 0:
            out.append(
                {"name": "process_name", "ph": "M", "ts": t, "pid": 1, "args": {"name": name}}
            )
        elif kind == 1:
            out.append(
                {
                    "ph": "sf"[i % 2],
                    "id": i,
                    "pid": 1,
                    "tid": 2,
                    "ts": t,
                    "cat": "ac2g",
                    "name": name,
                }
            )
        elif kind == 2:
            out.append({"name": name, "ph": "i", "s": "g", "pid": "", "tid": "", "ts": t})
        else:
            ts: int | float = t if kind % 2 else t + 0.125
            args: dict = {"External id": i, "correlation": i // 2, "stream": 7 + i % 3}
            if kind == 3:
                args.update(_META, Seq=i)
            if kind == 4:
                args["list"] = [{"a": "}"}, {"b": "{"}]
            if kind == 5:
                args["note"] = name
            if kind == 7:
                args["correlation"] = i + 0.5  # not an int: read as -1
            if kind == 8:
                del args["correlation"]
            ev = {"ph": "X", "cat": cats[rng.integers(len(cats))], "name": name, "pid": 1}
            ev.update({"tid": 2, "ts": ts, "dur": int(rng.integers(1, 40)), "args": args})
            if kind == 6:
                del ev["args"]
            out.append(ev)
    return out


def _kineto_layout(ev: dict, ascii_only: bool) -> str:
    """One event as libkineto's ChromeTraceLogger writes it (multi-line, indented)."""

    def dump(v: object) -> str:
        return json.dumps(v, ensure_ascii=ascii_only)

    top = ", ".join(f"{dump(k)}: {dump(v)}" for k, v in ev.items() if k != "args")
    text = "  {\n    " + top
    if "args" in ev:
        inner = ", ".join(f"{dump(k)}: {dump(v)}" for k, v in ev["args"].items())
        text += ',\n    "args": {\n      ' + inner + "\n    }"
    return text + "\n  }"


def _trace_text(events: list[dict], layout: str, extra: list[str] = ()) -> str:
    if layout == "kineto":
        body = ",\n".join([_kineto_layout(e, False) for e in events] + list(extra))
        return (
            '{\n  "schemaVersion": 1,\n  "traceEvents": [\n'
            + body
            + '\n  ],\n  "x": [{"a": 1},\n  {"b": 2}]\n}'
        )
    if layout == "line":
        body = ",\n".join([json.dumps(e, ensure_ascii=False) for e in events] + list(extra))
        return '{"traceEvents": [\n' + body + "\n]}"
    seps = (",", ":") if layout == "compact" else (", ", ": ")
    doc = {"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 1}}
    return json.dumps(doc, separators=seps, ensure_ascii=False)


def _same_trace(a: kineto.RankTrace, b: kineto.RankTrace) -> None:
    for name in ("dev_t0", "dev_t1", "dev_cls", "dev_corr", "launch_corr", "launch_t0", "bwd"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name in ("steps", "spans", "comm", "host_comm", "host_rows", "events", "info"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.has_bwd_annotation, a.rank, a.world_size) == (
        b.has_bwd_annotation,
        b.rank,
        b.world_size,
    )


def _three_ways(path: Path, monkeypatch) -> tuple[kineto.RankTrace, int]:
    """Parse ``path`` with the pre-filter, with whole chunks, and with ijson; all three
    must agree. Returns the trace and how many events the pre-filter left unparsed."""
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 4 << 10)
    from rankscope.hub.importers import open_binary

    with open_binary(path) as f:
        batches = list(kineto._fast_events(kineto._EdgeReader(f)))
    skipped = sum(b.unparsed for b in batches)
    pre = kineto.parse_file(path, ImportReport())
    with monkeypatch.context() as m:
        m.setattr(kineto, "_prefilter", lambda buf: None)
        whole = kineto.parse_file(path, ImportReport())
    with monkeypatch.context() as m:
        m.setattr(kineto, "_orjson", lambda: None)
        slow = kineto.parse_file(path, ImportReport())
    assert pre is not None and whole is not None and slow is not None
    _same_trace(pre, whole)
    _same_trace(pre, slow)
    assert sum(b.unparsed + len(b.events) for b in batches) == pre.events
    return pre, skipped


@pytest.mark.parametrize("layout", ["kineto", "line", "spaced", "compact"])
@pytest.mark.parametrize("escapes", [False, True], ids=["plain", "escapes"])
def test_the_prefilter_reads_what_the_full_parse_reads(
    layout: str, escapes: bool, tmp_path: Path, monkeypatch
) -> None:
    events = _random_events(np.random.default_rng(len(layout) + escapes), 3000, escapes)
    text = _trace_text(events, layout)
    assert len(json.loads(text)["traceEvents"]) == len(events)
    path = tmp_path / "rank-0.json"
    path.write_text(text)
    tr, skipped = _three_ways(path, monkeypatch)
    assert tr.events == len(events)
    assert tr.steps and tr.comm and tr.launch_corr.shape[0] and tr.host_comm and tr.spans
    if not escapes:  # chunks holding a backslash are parsed whole
        assert skipped > len(events) // 4


def test_the_prefilter_keeps_events_a_repeated_key_makes_wanted(
    tmp_path: Path, monkeypatch
) -> None:
    # The last of two "ph" (or "cat", "name") is the one a parser keeps.
    tricky = [
        '  {"ph": "f", "cat": "cpu_op", "name": "ProfilerStep#9", "ts": 9, "ph": "X", "dur": 5}',
        '  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 9, "dur": 5, "name": "## forward ##"}',
        '  {"ph": "X", "cat": "ac2g", "name": "x", "ts": 9, "dur": 5, "cat": "kernel", "args": {"correlation": 77}}',
    ]
    events = _random_events(np.random.default_rng(7), 1500, False)
    text = _trace_text(events, "kineto", tricky * 3)
    path = tmp_path / "rank-0.json"
    path.write_text(text)
    tr, _ = _three_ways(path, monkeypatch)
    assert tr.events == len(events) + 9
    assert (9, 9 * 1000, 14 * 1000) in tr.steps
    assert 77 in tr.dev_corr.tolist()


def test_a_cut_trace_is_still_reported_where_it_breaks(tmp_path: Path, monkeypatch) -> None:
    events = _random_events(np.random.default_rng(3), 2000, False)
    text = _trace_text(events, "kineto")
    path = tmp_path / "rank-0.json"
    path.write_text(text[: len(text) * 2 // 3])
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 4 << 10)
    rep = ImportReport()
    tr = kineto.parse_file(path, rep)
    monkeypatch.setattr(kineto, "_orjson", lambda: None)
    rep_slow = ImportReport()
    slow = kineto.parse_file(path, rep_slow)
    assert tr is not None and slow is not None
    _same_trace(tr, slow)
    assert rep.problems == rep_slow.problems and rep.problems


def test_each_step_counts_the_device_events_that_overlap_it() -> None:
    # A long kernel across three steps, a step without any device event, events out of
    # order: each step's breakdown is the whole-trace breakdown clipped to its window.
    rng = np.random.default_rng(4)
    t0 = np.sort(rng.integers(0, 900_000, 2000))
    t1 = t0 + rng.integers(1, 5_000, 2000)
    t0 = np.r_[t0, 100_000]
    t1 = np.r_[t1, 420_000]
    cls = rng.integers(0, 4, t0.shape[0]).astype(np.int8)
    order = rng.permutation(t0.shape[0])
    steps = [(i, i * 100_000, (i + 1) * 100_000 - 10) for i in range(9)] + [
        (9, 2_000_000, 2_100_000)
    ]
    tr = kineto.RankTrace(file="x", steps=steps)
    tr.dev_t0, tr.dev_t1, tr.dev_cls = t0[order], t1[order], cls[order]
    got = kineto.step_breakdown(tr)
    want = [{**kineto.gpu_breakdown(t0, t1, cls, a, b), "step": s} for s, a, b in steps]
    assert got == want
    assert got[-1]["idle"] == got[-1]["window"] == 100_000
    assert got[3]["compute"] + got[3]["non_compute"] == got[3]["window"] - got[3]["idle"] > 0
