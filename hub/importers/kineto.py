"""Import PyTorch profiler (Kineto) Chrome traces: one JSON (or ``.json.gz``) per rank.

The ``traceEvents`` array is streamed a chunk at a time and only the few numbers rankscope
keeps are appended to flat columns, so a 1 GB trace never exists as Python objects. Most
events are read straight from the chunk's bytes as columns (`kineto_scan`); orjson parses
the few others (steps, annotations, NCCL kernels and host collectives, and whatever layout
the scan is not sure of); a chunk neither can split is parsed whole, and a file the fast
path cannot read is streamed by ijson's C parser, which also says where a damaged file
breaks. The metadata outside the array (``distributedInfo``,
``baseTimeNanoseconds``) is read from the first and last MiB of the stream.

What becomes what:

rank
    ``distributedInfo.rank``; else a number in the file name (``rank-3``, ``rank3``,
    ``_3.json``); else the file's place in the sorted list. World size from
    ``distributedInfo.world_size``, else the number of files. Host and pid from the
    file name ``tensorboard_trace_handler`` writes (``{hostname}_{pid}.{time}.pt.trace.json``),
    else ``unknown``.
steps
    ``ProfilerStep#N`` spans (host), step id N.
phases (host spans, clipped to their step)
    ``enumerate(DataLoader)#...`` -> input; ``## forward ##``, ``*.forward`` of
    DistributedDataParallel / FullyShardedDataParallel -> forward; ``## backward ##``, or
    else the first to last ``autograd::engine::evaluate_function`` op of the step ->
    backward; ``## optimizer ##``, ``Optimizer.step#...``, ``Optimizer.zero_grad#...`` ->
    optimizer. Time no rule covers is left to the decomposition's host-gap / other bucket.
collectives
    One row per NCCL kernel (``ncclKernel_*``, ``ncclDevKernel_*``): op, group and bytes
    from the kernel's comm metadata (``Collective name``, ``In msg nelems``, ``dtype``,
    ``Process Group Name`` / ``Ranks``, ``Seq``) or the host op that launched it
    (``External id``: ``record_param_comms``, ``c10d::*``, ``nccl:*``), else the kernel
    name. ``t_enter = t_start`` = kernel start (the rank's device joins the collective),
    ``t_exit = t_end`` = kernel end, flagged device-timed. Without NCCL kernels (gloo,
    CPU-only, world size 1) one row per ``c10d::*`` host op with host times. ``seq`` is
    the metadata's sequence number, else the kernel's place in its group on that rank.
    A group is the metadata's process group (name, ranks); without one, the kernel's
    stream names the communicator and its members are taken to be the imported ranks.
GPU time per step (``meta.json`` source entry and `gpu_breakdown`)
    Over the device timeline inside each host step window: idle (no kernel), compute,
    communication and memory-copy time, kernels classified as HolisticTraceAnalysis does.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from rankscope.collector import schema
from rankscope.hub.importers import (
    ImportReport,
    header,
    next_header,
    open_binary,
    source_manifest,
)
from rankscope.hub.importers.align import estimate_offsets
from rankscope.hub.importers.kineto_scan import Scanned, padded, scan, separated

KIND = "kineto"

COMPUTE, COMM, MEMORY, OTHER = 0, 1, 2, 3
"""Device event classes (HolisticTraceAnalysis' kernel types)."""
CLASS_NAMES = ("compute", "communication", "memory", "other")

_COMM_KERNEL = re.compile(r"^nccl.*Kernel")
_MEMORY_KERNEL = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
_STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_RANK_IN_NAME = re.compile(r"(?:rank|worker)[-_]?(\d+)|[-_.](\d+)\.(?:pt\.trace\.)?json", re.I)
_KERNEL_OP = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")

_OP_ALIASES = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "_allgather_base": "all_gather",
    "_all_gather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_allv": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "gather": "gather",
    "scatter": "scatter",
    "sendrecv": "all_to_all",
}
DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "double": 8,
    "float64": 8,
    "long": 8,
    "int64": 8,
    "int": 4,
    "int32": 4,
    "short": 2,
    "int16": 2,
    "byte": 1,
    "char": 1,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_PH_INPUT = schema.PHASE_INDEX["input"]
_PH_FWD = schema.PHASE_INDEX["forward"]
_PH_BWD = schema.PHASE_INDEX["backward"]
_PH_OPT = schema.PHASE_INDEX["optimizer"]

MAX_US = float(2**52)
"""Event times (``ts``) beyond ±this many µs, and durations beyond it or negative, cannot be
true (142 years): such events are skipped and counted. With `MAX_BASE_NS` every time then
fits an int64 of ns exactly."""
MAX_BASE_NS = 2**62
"""Largest ``baseTimeNanoseconds`` taken."""
EDGE_BYTES = 1 << 20
"""Bytes kept from each end of a trace to read the metadata outside ``traceEvents``."""
STEPS_PER_MESSAGE = 256


def op_name(name: str) -> str:
    """A c10d / NCCL collective name (``allreduce``, ``nccl:_all_gather_base``,
    ``c10d::alltoall_base_``, ``ncclDevKernel_AllGather_RING_LL``) as a `schema.OPS` name
    (``other`` when unknown)."""
    m = _KERNEL_OP.match(name)
    base = m.group(1) if m else name.split("::")[-1].split(":")[-1]
    key = base.strip("_").lower() if not base.startswith("_") else base.lower().rstrip("_")
    op = _OP_ALIASES.get(key) or _OP_ALIASES.get(key.strip("_"))
    return op if op is not None and op in schema.OP_INDEX else "other"


def device_class(name: str, cat: str) -> int:
    """HolisticTraceAnalysis' class of a device event: communication (``^nccl.*Kernel``),
    memory (``^Memcpy``, ``^Memset``, ``^dma``), compute (anything else that is not a
    copy, a set or a ``*Sync``), other."""
    if _COMM_KERNEL.match(name):
        return COMM
    if _MEMORY_KERNEL.match(name):
        return MEMORY
    if not _NOT_COMPUTE.match(name):
        return COMPUTE
    return OTHER


class _EdgeReader:
    """A binary stream that keeps its first and last `EDGE_BYTES` bytes as they pass."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.head = bytearray()
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self.nbytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.nbytes += len(data)
        if len(self.head) < EDGE_BYTES:
            self.head += data[: EDGE_BYTES - len(self.head)]
        # The last reads, by reference: the oldest go once the others hold EDGE_BYTES.
        self._tail.append(data)
        self._tail_bytes += len(data)
        while self._tail_bytes - len(self._tail[0]) >= EDGE_BYTES:
            self._tail_bytes -= len(self._tail.popleft())
        return data

    @property
    def tail(self) -> bytes:
        """The last `EDGE_BYTES` bytes read (fewer when the stream was shorter)."""
        return b"".join(self._tail)[-EDGE_BYTES:]


def _top_value(text: bytes, key: str) -> Any:
    """The JSON value of a top-level ``"key":`` found in ``text`` (None when absent or cut)."""
    pat = re.compile(rb'"' + re.escape(key.encode()) + rb'"\s*:\s*')
    dec = json.JSONDecoder()
    for m in pat.finditer(text):
        try:
            return dec.raw_decode(text[m.end() :].decode("utf-8", "replace"))[0]
        except ValueError:
            continue
    return None


@dataclass
class RankTrace:
    """What one rank's trace holds, as flat columns (times in ns on the rank's clock)."""

    file: str
    rank: int = -1
    world_size: int = -1
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, t0, t1)."""
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(phase, t0, t1) from annotations."""
    bwd: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    """(t0, t1) of autograd evaluate_function ops."""
    has_bwd_annotation: bool = False
    dev_t0: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dev_t1: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    dev_cls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    dev_corr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Device events (kernels, copies, sets) with a stream."""
    launch_corr: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    launch_t0: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Host runtime calls (correlation, start): what launched each device event."""
    comm: list[tuple[int, int, int, int, str, dict[str, Any]]] = field(default_factory=list)
    """NCCL kernels: (t0, t1, stream, external id, name, comm metadata)."""
    host_comm: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """External id -> (name, comm metadata) of host collective ops."""
    host_rows: list[tuple[int, int, str, dict[str, Any]]] = field(default_factory=list)
    """``c10d::*`` host ops: (t0, t1, name, metadata), for traces without NCCL kernels."""
    events: int = 0
    gpu_steps: list[dict[str, int]] = field(default_factory=list)
    """`step_breakdown` of the trace, once taken (`messages`)."""

    def release_device_events(self) -> None:
        """Let go of the device events and launches (the largest columns of a trace)."""
        self.dev_t0 = self.dev_t1 = self.dev_corr = np.zeros(0, np.int64)
        self.dev_cls = np.zeros(0, np.int8)
        self.launch_corr = self.launch_t0 = np.zeros(0, np.int64)


_META_KEYS = (
    "Collective name",
    "In msg nelems",
    "Out msg nelems",
    "dtype",
    "Group size",
    "Process Group Name",
    "Process Group Ranks",
    "Process Group Description",
    "Seq",
    "seq",
)


def _meta(args: dict[str, Any]) -> dict[str, Any]:
    return {k: args[k] for k in _META_KEYS if k in args}


def parse_file(path: Path, report: ImportReport) -> RankTrace | None:
    """Stream one trace file into a `RankTrace`; None (and a problem) when unusable.

    A file cut short keeps what was read before the cut, with a problem saying so.
    """
    import ijson

    modes = ["fast", "ijson"] if _orjson() is not None else ["ijson"]
    for mode in modes:
        tr = RankTrace(file=str(path))
        try:
            raw = open_binary(path)
        except OSError as exc:
            report.problem(path, f"cannot be read ({exc.strerror or exc})")
            return None
        edge = _EdgeReader(raw)
        cut: str | None = None
        scale = 1000.0
        # ts are µs (floats or ints); kept as float µs until the base offset is known.
        steps: list[tuple[int, float, float]] = []
        spans: list[tuple[int, float, float]] = []
        # Per-event columns as typed arrays (8 bytes a value), never one object per event.
        bwd_a, bwd_b = array("d"), array("d")
        dev_a, dev_b, dev_c, dev_k = array("d"), array("d"), array("b"), array("q")
        la_k, la_t = array("q"), array("d")
        comm: list[tuple[float, float, int, int, str, dict[str, Any]]] = []
        not_objects = bad_times = 0
        host_rows: list[tuple[float, float, str, dict[str, Any]]] = []
        try:
            if mode == "fast":
                columns = (dev_a, dev_b, dev_c, dev_k, la_k, la_t, bwd_a, bwd_b)
                evs: Iterator[Any] = _counted(_fast_events(edge), tr, partial(_take, columns))
            else:
                evs = ijson.items(edge, "traceEvents.item", use_float=True)
            for ev in evs:
                tr.events += 1
                if not isinstance(ev, dict):
                    not_objects += 1
                    continue
                if ev.get("ph") != "X":
                    continue
                cat = ev.get("cat")
                name = ev.get("name")
                ts = ev.get("ts")
                if not isinstance(name, str) or not isinstance(ts, int | float):
                    continue
                dur = ev.get("dur", 0.0)
                if not isinstance(dur, int | float):
                    dur = 0.0
                # Times that cannot be true: where the event would be kept, it is counted
                # and skipped instead.
                good = -MAX_US < ts < MAX_US and 0 <= dur < MAX_US
                end = ts + dur
                args = ev.get("args") or {}
                if not isinstance(args, dict):
                    args = {}
                if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
                    if not good:
                        bad_times += 1
                        continue
                    corr = args.get("correlation", -1)
                    corr = corr if isinstance(corr, int) else -1
                    cls = device_class(name, cat)
                    dev_a.append(ts)
                    dev_b.append(end)
                    dev_c.append(cls)
                    dev_k.append(corr)
                    if cls == COMM:
                        stream = args.get("stream", -1)
                        ext = args.get("External id", -1)
                        comm.append(
                            (
                                ts,
                                end,
                                stream if isinstance(stream, int) else -1,
                                ext if isinstance(ext, int) else -1,
                                name,
                                _meta(args),
                            )
                        )
                elif cat == "cuda_runtime" or cat == "cuda_driver":
                    corr = args.get("correlation", -1)
                    if isinstance(corr, int) and not good:
                        bad_times += 1
                    elif isinstance(corr, int):
                        la_k.append(corr)
                        la_t.append(ts)
                elif cat in ("user_annotation", "cpu_op", "python_function"):
                    if name.startswith("ProfilerStep"):
                        m = _STEP.match(name)
                        if m and not good:
                            bad_times += 1
                        elif m:
                            steps.append((int(m.group(1)), ts, end))
                        continue
                    if name.startswith("autograd::engine::evaluate_function"):
                        if not good:
                            bad_times += 1
                            continue
                        bwd_a.append(ts)
                        bwd_b.append(end)
                        continue
                    phase = _phase_of(name)
                    if phase is not None and not good:
                        bad_times += 1
                        continue
                    if phase is not None:
                        if phase == _PH_BWD:
                            tr.has_bwd_annotation = True
                        spans.append((phase, ts, end))
                        continue
                    ext = args.get("External id", -1)
                    if name == "record_param_comms" or name.startswith(("c10d::", "nccl:")):
                        meta = _meta(args)
                        if isinstance(ext, int):
                            old = tr.host_comm.get(ext)
                            if old is None or (meta and not old[1]):
                                tr.host_comm[ext] = (name, meta)
                        if name.startswith("c10d::") and not good:
                            bad_times += 1
                        elif name.startswith("c10d::"):
                            host_rows.append((ts, end, name, meta))
        except _Fallback:
            cut = _FALLBACK
        except ijson.IncompleteJSONError as exc:
            cut = f"ends early or is not JSON ({str(exc).splitlines()[0][:120]})"
        except (OSError, EOFError) as exc:
            cut = f"cannot be read to its end ({exc})"
        finally:
            raw.close()
        if cut == _FALLBACK and mode != modes[-1]:
            continue
        break
    text = bytes(edge.head) + b"\n" + bytes(edge.tail)
    info = _top_value(text, "distributedInfo")
    base = _top_value(text, "baseTimeNanoseconds")
    if tr.events == 0 and not steps:
        report.problem(path, cut or "holds no traceEvents")
        return None
    if cut is not None:
        report.problem(path, f"{cut}; the {tr.events} events before were imported")
    if not_objects:
        report.problem(path, f"{not_objects} traceEvents entries are not objects (skipped)")
    if bad_times:
        report.problem(
            path,
            f"{bad_times} complete events have a ts beyond ±2**52 µs or a dur that is negative "
            "or beyond it (skipped)",
        )
    tr.info = info if isinstance(info, dict) else {}
    base_ns = 0
    if isinstance(base, int) and not isinstance(base, bool) and base > 0:
        if base < MAX_BASE_NS:
            base_ns = base
        else:
            report.problem(path, f"baseTimeNanoseconds {base} is beyond 2**62 (ignored)")

    def ns(t: float) -> int:
        # Integer µs exactly; a float µs since the epoch holds 1/4 µs at best (float64).
        if isinstance(t, int):
            return base_ns + t * 1000
        whole = int(t)
        return base_ns + whole * 1000 + round((t - whole) * scale)

    tr.steps = [(s, ns(a), ns(b)) for s, a, b in steps]
    tr.spans = [(p, ns(a), ns(b)) for p, a, b in spans]
    # In time order (the scan reads its events apart from the parser's, so the order they
    # were read in is not the file's; nothing depends on it).
    bwd = np.stack((_ns(bwd_a, base_ns), _ns(bwd_b, base_ns)), axis=1)
    tr.bwd = bwd[np.lexsort((bwd[:, 1], bwd[:, 0]))]
    t0, t1 = _ns(dev_a, base_ns), _ns(dev_b, base_ns)
    kind, corr = np.frombuffer(dev_c, np.int8), np.frombuffer(dev_k, np.int64)
    order = np.lexsort((corr, kind, t1, t0))
    tr.dev_t0, tr.dev_t1, tr.dev_cls, tr.dev_corr = t0[order], t1[order], kind[order], corr[order]
    launch_t0, launch_corr = _ns(la_t, base_ns), np.frombuffer(la_k, np.int64)
    order = np.lexsort((launch_corr, launch_t0))
    tr.launch_t0, tr.launch_corr = launch_t0[order], launch_corr[order]
    tr.comm = [(ns(a), ns(b), s, e, n, m) for a, b, s, e, n, m in comm]
    tr.host_rows = [(ns(a), ns(b), n, m) for a, b, n, m in host_rows]
    r = tr.info.get("rank")
    tr.rank = r if isinstance(r, int) and not isinstance(r, bool) and r >= 0 else -1
    w = tr.info.get("world_size")
    tr.world_size = w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else -1
    return tr


_FALLBACK = "fallback"
CHUNK_BYTES = 2 << 20
"""Bytes of the traceEvents array parsed at a time on the fast path."""


class _Fallback(Exception):
    """The fast path cannot split this file: parse it again with ijson."""


def _orjson() -> Any:
    try:
        import orjson
    except ImportError:
        return None
    return orjson


def _take(columns: tuple[array, ...], sc: Scanned) -> None:
    """Append what the scan read to `parse_file`'s columns (device start, end, class,
    correlation; launch correlation, start; backward start, end)."""
    values: tuple[np.ndarray, ...] = (sc.dev_t0, sc.dev_t1, sc.dev_cls, sc.dev_corr)
    values += (sc.launch_corr, sc.launch_t0)
    values += (sc.bwd_t0, sc.bwd_t1)
    for column, v in zip(columns, values):
        column.frombytes(v.tobytes())


class Batch(NamedTuple):
    """What `_fast_events` gives of one chunk."""

    unparsed: int
    """Events not given as objects: left out, or read by the scan."""
    events: list[Any]
    """The other events, parsed."""
    rest: bytes = b""
    """The text from the chunk's last complete event on (`_prefilter`'s)."""
    scanned: Scanned | None = None
    """What `kineto_scan.scan` read (None where the chunk was parsed whole)."""


def _counted(
    batches: Iterator[Batch], tr: RankTrace, take: Callable[[Scanned], None]
) -> Iterator[Any]:
    """The parsed events of `_fast_events`' batches; the events it did not parse are
    counted in ``tr`` and what the scan read goes to ``take``, as each batch is taken
    (chained in C: no Python frame per event)."""

    def events(batch: Batch) -> list[Any]:
        tr.events += batch.unparsed
        if batch.scanned is not None:
            take(batch.scanned)
        return batch.events

    return chain.from_iterable(map(events, batches))


def _fast_events(edge: _EdgeReader) -> Iterator[Batch]:
    """The events of ``traceEvents`` a chunk of `CHUNK_BYTES` at a time, as batches.

    Each chunk is first offered to `_prefilter`, which finds the events' boundaries in the
    bytes, reads those `kineto_scan.scan` can read as columns and leaves out those the
    importer has no use for. A chunk it is not sure about
    is parsed whole: cut after a ``},`` and kept only when ``[`` + chunk + ``]`` parses: a
    cut inside an event leaves its braces unbalanced (JSON strings hold no raw newline or
    unbalanced text that could make it parse), so a chunk that parses ends on an event.
    When no cut parses, or the array's end cannot be found, `_Fallback` is raised and the
    file is read again by ijson, which also says where a damaged file breaks.
    """
    orjson = _orjson()
    buf = b""
    while True:  # find the array
        data = edge.read(1 << 16)
        if not data:
            raise _Fallback
        buf += data
        m = re.search(rb'"traceEvents"\s*:\s*\[', buf)
        if m:
            buf = buf[m.end() :]
            break
        if len(buf) > 64 << 20:
            raise _Fallback
    eof = False
    while not eof:
        data = edge.read(CHUNK_BYTES)
        eof = not data
        buf += data
        kept = _prefilter(buf)
        if kept is not None:
            wanted = kept.events
            try:
                events = orjson.loads(b"[{" + b"},{".join(wanted) + b"}]") if wanted else []
            except orjson.JSONDecodeError:
                events = None
            if events is not None and len(events) == len(wanted):
                yield kept._replace(events=events, rest=b"")
                buf = kept.rest
                continue
        if eof:
            break
        pos = len(buf)
        for _ in range(64):
            pos = buf.rfind(b"},", 0, pos)
            if pos < 0:
                break
            try:
                events = orjson.loads(b"[" + buf[: pos + 1] + b"]")
            except orjson.JSONDecodeError:
                continue
            yield Batch(0, events)
            buf = buf[pos + 2 :]
            break
        else:
            raise _Fallback
    # The last events, up to the ``]`` that closes the array.
    pos = len(buf)
    for _ in range(4096):
        pos = buf.rfind(b"]", 0, pos)
        if pos < 0:
            break
        try:
            events = orjson.loads(b"[" + buf[:pos] + b"]")
        except orjson.JSONDecodeError:
            continue
        yield Batch(0, events)
        return
    raise _Fallback


_HEAD = re.compile(
    rb'\s*"ph"\s*:\s*"([^"]*)"(?:\s*,\s*"cat"\s*:\s*"([^"]*)"\s*,\s*"name"\s*:\s*"([^"]*)")?'
)
_DEVICE_CATS = (b"kernel", b"gpu_memcpy", b"gpu_memset", b"cuda_runtime", b"cuda_driver")
_HOST_CATS = (b"user_annotation", b"cpu_op", b"python_function")
_BLANK = b" \t\n\r"


def _prefilter(buf: bytes) -> Batch | None:
    """The events that start in ``buf`` (which starts where an event may start), found
    without parsing them: how many were left out as of no use to `parse_file` or read by
    `kineto_scan.scan`, the text of each other one, the text from the last complete event
    on, and what the scan read. None when it cannot be sure, or finds fewer than two
    events.

    Where ``buf`` holds no backslash, every ``"`` opens or closes a string, so a brace
    with an even number of quotes before it lies outside every string. The events are the
    objects those braces delimit at depth 0; each two must be apart by one comma and
    blanks, else (an array's end, a value that is no object) the events stop there.
    `kineto_scan.scan` settles most of them at once. Of the others, an event is left out
    only when its text opens with ``"ph"`` (and ``"cat"``, ``"name"``) whose values
    `_unwanted` rejects, and those keys occur once in it (of a repeated key a parser keeps
    the last value).
    """
    if b"\\" in buf:
        return None
    a = padded(buf)
    quotes = np.flatnonzero(a == 0x22)
    braces = np.flatnonzero((a == 0x7B) | (a == 0x7D))
    braces = braces[(np.searchsorted(quotes, braces) & 1) == 0]
    opens = a[braces] == 0x7B
    depth = np.cumsum(np.where(opens, 1, -1))
    neg = np.flatnonzero(depth < 0)
    if neg.shape[0]:
        cut = int(neg[0])
        braces, opens, depth = braces[:cut], opens[:cut], depth[:cut]
    end_at = np.flatnonzero(~opens & (depth == 0))
    start_at = np.flatnonzero(opens & (depth == 1))[: end_at.shape[0]]
    if end_at.shape[0] < 2 or buf[: braces[start_at[0]]].strip(_BLANK):
        return None
    n = separated(a, braces[end_at[:-1]] + 1, braces[start_at[1:]])
    if n == 0:
        return None
    starts, ends = braces[start_at[:n]].tolist(), braces[end_at[:n]].tolist()
    rest = int(braces[start_at[n]])
    n_inner = end_at[:n] - start_at[:n]
    at = start_at[:n]
    inner_open = np.where(n_inner == 3, braces[np.minimum(at + 1, braces.shape[0] - 1)], -1)
    inner_close = np.where(n_inner == 3, braces[np.minimum(at + 2, braces.shape[0] - 1)], -1)
    inner_open[n_inner > 3] = -2
    scanned = scan(
        buf,
        a,
        quotes,
        braces[at],
        braces[end_at[:n]],
        inner_open,
        inner_close,
        _HOST_PREFIXES,
        _HOST_NAMES,
        MAX_US,
    )
    # What the scan could not settle, event by event: an event is left out only when its
    # text opens with "ph" (and "cat", "name") whose values `_unwanted` rejects, and those
    # keys occur once in it; its args are cut to what is read where its one inner object
    # is its args.
    head = _HEAD.match
    wanted = []
    skipped = scanned.skipped
    todo = np.flatnonzero(~scanned.settled).tolist()
    for s, e, ao in zip(
        map(starts.__getitem__, todo), map(ends.__getitem__, todo), inner_open[todo].tolist()
    ):
        m = head(buf, s + 1)
        if m is None:
            wanted.append(buf[s + 1 : e])
            continue
        groups = m.groups()
        once = buf.count(b'"ph"', s, e) == 1
        if _unwanted(groups, buf, s, e, once):
            skipped += 1
        elif once and ao >= 0:
            wanted.append(_trimmed(groups, buf, s, e, ao))
        else:
            wanted.append(buf[s + 1 : e])
    return Batch(n - len(wanted), wanted, buf[rest:], scanned)


_CORRELATION = re.compile(rb'"correlation"\s*:\s*(-?\d+)\s*[,}]')


def _trimmed(head: tuple[Any, ...], buf: bytes, s: int, e: int, ao: int) -> bytes:
    """The inner text of a wanted event ``buf[s : e + 1]`` whose only inner object opens
    at ``ao``, with that object left out or cut to ``correlation`` where it is the event's
    ``args`` and `parse_file` reads nothing else of it: device events other than NCCL
    kernels and runtime calls (correlation), steps, phases and autograd ops (nothing).
    Else the whole text. ``"args"`` just before a ``{`` outside strings is the key, and a
    ``"correlation"`` followed by ``:`` inside the args (which hold no object) is a key
    of the args: in backslash-free valid JSON neither can be inside a string."""
    whole = buf[s + 1 : e]
    _, cat, name = head
    k = buf.rfind(b'"args"', s, ao)
    if cat is None or k < 0 or buf[k + 6 : ao].strip(_BLANK) != b":":
        return whole
    ac = buf.index(b"}", ao)  # the args hold no other brace outside strings
    if cat in _DEVICE_CATS:
        if name.startswith(b"nccl"):
            return whole
        n = buf.count(b'"correlation"', ao, ac)
        if n == 0:
            args = b"{}"
        else:
            m = _CORRELATION.search(buf, ao, ac + 1)
            if n != 1 or m is None:
                return whole
            args = b'{"correlation": ' + m.group(1) + b"}"
    elif cat in _HOST_CATS and (name.startswith(_NO_ARGS_PREFIXES) or name in _HOST_NAMES[1:]):
        args = b"{}"
    else:
        return whole
    return buf[s + 1 : ao] + args + buf[ac + 1 : e]


def _unwanted(head: tuple[Any, ...], buf: bytes, s: int, e: int, once: bool) -> bool:
    """Whether the event ``buf[s : e + 1]`` (backslash-free), whose text opens with
    ``head`` (ph, cat, name), is certainly of no use to `parse_file`: not a complete event
    (ph ``X``), or of a category it does not read, or a host op whose name no rule of
    `parse_file` takes. ``once``: ``"ph"`` is known to occur once in it."""
    ph, cat, name = head
    if ph != b"X":
        return once
    if cat is None or cat in _DEVICE_CATS:
        return False
    if cat in _HOST_CATS:
        if name.startswith(_HOST_PREFIXES) or name in _HOST_NAMES:
            return False
        return once and buf.count(b'"cat"', s, e) == 1 and buf.count(b'"name"', s, e) == 1
    return once and buf.count(b'"cat"', s, e) == 1


def _ns(us: array, base_ns: int) -> np.ndarray:
    """µs (float64: integers below 2**53 exactly) as int64 ns after ``base_ns``."""
    t = np.frombuffer(us, np.float64)
    whole = np.floor(t)
    return base_ns + whole.astype(np.int64) * 1000 + np.round((t - whole) * 1000).astype(np.int64)


_PHASE_PREFIXES = (
    ("enumerate(DataLoader)", _PH_INPUT),
    ("## forward", _PH_FWD),
    ("## backward", _PH_BWD),
    ("## optimizer", _PH_OPT),
    ("Optimizer.step#", _PH_OPT),
    ("Optimizer.zero_grad#", _PH_OPT),
)
_PHASE_NAMES = {
    "DistributedDataParallel.forward": _PH_FWD,
    "FullyShardedDataParallel.forward": _PH_FWD,
}
_HOST_PREFIXES = tuple(
    p.encode()
    for p in (
        "ProfilerStep",
        "autograd::engine::evaluate_function",
        "c10d::",
        "nccl:",
        *(p for p, _ in _PHASE_PREFIXES),
    )
)
_HOST_NAMES = (b"record_param_comms", *(n.encode() for n in _PHASE_NAMES))
"""Host op names `parse_file` reads: what `_prefilter` must never leave out."""
_NO_ARGS_PREFIXES = tuple(p for p in _HOST_PREFIXES if p not in (b"c10d::", b"nccl:"))
"""Of those, the ones whose args `parse_file` does not read."""


def _phase_of(name: str) -> int | None:
    for prefix, phase in _PHASE_PREFIXES:
        if name.startswith(prefix):
            return phase
    return _PHASE_NAMES.get(name)


_WORKER = re.compile(r"^(.+)_(\d+)$")


def worker_of(path: str) -> tuple[str, int]:
    """``(host, pid)`` from a file name the profiler's ``tensorboard_trace_handler`` wrote
    (``{worker}.{time}.pt.trace.json``, the worker ``{hostname}_{pid}`` by default);
    ``("unknown", 0)`` when the name does not say."""
    worker = Path(path).name.split(".")[0]
    m = _WORKER.match(worker)
    if not m or worker.lower().startswith(("rank", "sampled_rank")):
        return "unknown", 0
    pid = int(m.group(2))
    return m.group(1), pid if pid <= 2**31 - 1 else 0


def _rank_from_name(path: str) -> int | None:
    m = _RANK_IN_NAME.search(Path(path).name)
    if not m:
        return None
    return int(m.group(1) or m.group(2))


def _union(t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals of ``[t0, t1)`` (sorted, disjoint)."""
    if t0.shape[0] == 0:
        return t0, t1
    order = np.argsort(t0, kind="stable")
    a, b = t0[order], t1[order]
    run_end = np.maximum.accumulate(b)
    new = np.r_[True, a[1:] > run_end[:-1]]
    idx = np.flatnonzero(new)
    starts = a[idx]
    ends = np.maximum.reduceat(b, idx)
    return starts, ends


def _covered(s: np.ndarray, e: np.ndarray, lo: int, hi: int) -> int:
    """Length of the union ``(s, e)`` (merged) inside ``[lo, hi]``."""
    a = np.clip(s, lo, hi)
    b = np.clip(e, lo, hi)
    return int((b - a).sum())


def _intersection(s1: np.ndarray, e1: np.ndarray, s2: np.ndarray, e2: np.ndarray) -> int:
    """Length of the intersection of two merged interval sets: ``|A| + |B| - |A u B|``."""
    if not s1.shape[0] or not s2.shape[0]:
        return 0
    s, e = _union(np.concatenate((s1, s2)), np.concatenate((e1, e2)))
    return int((e1 - s1).sum() + (e2 - s2).sum() - (e - s).sum())


def gpu_breakdown(
    t0: np.ndarray, t1: np.ndarray, cls: np.ndarray, lo: int | None = None, hi: int | None = None
) -> dict[str, int]:
    """Device time of ``[lo, hi]`` (default: first start to last end) split into idle,
    compute, communication, memory and other time, and the compute / communication
    overlap, HolisticTraceAnalysis' way: ``idle`` = window minus the union of all device
    events; ``compute`` = union of compute kernels; ``non_compute`` = the rest of the
    busy time; ``communication`` / ``memory`` = union of those kernels (they may overlap
    compute); ``overlap`` = time communication and compute kernels run together.

    Returns:
        ns per category, and ``window``.
    """
    t0 = np.asarray(t0, np.int64)
    t1 = np.asarray(t1, np.int64)
    cls = np.asarray(cls)
    if t0.shape[0] == 0:
        keys = ("window", "idle", "compute", "non_compute", "communication", "memory", "overlap")
        none = dict.fromkeys(keys, 0)
        if lo is not None and hi is not None:
            none["window"] = none["idle"] = hi - lo
        return none
    lo = int(t0.min()) if lo is None else lo
    hi = int(t1.max()) if hi is None else hi
    s, e = _union(t0, t1)
    busy = _covered(s, e, lo, hi)
    out: dict[str, int] = {"window": hi - lo, "idle": hi - lo - busy}
    merged = {}
    for c, nm in ((COMPUTE, "compute"), (COMM, "communication"), (MEMORY, "memory")):
        sel = cls == c
        ms, me = _union(t0[sel], t1[sel])
        ms, me = np.clip(ms, lo, hi), np.clip(me, lo, hi)
        merged[c] = (ms, me)
        out[nm] = int((me - ms).sum())
    out["non_compute"] = busy - out["compute"]
    out["overlap"] = _intersection(*merged[COMPUTE], *merged[COMM])
    return out


@dataclass
class _Group:
    id: int
    name: str
    ranks: list[int] | None
    desc: str


def _parse_ranks(value: Any) -> list[int] | None:
    if isinstance(value, list):
        vals = value
    elif isinstance(value, str):
        try:
            vals = json.loads(value)
        except ValueError:
            return None
    else:
        return None
    if not isinstance(vals, list) or not all(isinstance(v, int) for v in vals):
        return None
    return [int(v) for v in vals]


def _nbytes(meta: dict[str, Any]) -> int:
    n = meta.get("In msg nelems")
    dt = meta.get("dtype")
    if not isinstance(n, int) or not isinstance(dt, str):
        return -1
    size = DTYPE_BYTES.get(dt.lower().replace("torch.", ""))
    return n * size if size else -1


def messages(files: list[Path], report: ImportReport, *, job: str, run: str) -> Iterator[bytes]:
    """Wire messages of a set of Kineto traces, one file per rank (module docstring)."""
    traces: list[RankTrace] = []
    for f in files:
        if not (f.name.endswith((".json", ".json.gz"))):
            report.problem(f, "not a .json or .json.gz trace; left out")
            continue
        tr = parse_file(f, report)
        if tr is None:
            continue
        if not tr.steps:
            report.problem(f, "holds no ProfilerStep#N span; left out")
            continue
        # The GPU time of each step now, and the device events let go: a set of many ranks
        # holds one rank's kernels at a time.
        tr.gpu_steps = step_breakdown(tr)
        tr.release_device_events()
        traces.append(tr)
    if not traces:
        return
    _assign_ranks(traces, report)
    world = max([t.world_size for t in traces] + [max(t.rank for t in traces) + 1, len(traces)])
    imported = sorted(t.rank for t in traces)
    groups: dict[tuple[str, str], _Group] = {}
    rows_of: dict[int, dict[str, np.ndarray]] = {}
    for tr in traces:
        rows_of[tr.rank] = _coll_rows(tr, groups, imported)
    # Clock alignment from matched device ends (one clock per rank's host).
    all_rank = np.concatenate([np.full(rows_of[r]["t_end"].shape[0], r) for r in imported])
    cat = {k: np.concatenate([rows_of[r][k] for r in imported]) for k in ("group", "seq", "t_exit")}
    offsets = {r: 0 for r in imported}
    if len(imported) > 1:
        al = estimate_offsets(all_rank, cat["group"], cat["seq"], cat["t_exit"])
        if al.max_error_ns is not None and (al.error_ns >= 0).sum() > 1:
            offsets.update(al.resolved())
            report.alignment_ns = al.max_error_ns
            report.details["clock_offsets_ns"] = {str(r): offsets[r] for r in imported}
        else:
            report.lack("cross-rank clock alignment (too few matched collectives)")
    report.lack("host collective completion times (t_exit is the kernel's end)")
    report.lack("tokens and samples per step")
    report.lack("device samples (clocks, power, throttling)")
    if not any(t.comm for t in traces):
        report.lack("NCCL kernels (collectives have host times only)")
    group_list: list[dict[str, Any]] = [
        {
            "id": g.id,
            "name": g.name[: schema.MAX_NAME_CHARS],
            "ranks": g.ranks if g.ranks is not None else list(imported),
            "backend": "nccl",
            "desc": g.desc[: schema.MAX_NAME_CHARS],
        }
        for g in groups.values()
    ]
    for gd in group_list:
        gd["ranks"] = [r for r in gd["ranks"] if 0 <= r < world] or list(imported)
    report.files_read = [t.file for t in traces]
    src = source_manifest(KIND, report.files_read, report.lacks)
    src["alignment_ns"] = report.alignment_ns
    headers = {t.rank: header(job, run, t.rank) for t in traces}
    t_first = min(t.steps[0][1] for t in traces)
    for tr in sorted(traces, key=lambda t: t.rank):
        host, pid = worker_of(tr.file)
        ident = {
            "rank": tr.rank,
            "world_size": world,
            "local_rank": 0,
            "host": str(tr.info.get("host") or host)[: schema.MAX_NAME_CHARS],
            "node_rank": -1,
            "pid": pid,
        }
        manifest = {
            "source": src,
            "nccl_version": str(tr.info.get("nccl_version", "")),
            "backend": str(tr.info.get("backend", "")),
            "trace_file": Path(tr.file).name,
        }
        yield schema.hello_message(
            next_header(headers[tr.rank]),
            ident,
            manifest=manifest,
            t_start_ns=max(0, t_first - offsets[tr.rank]),
        )
    first = min(headers)
    yield schema.groups_message(next_header(headers[first]), group_list)
    for r in sorted(headers):
        # The alignment's error stands where a live collector's clock uncertainty does.
        stats = {
            "dropped_batches": 0,
            "dropped_events": 0,
            "errors": {},
            "clock_offset_ns": int(offsets[r]),
            "clock_error_ns": int(report.alignment_ns or 0),
        }
        yield schema.stats_message(next_header(headers[r]), stats)
    breakdown: dict[str, Any] = {}
    for tr in sorted(traces, key=lambda t: t.rank):
        off = offsets[tr.rank]
        yield from _steps_messages(tr, rows_of[tr.rank], off, headers[tr.rank])
        breakdown[str(tr.rank)] = tr.gpu_steps
    report.details["gpu_breakdown"] = breakdown


def _assign_ranks(traces: list[RankTrace], report: ImportReport) -> None:
    taken: set[int] = set()
    for tr in traces:
        if tr.rank >= 0 and tr.rank in taken:
            report.problem(tr.file, f"rank {tr.rank} again; numbered from its file name")
            tr.rank = -1
        if tr.rank >= 0:
            taken.add(tr.rank)
    for tr in traces:
        if tr.rank < 0:
            r = _rank_from_name(tr.file)
            if r is not None and r not in taken:
                tr.rank = r
                taken.add(r)
    nxt = 0
    for tr in traces:
        if tr.rank < 0:
            while nxt in taken:
                nxt += 1
            tr.rank = nxt
            taken.add(nxt)


def _group_of(meta: dict[str, Any], stream: int, groups: dict[tuple[str, str], _Group]) -> _Group:
    pg = meta.get("Process Group Name")
    if isinstance(pg, str | int):
        key = ("pg", str(pg))
        ranks = _parse_ranks(meta.get("Process Group Ranks"))
        desc = str(meta.get("Process Group Description", "process group"))
        name = f"pg{pg}"
    else:
        key = ("stream", str(stream))
        ranks = None
        desc = "communicator inferred from the CUDA stream"
        name = f"stream{stream}"
    g = groups.get(key)
    if g is None:
        g = _Group(len(groups), name, ranks, desc)
        groups[key] = g
    elif g.ranks is None and ranks is not None:
        g.ranks = ranks
    return g


def _coll_rows(
    tr: RankTrace, groups: dict[tuple[str, str], _Group], imported: list[int]
) -> dict[str, np.ndarray]:
    """The collective rows of one rank (times on its own clock), in start order."""
    rows: list[tuple[int, int, int, int, int, int]] = []  # t0, t1, op, group, seq, nbytes
    flags = schema.FLAG_DEVICE_TIMED
    if tr.comm:
        src = sorted(tr.comm, key=lambda c: c[0])
        for t0, t1, stream, ext, name, meta in src:
            host = tr.host_comm.get(ext)
            m = dict(host[1]) if host else {}
            m.update(meta)
            cname = m.get("Collective name")
            if isinstance(cname, str):
                op = op_name(cname)
            elif host is not None and op_name(host[0]) != "other":
                op = op_name(host[0])
            else:
                op = op_name(name)
            g = _group_of(m, stream, groups)
            seq = m.get("Seq", m.get("seq", -1))
            rows.append(
                (t0, t1, schema.OP_INDEX[op], g.id, seq if isinstance(seq, int) else -1, _nbytes(m))
            )
    else:
        flags = 0
        for t0, t1, name, meta in sorted(tr.host_rows, key=lambda c: c[0]):
            g = _group_of(meta, -1, groups)
            seq = meta.get("Seq", meta.get("seq", -1))
            rows.append(
                (
                    t0,
                    t1,
                    schema.OP_INDEX[op_name(name)],
                    g.id,
                    seq if isinstance(seq, int) else -1,
                    _nbytes(meta),
                )
            )
    n = len(rows)
    arr = np.array(rows, dtype=np.int64).reshape(n, 6)
    seq = arr[:, 4].copy()
    missing = seq < 0
    if missing.any():
        # Place within its group on this rank, in start order.
        for gid in np.unique(arr[missing, 3]):
            sel = np.flatnonzero(arr[:, 3] == gid)
            seq[sel] = np.arange(sel.shape[0])
    steps = np.array([s for s, _, _ in tr.steps], np.int64)
    s0 = np.array([a for _, a, _ in tr.steps], np.int64)
    s1 = np.array([b for _, _, b in tr.steps], np.int64)
    step = _step_of(arr[:, 0], steps, s0, s1)
    return {
        "step": step,
        "op": arr[:, 2],
        "group": arr[:, 3],
        "seq": seq,
        "nbytes": arr[:, 5],
        "t_enter": arr[:, 0],
        "t_start": arr[:, 0] if flags else np.full(n, schema.NO_TIME, np.int64),
        "t_end": arr[:, 1] if flags else np.full(n, schema.NO_TIME, np.int64),
        "t_exit": arr[:, 1],
        "flags": np.full(n, flags, np.int32),
    }


def _step_of(t: np.ndarray, steps: np.ndarray, s0: np.ndarray, s1: np.ndarray) -> np.ndarray:
    """The step whose span holds each time; a device time after its step's host span
    belongs to the last step started before it (GPU work lags the host)."""
    order = np.argsort(s0)
    steps, s0 = steps[order], s0[order]
    i = np.searchsorted(s0, t, side="right") - 1
    out = np.where(i >= 0, steps[np.clip(i, 0, None)], -1)
    return out.astype(np.int64)


def _phase_rows(tr: RankTrace) -> list[tuple[int, int, int, int]]:
    """(step, phase, t0, t1): annotation spans clipped to their step, backward inferred
    from autograd ops where no annotation says it."""
    out: list[tuple[int, int, int, int]] = []
    bwd = tr.bwd
    for step, a, b in tr.steps:
        mine: list[tuple[int, int, int]] = []
        for phase, t0, t1 in tr.spans:
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo and a <= t0 < b:
                mine.append((phase, lo, hi))
        # Two annotations of one phase (``## forward ##`` around DDP's forward) are one
        # span: their union.
        mine.sort()
        for phase, lo, hi in mine:
            if out and out[-1][0] == step and out[-1][1] == phase and lo <= out[-1][3]:
                out[-1] = (step, phase, out[-1][2], max(hi, out[-1][3]))
            else:
                out.append((step, phase, lo, hi))
        if not tr.has_bwd_annotation and bwd.shape[0]:
            sel = (bwd[:, 0] >= a) & (bwd[:, 0] < b)
            if sel.any():
                out.append((step, _PH_BWD, int(bwd[sel, 0].min()), min(b, int(bwd[sel, 1].max()))))
    return out


def _steps_messages(
    tr: RankTrace, colls: dict[str, np.ndarray], off: int, h: dict[str, Any]
) -> Iterator[bytes]:
    steps = sorted(tr.steps)
    phases = _phase_rows(tr)
    for i in range(0, len(steps), STEPS_PER_MESSAGE):
        part = steps[i : i + STEPS_PER_MESSAGE]
        ids = {s for s, _, _ in part}
        st = schema.empty_table("steps", len(part))
        st["step"] = np.array([s for s, _, _ in part], np.int64)
        st["t_start"] = np.array([a for _, a, _ in part], np.int64) - off
        st["t_end"] = np.array([b for _, _, b in part], np.int64) - off
        ph = [p for p in phases if p[0] in ids]
        pt = schema.empty_table("phases", len(ph))
        if ph:
            arr = np.array(ph, np.int64)
            pt["step"], pt["phase"] = arr[:, 0], arr[:, 1].astype(np.int16)
            pt["t0"], pt["t1"] = arr[:, 2] - off, arr[:, 3] - off
        sel = np.isin(colls["step"], np.array(sorted(ids), np.int64))
        if i == 0:
            sel |= colls["step"] < 0
        co = {k: v[sel] for k, v in colls.items()}
        for k in ("t_enter", "t_start", "t_end", "t_exit"):
            known = co[k] != schema.NO_TIME
            co[k] = np.where(known, co[k] - off, co[k])
        yield schema.steps_message(next_header(h), st, pt, co)


def step_breakdown(tr: RankTrace) -> list[dict[str, int]]:
    """GPU idle / compute / communication / memory ns inside each host step window."""
    t0, t1, cls = tr.dev_t0, tr.dev_t1, tr.dev_cls
    if t0.shape[0] > 1 and not bool((t0[1:] >= t0[:-1]).all()):
        order = np.argsort(t0, kind="stable")
        t0, t1, cls = t0[order], t1[order], cls[order]
    # Only the events that overlap a window count in it: those that start less than the
    # longest event's length before it, and end after its start.
    longest = int((t1 - t0).max(initial=0))
    out = []
    for step, a, b in sorted(tr.steps):
        lo = int(np.searchsorted(t0, a - longest, "left"))
        hi = int(np.searchsorted(t0, b, "left"))
        near = slice(lo, hi)
        keep = t1[near] > a
        d = gpu_breakdown(t0[near][keep], t1[near][keep], cls[near][keep], a, b)
        d["step"] = step
        out.append(d)
    return out


def hta_breakdown(tr: RankTrace) -> dict[str, int]:
    """`gpu_breakdown` over the device events HolisticTraceAnalysis keeps for its temporal
    breakdown: those launched (by correlation) before the start of the last profiler step,
    from the first one's start to the last one's end."""
    corr, lc, lt = tr.dev_corr, tr.launch_corr, tr.launch_t0
    last = max(a for _, a, _ in tr.steps)
    keep_corr = lc[lt < last]
    sel = np.isin(corr, keep_corr)
    return gpu_breakdown(
        tr.dev_t0[sel],
        tr.dev_t1[sel],
        tr.dev_cls[sel],
    )
