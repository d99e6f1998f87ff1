"""The Perfetto / Chrome trace export: trace-event format, layout, marks, and no lost slice."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from rankscope.collector.schema import (
    FLAG_ASYNC,
    FLAG_DDP_BUCKET,
    FLAG_DEVICE_TIMED,
    NO_TIME,
    OP_INDEX,
    PHASE_INDEX,
    PHASES,
)
from rankscope.diagnosis.window import (
    COLL_AGGREGATES,
    DEVICE_COLUMNS,
    MEMORY_COLUMNS,
    WORK_COLUMNS,
    CollRows,
    GroupInfo,
    InstanceTable,
    RankInfo,
    Window,
)
from rankscope.hub.export_perfetto import PhaseSpans, build_trace, phase_spans, write_trace

MS = 1_000_000.0


def toy_window(with_rows: bool = True, device: bool = False) -> tuple[Window, PhaseSpans]:
    """Four ranks on two hosts, two steps. Each step: forward, backward, optimizer; two
    overlapping DDP buckets on the intra-host group {0, 1} during backward (the second runs
    past the end of backward); one blocking all_reduce over everyone in the optimizer phase,
    which rank 2 enters 0.5 ms late. With ``device``, the buckets carry device times that
    a stream runs back to back: 5.0-6.0 ms and 6.0-7.0 ms into the step."""
    n, steps = 4, np.array([10, 11])
    t_start = np.array([[j * 10 * MS for j in range(2)]] * n)
    t_end = t_start + 9 * MS
    rank_rows, step_rows, phase_rows, t0s, t1s = [], [], [], [], []
    for r in range(n):
        for j, s in enumerate(steps):
            base = t_start[r, j]
            for name, a, b in (("forward", 0, 3), ("backward", 3, 7), ("optimizer", 7.5, 8.5)):
                rank_rows.append(r)
                step_rows.append(s)
                phase_rows.append(PHASE_INDEX[name])
                t0s.append(base + a * MS)
                t1s.append(base + b * MS)
    phases = PhaseSpans(
        rank=np.array(rank_rows),
        step=np.array(step_rows),
        phase=np.array(phase_rows, dtype=np.int16),
        t0=np.array(t0s),
        t1=np.array(t1s),
        names=PHASES,
    )
    rows: dict[str, list[float]] = defaultdict(list)

    def call(r, j, op, g, seq, nbytes, enter, exit_, flags=0, dev=(np.nan, np.nan)):
        rows["rank"].append(r)
        rows["step"].append(int(steps[j]))
        rows["op"].append(OP_INDEX[op])
        rows["group"].append(g)
        rows["seq"].append(seq)
        rows["nbytes"].append(nbytes)
        rows["t_enter"].append(t_start[r, j] + enter * MS)
        rows["t_exit"].append(t_start[r, j] + exit_ * MS)
        rows["flags"].append(flags)
        rows["d0"].append(t_start[r, j] + dev[0] * MS)
        rows["d1"].append(t_start[r, j] + dev[1] * MS)

    bucket = FLAG_ASYNC | FLAG_DDP_BUCKET | (FLAG_DEVICE_TIMED if device else 0)
    for j in range(2):
        for r in range(n):
            call(r, j, "all_reduce", 0, j, 4096, 7.6 + (0.5 if r == 2 else 0.0), 8.3)
        for r in (0, 1):
            dev = ((5.0, 6.0), (6.0, 7.0)) if device else ((np.nan,) * 2,) * 2
            call(r, j, "all_reduce", 1, 2 * j, 1 << 20, 4.0 + 0.1 * r, 6.0, bucket, dev[0])
            call(r, j, "all_reduce", 1, 2 * j + 1, 1 << 20, 5.0, 7.2, bucket, dev[1])
    coll_rows = CollRows(
        rank=np.array(rows["rank"], dtype=np.int32),
        step=np.array(rows["step"], dtype=np.int64),
        op=np.array(rows["op"], dtype=np.int8),
        group=np.array(rows["group"], dtype=np.int32),
        seq=np.array(rows["seq"], dtype=np.int64),
        nbytes=np.array(rows["nbytes"], dtype=np.int64),
        t_enter=np.array(rows["t_enter"]),
        t_start=np.array(rows["d0"]),
        t_end=np.array(rows["d1"]),
        t_exit=np.array(rows["t_exit"]),
        flags=np.array(rows["flags"], dtype=np.int32),
    )
    # Instances, computed here from the rows by the §6 definitions.
    keys = sorted({(g, s) for g, s in zip(rows["group"], rows["seq"])})
    cols: dict[str, list[float]] = defaultdict(list)
    for g, s in keys:
        sel = (coll_rows.group == g) & (coll_rows.seq == s)
        enter = coll_rows.t_enter[sel]
        who = coll_rows.rank[sel]
        order = np.lexsort((who, -enter))
        cols["group"].append(g)
        cols["seq"].append(s)
        cols["step"].append(int(coll_rows.step[sel][0]))
        cols["op"].append(int(coll_rows.op[sel][0]))
        cols["nbytes"].append(int(coll_rows.nbytes[sel][0]))
        cols["n_members"].append(int(sel.sum()))
        cols["n_arrived"].append(int(sel.sum()))
        cols["first"].append(enter.min())
        cols["last"].append(enter.max())
        cols["last_rank"].append(int(who[order[0]]))
        cols["margin"].append(enter[order[0]] - enter[order[1]])
        cols["skew"].append(enter.max() - enter.min())
        cols["transfer"].append(float(np.median(coll_rows.t_exit[sel] - enter.max())))
        cols["device_transfer"].append(np.nan)
    inst = InstanceTable(**{k: np.array(v) for k, v in cols.items()})
    host = np.array([0, 0, 1, 1], dtype=np.int32)
    minus = np.full(n, -1, dtype=np.int32)
    ranks = RankInfo(
        host=host,
        hosts=("node0", "node1"),
        node_rank=host,
        local_rank=np.array([0, 1, 0, 1], dtype=np.int32),
        gpu_index=np.array([0, 1, 0, 1], dtype=np.int32),
        rail=np.array([0, 1, 0, 1], dtype=np.int32),
        rack=np.zeros(n, dtype=np.int32),
        racks=("rack0",),
        nic=minus,
        nics=(),
        shard=minus,
        mesh={},
        incarnation=np.zeros(n, dtype=np.int32),
    )
    nan = np.full((n, 2), np.nan)
    window = Window(
        job="toy",
        run="run-1",
        scope="full",
        parent_run=None,
        manifest={},
        ranks=ranks,
        groups={
            0: GroupInfo(0, "world", (0, 1, 2, 3), True),
            1: GroupInfo(1, "ddp0", (0, 1), False),
        },
        t0_ns=1_700_000_000_000_000_000,
        steps=steps,
        present=np.ones((n, 2), dtype=bool),
        t_start=t_start,
        t_end=t_end,
        phase_ns={"forward": np.full((n, 2), 3 * MS)},
        work={k: nan for k in WORK_COLUMNS},
        memory={k: nan for k in MEMORY_COLUMNS},
        device={k: nan for k in DEVICE_COLUMNS},
        coll={k: np.zeros((n, 2)) for k in COLL_AGGREGATES},
        instances=inst,
        rows=coll_rows if with_rows else None,
    )
    return window, phases


def _check_trace_event_format(doc: dict) -> None:
    """The JSON Object Format of the Trace Event Format: required keys and types per ph."""
    assert set(doc) >= {"traceEvents"}
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "i", "M"), ev
        assert isinstance(ev["name"], str) and ev["name"]
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "M":
            assert ev["name"] in (
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
            )
            assert isinstance(ev["args"], dict)
            continue
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        assert isinstance(ev.get("cat", ""), str)
        assert isinstance(ev.get("args", {}), dict)
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
        else:
            assert ev["s"] in ("g", "p", "t")


def _tracks(doc: dict) -> dict[tuple[int, int], list[dict]]:
    out: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            out[(ev["pid"], ev["tid"])].append(ev)
    return out


def test_trace_follows_the_trace_event_format_and_survives_json() -> None:
    window, phases = toy_window()
    doc = build_trace(window, phases)
    _check_trace_event_format(doc)

    def no_constant(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name} in the trace")

    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text, parse_constant=no_constant) == doc


def test_slices_nest_and_are_ordered_on_every_track() -> None:
    window, phases = toy_window()
    for track, evs in _tracks(build_trace(window, phases)).items():
        ts = [e["ts"] for e in evs]
        assert ts == sorted(ts), f"track {track} not in time order"
        stack: list[float] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-9, f"{track}: {e}"
            stack.append(e["ts"] + e["dur"])


def test_one_process_per_host_and_one_thread_per_rank() -> None:
    window, phases = toy_window()
    doc = build_trace(window, phases)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {e["tid"]: (e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert sorted(procs.values()) == ["node0", "node1"]
    host_pid = {name: pid for pid, name in procs.items()}
    for r, host in enumerate(("node0", "node0", "node1", "node1")):
        assert (host_pid[host], f"rank {r}") in threads.values()
    # pids and tids never collide (a tid equal to its pid is that process's main thread).
    assert not set(procs) & set(threads)
    # Every step slice sits on its rank's own thread.
    for e in doc["traceEvents"]:
        if e.get("cat") == "step":
            assert threads[e["tid"]][1] == f"rank {e['args']['rank']}"


def _thread_names(doc: dict) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


@pytest.mark.parametrize("device", [False, True])
def test_every_interval_is_kept_exactly(device: bool) -> None:
    window, phases = toy_window(device=device)
    doc = build_trace(window, phases)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    got = sorted(
        (e["cat"], e["args"]["rank"], round(e["ts"], 3), round(e["dur"], 3)) for e in slices
    )
    want = []
    for r in range(4):
        for j in range(2):
            want.append(("step", r, window.t_start[r, j] / 1e3, 9_000.0))
    for r, a, b in zip(phases.rank, phases.t0, phases.t1):
        want.append(("phase", int(r), a / 1e3, (b - a) / 1e3))
    rows = window.rows
    for i in range(len(rows)):
        # Device-timed asynchronous collectives are drawn over their device interval.
        a, b = (
            (rows.t_start[i], rows.t_end[i])
            if device and rows.group[i] == 1
            else (
                rows.t_enter[i],
                rows.t_exit[i],
            )
        )
        want.append(("collective", int(rows.rank[i]), a / 1e3, (b - a) / 1e3))
    assert got == sorted((c, r, round(a, 3), round(d, 3)) for c, r, a, d in want)


def test_async_collectives_get_companion_threads_of_their_rank() -> None:
    window, phases = toy_window()
    doc = build_trace(window, phases)
    names = _thread_names(doc)
    colls = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"]
    # The blocking all_reduce nests inside optimizer on the rank's own thread.
    for e in colls:
        r = e["args"]["rank"]
        if e["args"]["group"] == 0:
            assert names[e["tid"]] == f"rank {r}"
        else:
            assert names[e["tid"]].startswith(f"rank {r} · async")
    # The second bucket overlaps the first without nesting: a second async thread.
    late = [e for e in colls if e["args"]["group"] == 1 and e["dur"] > 2000]
    assert late and all(names[e["tid"]] == f"rank {e['args']['rank']} · async 2" for e in late)
    # Companions sort right under their rank.
    order = sorted(
        (e["args"]["sort_index"], names[e["tid"]])
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_sort_index"
    )
    assert [n for _, n in order][:4] == ["rank 0", "rank 0 · async", "rank 0 · async 2", "rank 1"]


def test_device_timed_async_collectives_run_on_one_stream_thread() -> None:
    window, phases = toy_window(device=True)
    doc = build_trace(window, phases)
    names = _thread_names(doc)
    buckets = [
        e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("args", {}).get("group") == 1
    ]
    assert {names[e["tid"]] for e in buckets} == {"rank 0 · stream", "rank 1 · stream"}
    first = next(e for e in buckets if e["args"]["rank"] == 1 and e["args"]["seq"] == 0)
    assert first["ts"] == pytest.approx(window.t_start[1, 0] / 1e3 + 5_000.0)
    assert first["args"]["host_enter_us"] == pytest.approx(window.t_start[1, 0] / 1e3 + 4_100.0)
    assert first["args"]["host_exit_us"] == pytest.approx(window.t_start[1, 0] / 1e3 + 6_000.0)
    assert first["args"]["device_us"] == pytest.approx(1_000.0)
    # The last-arrival mark stays on the rank's own thread, at its host entry.
    mark = next(
        e
        for e in doc["traceEvents"]
        if e["ph"] == "i" and e["args"]["group"] == 1 and e["args"]["seq"] == 0
    )
    assert names[mark["tid"]] == "rank 1" and mark["ts"] == first["args"]["host_enter_us"]


def test_collective_args_and_last_arriver_marks() -> None:
    window, phases = toy_window()
    doc = build_trace(window, phases)
    world = [
        e
        for e in doc["traceEvents"]
        if e.get("cat") == "collective"
        and e["ph"] == "X"
        and e["args"]["group"] == 0
        and e["args"]["step"] == 10
    ]
    by_rank = {e["args"]["rank"]: e["args"] for e in world}
    assert by_rank[2]["last_arriver"] is True
    assert [by_rank[r]["last_arriver"] for r in (0, 1, 3)] == [False] * 3
    assert by_rank[2]["lateness_us"] == pytest.approx(500.0)
    assert by_rank[2]["wait_us"] == pytest.approx(0.0)
    assert by_rank[0]["lateness_us"] == pytest.approx(0.0)
    assert by_rank[0]["wait_us"] == pytest.approx(500.0)
    assert by_rank[0]["transfer_us"] == pytest.approx(200.0)
    assert (by_rank[0]["op"], by_rank[0]["bytes"], by_rank[0]["group_name"]) == (
        "all_reduce",
        4096,
        "world",
    )
    assert by_rank[0]["seq"] == 0 and by_rank[0]["members"] == 4
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert len(marks) == len(window.instances)
    mark = next(m for m in marks if m["args"]["group"] == 0 and m["args"]["seq"] == 0)
    assert mark["args"]["rank"] == 2 and mark["args"]["skew_us"] == pytest.approx(500.0)
    assert mark["args"]["margin_us"] == pytest.approx(500.0)
    slice_of_2 = next(e for e in world if e["args"]["rank"] == 2)
    assert (mark["tid"], mark["ts"]) == (slice_of_2["tid"], slice_of_2["ts"])
    bucket = next(e for e in doc["traceEvents"] if e.get("args", {}).get("group") == 1)
    assert set(bucket["args"]["flags"]) == {"async", "ddp_bucket"}


def test_every_flag_bit_has_a_name() -> None:
    from rankscope.collector import schema
    from rankscope.hub.export_perfetto import _flag_names

    bits = [v for k, v in vars(schema).items() if k.startswith("FLAG_")]
    assert bits and all(len(_flag_names(b)) == 1 for b in bits), [
        (k, _flag_names(v)) for k, v in vars(schema).items() if k.startswith("FLAG_")
    ]
    both = schema.FLAG_DEVICE_TIMED | schema.FLAG_INSPECTOR
    assert set(_flag_names(both)) == {"device_timed", "nccl_inspector"}


def test_window_without_rows_or_spans_still_exports_steps() -> None:
    window, _ = toy_window(with_rows=False)
    doc = build_trace(window)
    _check_trace_event_format(doc)
    cats = {e.get("cat") for e in doc["traceEvents"] if e["ph"] == "X"}
    assert cats == {"step"}
    step = next(e for e in doc["traceEvents"] if e.get("cat") == "step")
    assert step["args"]["forward_ms"] == pytest.approx(3.0)
    assert doc["otherData"]["collectives_included"] is False
    assert doc["otherData"]["t0_ns"] == window.t0_ns


def test_write_trace_reports_counts_and_rejects_a_missing_folder(tmp_path) -> None:
    window, phases = toy_window()
    summary = write_trace(tmp_path / "t.json", window, phases)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert summary.slices == sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
    assert summary.collectives == len(window.rows)
    assert summary.last_arrivals == len(window.instances)
    assert (summary.hosts, summary.ranks) == (2, 4)
    # Four rank threads, and two async threads for each of ranks 0 and 1.
    assert summary.threads == 8
    with pytest.raises(ValueError, match="nope"):
        write_trace(tmp_path / "nope" / "t.json", window, phases)


def test_phase_spans_from_a_raw_table_keep_window_steps_and_names() -> None:
    window, spans = toy_window()
    n = len(spans)
    raw = {
        "rank": np.concatenate([spans.rank, [0, 1]]),
        "step": np.concatenate([spans.step, [9, 10]]),  # step 9 is outside the window
        "phase": np.concatenate([spans.phase, [len(PHASES), len(PHASES)]]),
        "t0": np.concatenate([window.t0_ns + spans.t0.astype(np.int64), [window.t0_ns] * 2]),
        "t1": np.concatenate([window.t0_ns + spans.t1.astype(np.int64), [NO_TIME] * 2]),
    }
    got = phase_spans(window, raw, ["data_wait"])
    assert len(got) == n + 1
    np.testing.assert_array_equal(got.t0[:n], spans.t0)
    np.testing.assert_array_equal(got.t1[:n], spans.t1)
    assert got.names[len(PHASES)] == "data_wait" and np.isnan(got.t1[n])
    doc = build_trace(window, got)
    names = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "phase"}
    assert names == {"forward", "backward", "optimizer"}  # the span without an end is left out
    with pytest.raises(ValueError, match="t1"):
        phase_spans(window, {k: v for k, v in raw.items() if k != "t1"})


def test_perfetto_trace_processor_loads_the_trace(tmp_path) -> None:
    """Loads the export with Perfetto's own trace processor when it can run here.

    The ``perfetto`` package downloads its ``trace_processor_shell`` binary on first use;
    without network access that fails, and the test is skipped with that reason. Set
    ``RANKSCOPE_TRACE_PROCESSOR`` to a local binary to run it offline.
    """
    import os
    import subprocess

    tp_mod = pytest.importorskip("perfetto.trace_processor")
    window, phases = toy_window()
    summary = write_trace(tmp_path / "t.json", window, phases)
    config = tp_mod.TraceProcessorConfig(bin_path=os.environ.get("RANKSCOPE_TRACE_PROCESSOR"))
    try:
        tp = tp_mod.TraceProcessor(trace=str(tmp_path / "t.json"), config=config)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"perfetto trace processor binary not available offline ({exc})")
    try:
        n = next(iter(tp.query("select count(*) as n from slice"))).n
        threads = {row.name for row in tp.query("select name from thread where name is not null")}
        procs = {row.name for row in tp.query("select name from process where name is not null")}
    finally:
        tp.close()
    assert n == summary.slices + summary.last_arrivals
    assert {f"rank {r}" for r in range(4)} <= threads
    assert {"node0", "node1"} <= procs
