"""The column scan of Kineto events (hub.importers.kineto_scan) against a JSON parser."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import orjson
import pytest

from rankscope.hub.importers import ImportReport, kineto, open_binary
from rankscope.hub.importers.kineto_scan import decimal_to_float, read_numbers


def _numbers_of(texts: list[bytes], is_int: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`read_numbers` of each text, each followed by ``, `` in one buffer."""
    buf = b"".join(t + b", " for t in texts)
    at, pos = [], 0
    for t in texts:
        at.append(pos)
        pos += len(t) + 2
    a = np.frombuffer(buf + b"\0" * 64, np.uint8)
    return read_numbers(a, np.array(at, np.int64), is_int)


def test_decimals_round_to_the_nearest_float_as_a_json_parser_does() -> None:
    rng = random.Random(5)
    texts = [
        "4503599627370497.5",  # a tie at a grid of 1: to the even significand (…498)
        "4503599627370498.5",  # a tie the other way (…498)
        "9007199254740991.5",  # the top of the range: rounds up to 2**53
        "1712195495519689.047",  # libkineto's µs with three decimals (grid of 0.25)
        "1712195495519689.125",  # exactly on the grid
        "1712195495519689.375",  # a tie between .25 and .5: to the even one
        "0.1",
        "0",
        "-2.5",
        "12345678901234.56789",
    ]
    for _ in range(20_000):
        whole = rng.choice([rng.randrange(10 ** rng.randint(1, 16)), 1_700_000_000_000_000])
        decimals = rng.randint(0, 9)
        text = str(whole) + (
            "." + str(rng.randrange(10**decimals)).zfill(decimals) * (decimals > 0)
        )
        if len(text.replace(".", "")) <= 19 and whole < 2**53:
            texts.append(("-" if rng.random() < 0.2 else "") + text.rstrip("."))
    values, ok = _numbers_of([t.encode() for t in texts])
    assert ok.all()
    want = np.array([float(orjson.loads(t)) for t in texts])
    assert np.array_equal(values, want)
    assert (
        values[0] == 4503599627370498.0 and values[2] == 2.0**53 and values[5] == 1712195495519689.5
    )
    neg = np.array([False, True])
    assert decimal_to_float(neg, np.array([25, 25], np.uint64), np.array([1, 1])).tolist() == [
        2.5,
        -2.5,
    ]


@pytest.mark.parametrize(
    "text",
    ["01", "1.", ".5", "-", "1e5", "1E-3", "+1", "1.2.3", "--1", "0x10", "12345678901234567890"],
)
def test_what_is_not_a_plain_json_number_is_left_to_the_parser(text: str) -> None:
    _, ok = _numbers_of([text.encode()])
    assert not ok[0]


def test_a_number_must_end_at_a_separator() -> None:
    a = np.frombuffer(b"12 ,  7\n }  3 x 4" + b"\0" * 64, np.uint8)
    values, ok = read_numbers(a, np.array([0, 6, 12, 16]), False)
    assert ok.tolist() == [True, True, False, False]
    assert values[:2].tolist() == [12.0, 7.0]
    ints, ok = _numbers_of(
        [b"-42", b"7", b"3.0", b"9223372036854775807", b"9223372036854775808"], True
    )
    assert ok.tolist() == [True, True, False, True, False]
    assert ints[:2].tolist() == [-42, 7] and ints[3] == 2**63 - 1


def _profiler_trace(steps: int, ops: int, t0_us: int) -> str:
    """A trace as libkineto writes it (indented, ``args`` last, µs with three decimals): per
    op a host op (forward ``aten::mm`` or an autograd function), its launch, its kernel and
    a flow event; copies, synchronising kernels and NCCL kernels among them."""
    rng = random.Random(11)
    out = []

    def event(top: str, args: str | None) -> str:
        text = "  {\n    " + top
        if args is not None:
            text += ',\n    "args": {\n      ' + args + "\n    }"
        return text + "\n  }"

    def us(t: float) -> str:
        return f"{int(t)}.{rng.randrange(1000):03d}"

    t, corr = float(t0_us), 1
    for s in range(steps):
        step_t = t
        body = []
        for k in range(ops):
            ts = t + 10 + k * 12
            host = (
                "aten::mm" if k < ops // 2 else "autograd::engine::evaluate_function: MmBackward0"
            )
            kernel = rng.choice(
                ["ampere_sgemm_128x64_nn", "Memcpy DtoD", "cudaSyncKernel_x", "dma_k"]
            )
            body.append(
                event(
                    f'"ph": "X", "cat": "cpu_op", "name": "{host}", "pid": 7, "tid": 7, '
                    f'"ts": {us(ts)}, "dur": {rng.randint(1, 9)}.{rng.randrange(1000):03d}',
                    f'"External id": {corr}, "Sequence number": {k}, "Input Dims": [[512, 1024]]',
                )
            )
            body.append(
                event(
                    f'"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, '
                    f'"tid": 7, "ts": {us(ts + 2)}, "dur": 4',
                    f'"External id": {corr}, "cbid": 211, "correlation": {corr}',
                )
            )
            body.append(
                event(
                    f'"ph": "X", "cat": "kernel", "name": "{kernel}", "pid": 0, "tid": 7, '
                    f'"ts": {us(ts + 30)}, "dur": 11.5',
                    f'"queued": 0, "device": 0, "stream": 7, "correlation": {corr}, '
                    f'"grid": [8, 16, 1], "est. achieved occupancy %": 12',
                )
            )
            body.append(
                f'  {{"ph": "f", "id": {corr}, "pid": 0, "tid": 7, "ts": {us(ts + 30)}, '
                f'"cat": "ac2g", "name": "ac2g", "bp": "e"}}'
            )
            if k % 25 == 24:
                body.append(
                    event(
                        f'"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", '
                        f'"pid": 0, "tid": 20, "ts": {us(ts + 35)}, "dur": 40',
                        f'"External id": {corr}, "stream": 20, "correlation": {corr + 1}, '
                        '"Collective name": "allreduce", "In msg nelems": 1024, "dtype": "Float", '
                        '"Process Group Name": "0", "Process Group Ranks": "[0, 1]"',
                    )
                )
            corr += 2
        t = t + 10 + ops * 12 + 60
        out.append(
            event(
                f'"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#{s}", "pid": 7, '
                f'"tid": 7, "ts": {us(step_t)}, "dur": {t - step_t:.3f}',
                None,
            )
        )
        out.extend(body)
        t += 5
    return (
        '{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "nccl", "rank": 0, '
        '"world_size": 1},\n  "traceEvents": [\n' + ",\n".join(out) + "\n  ],\n"
        '  "traceName": "x"\n}'
    )


def test_most_events_of_a_profiler_trace_are_read_as_columns_and_read_the_same(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "rank-0.json"
    path.write_text(_profiler_trace(steps=6, ops=300, t0_us=1_712_195_495_519_689))
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 64 << 10)
    with open_binary(path) as f:
        batches = list(kineto._fast_events(kineto._EdgeReader(f)))
    parsed = sum(len(b.events) for b in batches)
    read = sum(b.unparsed for b in batches)
    scanned = [b.scanned for b in batches if b.scanned is not None]
    # Every kernel but NCCL's, every launch and every autograd op is read from the bytes.
    assert sum(s.dev_t0.shape[0] for s in scanned) == 6 * 300
    assert sum(s.launch_t0.shape[0] for s in scanned) == 6 * 300
    assert sum(s.bwd_t0.shape[0] for s in scanned) == 6 * 150
    assert parsed < 0.02 * (parsed + read)
    fast = kineto.parse_file(path, ImportReport())
    monkeypatch.setattr(kineto, "_orjson", lambda: None)
    slow = kineto.parse_file(path, ImportReport())
    assert fast is not None and slow is not None
    for name in ("dev_t0", "dev_t1", "dev_cls", "dev_corr", "launch_corr", "launch_t0", "bwd"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert (fast.steps, fast.comm, fast.events) == (slow.steps, slow.comm, slow.events)
    classes = set(fast.dev_cls.tolist())
    assert classes == {kineto.COMPUTE, kineto.COMM, kineto.MEMORY, kineto.OTHER}


def _mutated(rng: random.Random, ev: dict) -> dict:
    """``ev`` with values of the wrong type, keys gone, added or in another order."""
    odd = [None, True, "12", -5, 0, 2**53 + 1, 2**63 - 1, -0.0, 1e20, 1.5e-7, [1], {"a": {}}, 12.25]
    names = ["ProfilerStep#7", "aten::mm", "autograd::engine::evaluate_function: X", "Memcpy x"]
    names += [
        "ncclKernel_x",
        "fooSyncbar",
        "dma_x",
        "record_param_comms",
        "c10d::allreduce_",
        'é{}"',
    ]
    cats = ["kernel", "cuda_runtime", "cpu_op", "gpu_memcpy", "user_annotation", "ac2g"]
    ev = dict(ev)
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.3:
            ev[rng.choice(list(ev) or ["ts"])] = rng.choice(odd)
        elif r < 0.45 and ev:
            del ev[rng.choice(list(ev))]
        elif r < 0.6:
            ev[rng.choice(["ts", "dur", "args", "ph", "correlation"])] = rng.choice(odd)
        elif r < 0.75 and isinstance(ev.get("args"), dict):
            ev["args"] = {**ev["args"], rng.choice(["correlation", "ts", "x"]): rng.choice(odd)}
        elif r < 0.85:
            ev["cat"] = rng.choice(cats)
        else:
            ev["name"] = rng.choice(names)
    items = list(ev.items())
    rng.shuffle(items)
    return dict(items)


@pytest.mark.parametrize("seed", range(6))
def test_events_of_every_wrong_shape_read_the_same_three_ways(
    seed: int, tmp_path: Path, monkeypatch
) -> None:
    rng = random.Random(seed)
    base = orjson.loads(_profiler_trace(steps=2, ops=30, t0_us=1_712_195_495_519_689))
    base["traceEvents"] = [
        _mutated(rng, e) if rng.random() < 0.3 else e for e in base["traceEvents"]
    ] + [7, "x", [1]]
    path = tmp_path / "rank-0.json"
    style = [{"separators": (",", ":")}, {}, {"indent": 2}][seed % 3]
    path.write_text(json.dumps(base, ensure_ascii=seed % 2 == 0, **style))
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 4 << 10)
    reports = [ImportReport(), ImportReport()]
    fast = kineto.parse_file(path, reports[0])
    monkeypatch.setattr(kineto, "_orjson", lambda: None)
    slow = kineto.parse_file(path, reports[1])
    assert fast is not None and slow is not None
    for name in ("dev_t0", "dev_t1", "dev_cls", "dev_corr", "launch_corr", "launch_t0", "bwd"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    for name in ("steps", "spans", "comm", "host_comm", "host_rows", "events"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert reports[0].problems == reports[1].problems
    assert any("3 traceEvents entries are not objects" in p for _, p in reports[0].problems)


def test_times_that_cannot_be_true_are_counted_and_the_rest_imported(tmp_path: Path) -> None:
    from rankscope.hub.importers import write_recording

    doc = orjson.loads(_profiler_trace(steps=3, ops=20, t0_us=1_712_195_495_519_689))
    evs = doc["traceEvents"]
    steps = [e for e in evs if e["name"].startswith("ProfilerStep")]
    steps[1]["ts"] = 1e20  # beyond any int64 of ns
    kernels = [e for e in evs if e["cat"] == "kernel"]
    kernels[0]["dur"] = -4
    kernels[1]["ts"] = -(2**60)
    path = tmp_path / "rank-0.json"
    path.write_bytes(orjson.dumps(doc))
    rep = write_recording("kineto", [path], tmp_path / "rec", job="j", run="r")
    assert rep.steps == 2
    assert any("3 complete events have a ts beyond" in p for _, p in rep.problems), rep.problems
