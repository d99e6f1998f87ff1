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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

KIND = "nccl-tests"

_PREFIX = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")
_RANK = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)")
_TEST = re.compile(r"(\w+?)_perf")
_GATHER_LIKE = {"all_gather", "reduce_scatter", "all_to_all"}
GAP_NS = 1_000_000
"""Time between two imported instances (they ran one after the other)."""


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


def _num(tok: str) -> float:
    return float(tok) if tok not in ("N/A", "-", "") else float("nan")


def parse_text(path: Path, report: ImportReport) -> Table | None:
    """The table of one nccl-tests output file (rows that do not parse are counted)."""
    t = Table()
    m = _TEST.search(path.name)
    if m:
        t.op = op_name(m.group(1))
    bad = 0
    try:
        with open_text(path) as f:
            for raw in f:
                line = _PREFIX.sub("", raw.rstrip("\n"))
                s = line.strip()
                if not s:
                    continue
                if s.startswith("#"):
                    rk = _RANK.match(s)
                    if rk:
                        t.hosts[int(rk.group(1))] = rk.group(2)
                    elif "Collective test starting:" in s:
                        m = _TEST.search(s)
                        if m:
                            t.op = op_name(m.group(1))
                    elif s.startswith("# Avg bus bandwidth"):
                        try:
                            t.avg_busbw = float(s.split(":")[1])
                        except (IndexError, ValueError):
                            pass
                    continue
                tok = s.split()
                if not tok[0].isdigit():
                    continue
                if len(tok) < 13:
                    bad += 1
                    continue
                try:
                    o, i = tok[-8:-4], tok[-4:]
                    t.rows.append(
                        (
                            int(tok[0]),
                            int(tok[1]),
                            _num(o[0]),
                            _num(o[1]),
                            _num(o[2]),
                            _num(i[0]),
                            _num(i[1]),
                            _num(i[2]),
                        )
                    )
                except ValueError:
                    bad += 1
    except OSError as exc:
        report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
        return None
    return _checked(t, path, report, bad, "table row(s)", "file name or test line")


def _checked(
    t: Table, path: Path, report: ImportReport, bad: int, rows: str, named_by: str
) -> Table | None:
    """``t`` once read, with its problems reported: rows that did not parse, no size row
    at all (then None), an unnamed collective."""
    if bad:
        report.problem(path, f"{bad} {rows} that do not parse left out")
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
            except ValueError:
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
        except ValueError:
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


def parse_json(path: Path, report: ImportReport) -> Table | None:
    """The table of one nccl-tests ``-J`` JSON file (module docstring); rows that do not
    parse are counted, a file cut short keeps its complete rows."""
    try:
        with open_text(path) as f:
            text = f.read()
    except OSError as exc:
        report.problem(path, f"cannot be read ({exc.strerror or exc}); left out")
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
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
    t = Table()
    args = doc.get("args")
    m = _TEST.search(Path(str(args[0])).name) if isinstance(args, list) and args else None
    m = m or _TEST.search(path.name)
    if m:
        t.op = op_name(m.group(1))
    raw_cfg = doc.get("config")
    cfg: dict[str, Any] = raw_cfg if isinstance(raw_cfg, dict) else {}
    devices = [d for d in cfg.get("devices") or () if isinstance(d, dict)]
    try:
        per_proc = max(int(cfg.get("nthreads", 1)) * int(cfg.get("ngpus", 1)), 1)
    except (TypeError, ValueError):
        per_proc = 1
    for p, d in enumerate(devices):
        try:
            first = int(d.get("rank", p * per_proc))
        except (TypeError, ValueError):
            first = p * per_proc
        for k in range(per_proc):
            t.hosts[first + k] = str(d.get("hostname") or "unknown")
    avg = doc.get("average_bus_bandwidth")
    if isinstance(avg, dict):
        try:
            t.avg_busbw = _json_float(avg.get("bandwidth"))
        except ValueError:
            pass
    bad = 0
    for r in doc["results"]:
        try:
            if not isinstance(r, dict):
                raise ValueError("a row that is not an object")
            oop = _placement(r.get("out_of_place"))
            inp = _placement(r.get("in_place"))
            t.rows.append((int(r["size"]), int(r.get("count", 0)), *oop, *inp))
        except (KeyError, TypeError, ValueError):
            bad += 1
    return _checked(t, path, report, bad, "result row(s)", "args[0] or file name")


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
    # Instances: per table row, out-of-place then in-place, one after the other.
    rows: list[tuple[int, int, int, int, int, int]] = []  # step, op, group, nbytes, t0, t1
    now = 0
    step = 0
    for _, tab in tables:
        op = schema.OP_INDEX[tab.op]
        nt = max(len(tab.hosts), 1)
        for row in tab.rows:
            per_rank = row[0] // nt if tab.op in _GATHER_LIKE else row[0]
            for g, us in ((0, row[2]), (1, row[5])):
                if not np.isfinite(us) or us <= 0:
                    continue
                d = round(us * 1000)
                rows.append((step, op, g, per_rank, now, now + d))
                now += d + GAP_NS
            step += 1
    arr = np.array(rows, np.int64).reshape(len(rows), 6)
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
