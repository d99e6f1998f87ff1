"""Import nccl-tests output (``all_reduce_perf``, ``all_gather_perf``...) as the fabric's
measured message-size curve.

The text table nccl-tests prints (NVIDIA/nccl-tests ``src/common.cu``)::

    # nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 ...
    #  Rank  0 Group  0 Pid  58680 on       sw53 device  0 [0xb1] Tesla V100-PCIE-32GB
    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
               8             2     float     sum      -1    17.39    0.00    0.00      0    16.26    0.00    0.00      0
    # Avg bus bandwidth    : 188.648

(lines may carry an MPI prefix such as ``[1,0]<stdout>:``). The operation comes from the
file name (``all_reduce_perf.txt``) or a ``Collective test starting: all_reduce_perf``
line; the number of ranks from the ``#  Rank N`` lines.

The JSON file ``-J FILE.json`` (``--output_file``) writes (NVIDIA/nccl-tests ``src/util.cu``,
``JSON_FILE_VERSION 2``; one object, written by process 0 only)::

    {"version": 2, "start_time": "...", "args": ["./build/all_reduce_perf", "-b", "8", ...],
     "env": [...], "nccl_version": 22703,
     "config": {"nthreads": 1, "ngpus": 8, "minimum_bytes": 8, ..., "devices": [
         {"rank": 0, "group": 0, "pid": 1, "hostname": "sw53", "device": 0, ...}]},
     "results": [{"size": 8, "count": 2, "type": "float", "redop": "sum", "root": "    -1",
                  "out_of_place": {"time": 17.39, "alg_bw": 0.0, "bus_bw": 0.0, "nwrong": 0},
                  "in_place": {...}, "actual_iterations": 20, "experiment_name": ""}],
     "out_of_bounds": {...}, "average_bus_bandwidth": {"bandwidth": 188.6, "okay": "..."},
     "errors": [], "end_time": "..."}

``devices`` holds one entry per *process* (its first rank), so the ranks are ``nthreads x
ngpus x len(devices)``; ``time`` is ``cpu_time`` under ``-C 1``; ``out_of_place`` is null
where it was not run; a NaN is the string ``"nan"``. The operation comes from ``args[0]``
(``all_reduce_perf``), else the file name. A JSON file cut short (the test was killed before
it closed the object) keeps the size rows written before the cut, and says so. Which of the
two a file is comes from its content (a JSON file starts with ``{``), not its name.

What a recording gets: each size row becomes one collective instance per placement (group
``nccl-tests out-of-place`` / ``nccl-tests in-place``), entered by every rank at the same
instant and left ``time`` µs later, so the recording's own curves (``rankscope curves``,
``diagnose --json``'s ``curves``) show nccl-tests' algbw/busbw per size with this project's
conventions (``nbytes`` is the rank's input: ``size / n`` for all-gather, reduce-scatter and
all-to-all, whose nccl-tests size is the total). One step is one size row. The report's
``details["nccl_tests"]`` keeps the table as printed (busbw per size and placement).

Bad input is a problem of the report, never a traceback, and the rest of the file is
imported: a size row that does not parse, or whose size or count is not an integer in
``0..2**62``, is left out; a time that is zero, negative, infinite or over 3.5 days (two of
them must fit one step the hub takes) leaves out its placement only; a rank or rank count
outside the hub's world is named and not used. Each is one problem line per file and reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from rankscope.collector import schema
from rankscope.hub.importers import (
    ImportReport,
    header,
    next_header,
    open_text,
    source_manifest,
)
from rankscope.hub.importers.kineto import op_name
from rankscope.hub.validate import Limits

KIND = "nccl-tests"

_PREFIX = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)")
_TEST = re.compile(r"(\w+?)_perf")
_GATHER_LIKE = {"all_gather", "reduce_scatter", "all_to_all"}
GAP_NS = 1_000_000
"""Time between two imported instances (they ran one after the other)."""
MAX_RANKS = Limits.max_world_size
"""Ranks must lie below this many (the hub's largest world)."""
MAX_BYTES = schema.MAX_TIME_NS
"""Largest message size taken (2**62, what every reader's columns hold)."""
MAX_TIME_US = (Limits.max_duration_s * 1e9 - GAP_NS) / 2 / 1000
"""Longest time taken (3.5 days): a size row's two instances, one after the other, then
fit in one step the hub takes (7 days)."""


@dataclass
class Table:
    """One nccl-tests table: per size row, out-of-place and in-place time/algbw/busbw."""

    op: str = "other"
    hosts: dict[int, str] = field(default_factory=dict)
    rows: list[tuple[int, int, float, float, float, float, float, float]] = field(
        default_factory=list
    )
    """(size B, count, oop time µs, oop algbw, oop busbw, ip time µs, ip algbw, ip busbw)"""
    avg_busbw: float | None = None
    rows_are: str = "table row(s)"
    """What this table's rows are called in a problem line."""
    left_out: dict[str, int] = field(default_factory=dict)
    """What was left out, by what it is and why (completes "N ... left out")."""

    def leave_out(self, what: str) -> None:
        """Count one thing left out (``what`` says what it is and why)."""
        self.left_out[what] = self.left_out.get(what, 0) + 1

    def add(self, size: Any, count: Any, oop: tuple[float, ...], inp: tuple[float, ...]) -> None:
        """Add one size row (placements as ``(time µs, algbw, busbw)``). A row whose size or
        count is not an integer in ``0..MAX_BYTES`` is left out; a time that cannot be
        (zero, negative, infinite, over `MAX_TIME_US`) is left out, its placement then
        not run (NaN)."""
        for name, v in (("size", size), ("count", count)):
            if not _is_int(v, 0, MAX_BYTES):
                self.leave_out(f"{self.rows_are} whose {name} is not an integer in 0..2**62")
                return
        self.rows.append((size, count, *self._timed(oop), *self._timed(inp)))

    def _timed(self, place: tuple[float, ...]) -> tuple[float, ...]:
        """``place`` with a time that cannot be (`add`) left out as NaN."""
        t = place[0]
        if t != t or 0 < t <= MAX_TIME_US:
            return place
        self.leave_out("time(s) that are zero, negative, infinite or over 3.5 days")
        return (float("nan"), *place[1:])


def _num(tok: str) -> float:
    return float(tok) if tok not in ("N/A", "-", "") else float("nan")


def parse_text(path: Path, report: ImportReport) -> Table | None:
    """The table of one nccl-tests output file (rows that do not parse are counted; a
    file that cannot be read to its end keeps the rows before)."""
    t = Table()
    m = _TEST.search(path.name)
    if m:
        t.op = op_name(m.group(1))
    try:
        with open_text(path) as f:
            for raw in f:
                _text_line(t, _PREFIX.sub("", raw.rstrip("\n")).strip())
    except OSError as exc:
        if not t.rows:
            report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
            return None
        report.problem(
            path,
            f"cannot be read to its end ({exc.strerror or exc}); the {len(t.rows)} size "
            "row(s) before imported",
        )
    return _checked(t, path, report, "file name or test line")


def _text_line(t: Table, s: str) -> None:
    """Take one stripped line of a text table into ``t``."""
    if not s:
        return
    if s.startswith("#"):
        _comment_line(t, s)
        return
    tok = s.split()
    if not tok[0].isdigit():
        return
    if len(tok) < 13:
        t.leave_out(f"{t.rows_are} that do not parse")
        return
    try:
        o, i = tok[-8:-4], tok[-4:]
        size, count = int(tok[0]), int(tok[1])
        oop = (_num(o[0]), _num(o[1]), _num(o[2]))
        inp = (_num(i[0]), _num(i[1]), _num(i[2]))
    except ValueError:
        t.leave_out(f"{t.rows_are} that do not parse")
        return
    t.add(size, count, oop, inp)


def _comment_line(t: Table, s: str) -> None:
    """Take one ``#`` line of a text table into ``t``: a rank's host, the test's name, the
    average bus bandwidth."""
    rk = _RANK.match(s)
    if rk:
        rank = rk.group(1)
        if len(rank) < 8 and int(rank) < MAX_RANKS:
            t.hosts[int(rank)] = rk.group(2)
        else:
            t.leave_out(f"rank line(s) naming a rank over {MAX_RANKS - 1}")
    elif "Collective test starting:" in s:
        m = _TEST.search(s)
        if m:
            t.op = op_name(m.group(1))
    elif s.startswith("# Avg bus bandwidth"):
        try:
            t.avg_busbw = float(s.split(":")[1])
        except (IndexError, ValueError):
            pass


def _checked(t: Table, path: Path, report: ImportReport, named_by: str) -> Table | None:
    """``t`` once read, with its problems reported: what was left out, no size row at all
    (then None), an unnamed collective."""
    for what, n in t.left_out.items():
        report.problem(path, f"{n} {what} left out")
    if not t.rows:
        report.problem(path, "holds no nccl-tests size row; left out")
        return None
    if t.op == "other":
        report.problem(path, f"the collective is not named ({named_by}); 'other'")
    return t


_SNIFF = 4096


def is_json(path: Path) -> bool:
    """Whether ``path`` holds nccl-tests' ``-J`` JSON (its first non-blank byte is ``{``).

    Raises:
        OSError: the file cannot be read.
    """
    with open_text(path) as f:
        head = f.read(_SNIFF).lstrip(" \t\r\n\ufeff")
    return head.startswith("{")


def _salvage(text: str) -> dict[str, Any]:
    """What a truncated ``-J`` file wrote before the cut: ``args``, ``config`` and the
    complete ``results`` rows."""
    dec = json.JSONDecoder()
    doc: dict[str, Any] = {"results": _results_salvage(text, dec)}
    for key in ("args", "config"):
        m = re.search(rf'"{key}"\s*:\s*', text)
        if m is not None:
            try:
                doc[key] = dec.raw_decode(text, m.end())[0]
            except (ValueError, RecursionError):
                pass
    return doc


def _results_salvage(text: str, dec: json.JSONDecoder) -> list[Any]:
    m = re.search(r'"results"\s*:\s*\[', text)
    if m is None:
        return []
    out: list[Any] = []
    i = m.end()
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != "{":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return out
        out.append(obj)


def _json_float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("a boolean where a number belongs")
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        return _num(v.strip()) if v.strip().lower() != "nan" else float("nan")
    raise ValueError(f"{v!r} is not a number")


def _placement(obj: Any) -> tuple[float, float, float]:
    """(time µs, algbw, busbw) of one ``out_of_place`` / ``in_place`` entry (NaN when null)."""
    if obj is None:
        nan = float("nan")
        return nan, nan, nan
    if not isinstance(obj, dict):
        raise ValueError("a placement that is not an object")
    t = obj.get("time", obj.get("cpu_time"))
    return _json_float(t), _json_float(obj.get("alg_bw")), _json_float(obj.get("bus_bw"))


def _load(path: Path, report: ImportReport) -> dict[str, Any] | None:
    """The document of one ``-J`` file: whole, or the complete rows before a cut (said);
    None when there is none (said)."""
    try:
        with open_text(path) as f:
            text = f.read()
    except OSError as exc:
        report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # RecursionError: values nested deeper than the parser goes; read as not JSON.
        doc = _salvage(text)
        if not doc["results"]:
            cut = isinstance(exc, json.JSONDecodeError) and exc.pos >= len(text.rstrip())
            what = "is JSON cut short before its first complete size row" if cut else "is not JSON"
            report.problem(path, f"{what} ({exc}); left out")
            return None
        report.problem(
            path,
            f"is cut short ({exc}); the {len(doc['results'])} complete size row(s) before "
            "the cut imported",
        )
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        report.problem(path, 'is JSON but not nccl-tests -J output (no "results" list); left out')
        return None
    return doc


def _hosts(cfg: dict[str, Any], t: Table, path: Path, report: ImportReport) -> None:
    """The host of each rank from ``config`` (``devices``: one entry per process, its first
    rank, ``nthreads x ngpus`` ranks each); values that cannot be are named."""
    raw = cfg.get("devices")
    devices = [d for d in raw if isinstance(d, dict)] if isinstance(raw, list) else []
    if raw is not None and not isinstance(raw, list):
        report.problem(path, "config devices is not a list; hosts unknown")
    nthreads, ngpus = cfg.get("nthreads", 1), cfg.get("ngpus", 1)
    per_proc = 1
    if _is_int(nthreads, 1, MAX_RANKS) and _is_int(ngpus, 1, MAX_RANKS):
        per_proc = nthreads * ngpus
    else:
        report.problem(
            path, f"config nthreads x ngpus is not a rank count in 1..{MAX_RANKS}; one rank each"
        )
    if per_proc * len(devices) > MAX_RANKS:
        report.problem(path, f"config devices hold more than {MAX_RANKS} ranks; one rank each")
        per_proc = 1
        devices = devices[:MAX_RANKS]
    unranked = 0
    for p, d in enumerate(devices):
        first = d.get("rank", p * per_proc)
        if not _is_int(first, 0, MAX_RANKS - per_proc):
            unranked += 1
            first = p * per_proc
        host = d.get("hostname")
        for k in range(per_proc):
            t.hosts[first + k] = host if isinstance(host, str) and host else "unknown"
    if unranked:
        report.problem(
            path,
            f"{unranked} config device(s) whose rank is not an integer in "
            f"0..{MAX_RANKS - 1}; numbered in order",
        )


def _is_int(v: Any, lo: int, hi: int) -> TypeGuard[int]:
    """Whether ``v`` is an integer (not a boolean) in ``lo..hi``."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def parse_json(path: Path, report: ImportReport) -> Table | None:
    """The table of one nccl-tests ``-J`` JSON file (module docstring); rows that do not
    parse are counted, a file cut short keeps its complete rows."""
    doc = _load(path, report)
    if doc is None:
        return None
    t = Table(rows_are="result row(s)")
    args = doc.get("args")
    first = args[0] if isinstance(args, list) and args else None
    m = _TEST.search(Path(first).name) if isinstance(first, str) else None
    m = m or _TEST.search(path.name)
    if m:
        t.op = op_name(m.group(1))
    cfg = doc.get("config")
    _hosts(cfg if isinstance(cfg, dict) else {}, t, path, report)
    avg = doc.get("average_bus_bandwidth")
    if isinstance(avg, dict):
        try:
            t.avg_busbw = _json_float(avg.get("bandwidth"))
        except ValueError:
            pass
    for r in doc["results"]:
        try:
            if not isinstance(r, dict) or "size" not in r:
                raise ValueError("a row that is not an object with a size")
            oop = _placement(r.get("out_of_place"))
            inp = _placement(r.get("in_place"))
        except ValueError:
            t.leave_out(f"{t.rows_are} that do not parse")
            continue
        t.add(r["size"], r.get("count", 0), oop, inp)
    return _checked(t, path, report, "args[0] or file name")


def read_table(path: Path, report: ImportReport) -> Table | None:
    """The table of one nccl-tests output file, text or ``-J`` JSON (told by content)."""
    try:
        js = is_json(path)
    except OSError as exc:
        report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
        return None
    except (EOFError, ValueError) as exc:  # a broken gzip stream
        report.problem(path, f"cannot be read ({exc}); left out")
        return None
    return parse_json(path, report) if js else parse_text(path, report)


def messages(files: list[Path], report: ImportReport, *, job: str, run: str) -> Iterator[bytes]:
    """Wire messages of nccl-tests output files, text or JSON (module docstring)."""
    tables: list[tuple[str, Table]] = []
    for f in files:
        t = read_table(f, report)
        if t is not None:
            tables.append((str(f), t))
    if not tables:
        return
    n = max(max(len(t.hosts), 1) for _, t in tables)
    report.lack("per-rank arrival and skew (nccl-tests reports one time per size)")
    report.lack("steps (one step is one size row)")
    report.lack("phases, tokens and device samples")
    report.files_read = [f for f, _ in tables]
    report.details["nccl_tests"] = [
        {
            "file": Path(f).name,
            "op": t.op,
            "ranks": max(len(t.hosts), 1),
            "avg_busbw_gbps": t.avg_busbw,
            "points": [
                {
                    "size": r[0],
                    "out_of_place": {"time_us": r[2], "algbw_gbps": r[3], "busbw_gbps": r[4]},
                    "in_place": {"time_us": r[5], "algbw_gbps": r[6], "busbw_gbps": r[7]},
                }
                for r in t.rows
            ],
        }
        for f, t in tables
    ]
    hosts: dict[int, str] = {}
    for _, t in tables:
        for r, h in t.hosts.items():
            hosts.setdefault(r, h)
    src = source_manifest(KIND, report.files_read, report.lacks)
    headers = {r: header(job, run, r) for r in range(n)}
    for r in range(n):
        ident = {
            "rank": r,
            "world_size": n,
            "local_rank": 0,
            "host": hosts.get(r, "unknown")[: schema.MAX_NAME_CHARS],
            "node_rank": -1,
            "pid": 0,
        }
        yield schema.hello_message(next_header(headers[r]), ident, manifest={"source": src})
    yield schema.groups_message(
        next_header(headers[0]),
        [
            {
                "id": 0,
                "name": "nccl-tests out-of-place",
                "ranks": list(range(n)),
                "backend": "nccl",
                "desc": "nccl-tests, out-of-place buffers",
            },
            {
                "id": 1,
                "name": "nccl-tests in-place",
                "ranks": list(range(n)),
                "backend": "nccl",
                "desc": "nccl-tests, in-place buffers",
            },
        ],
    )
    arr = instances(tables, report)
    seq = np.zeros(arr.shape[0], np.int64)
    for g in (0, 1):
        sel = arr[:, 2] == g
        seq[sel] = np.arange(int(sel.sum()))
    steps = np.unique(arr[:, 0])
    for r in range(n):
        st = schema.empty_table("steps", steps.shape[0])
        st["step"] = steps
        st["t_start"] = np.array([arr[arr[:, 0] == s, 4].min() for s in steps], np.int64)
        st["t_end"] = np.array([arr[arr[:, 0] == s, 5].max() for s in steps], np.int64)
        co: dict[str, Any] = {
            "step": arr[:, 0],
            "op": arr[:, 1].astype(np.int8),
            "group": arr[:, 2].astype(np.int32),
            "seq": seq,
            "nbytes": arr[:, 3],
            "t_enter": arr[:, 4],
            "t_start": arr[:, 4],
            "t_end": arr[:, 5],
            "t_exit": arr[:, 5],
            "flags": np.full(arr.shape[0], schema.FLAG_DEVICE_TIMED, np.int32),
        }
        yield schema.steps_message(next_header(headers[r]), st, None, co)


def instances(tables: list[tuple[str, Table]], report: ImportReport) -> np.ndarray:
    """Rows ``(step, op, group, nbytes, t0, t1)``: per size row, out-of-place then
    in-place, one after the other from time 0. Rows that would end past
    ``schema.MAX_TIME_NS`` are left out and named."""
    rows: list[tuple[int, int, int, int, int, int]] = []
    now = 0
    step = 0
    for file, tab in tables:
        op = schema.OP_INDEX[tab.op]
        nt = max(len(tab.hosts), 1)
        late = 0
        for row in tab.rows:
            per_rank = row[0] // nt if tab.op in _GATHER_LIKE else row[0]
            for g, us in ((0, row[2]), (1, row[5])):
                if not np.isfinite(us) or us <= 0:
                    continue
                d = round(us * 1000)
                if now + d > schema.MAX_TIME_NS:
                    late += 1
                    continue
                rows.append((step, op, g, per_rank, now, now + d))
                now += d + GAP_NS
            step += 1
        if late:
            report.problem(file, f"{late} time(s) past 2**62 ns of the imported timeline left out")
    return np.array(rows, np.int64).reshape(len(rows), 6)
