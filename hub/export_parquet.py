"""Export a whole recording as Parquet tables, for DuckDB, Polars, Spark and pandas.

`write_parquet` streams the recording (`read_frames`, then the wire schema's decode of each
message) into four files in one folder, a row group at a time, so a recording larger than
memory exports in bounded memory (``batch_rows`` rows per table in flight, plus the rows of
collective instances not yet matched):

``steps.parquet``
    One row per rank and step as the rank sent it: ``run``, ``rank``, ``inc`` and every
    step column of the wire schema (times in int64 ns on the hub-aligned clock; -1 or NaN
    where unknown, as on the wire).
``phases.parquet``
    One row per phase span: ``run``, ``rank``, ``step``, ``phase`` (its name), ``t0``,
    ``t1``, ``cpu_ns``.
``collectives.parquet``
    One row per collective call on one rank: ``run``, ``rank``, ``step``, ``op`` (its
    name), ``group``, ``seq``, ``nbytes``, ``t_enter``, ``t_start``, ``t_end``, ``t_exit``,
    ``flags``.
``instances.parquet``
    One row per matched collective instance ``(run, group, seq)`` (ARCHITECTURE §6):
    ``op``, ``step`` and ``nbytes`` of its last arriver, ``n_members`` (-1 when the group
    table never came), ``n_arrived``, ``first_ns`` / ``last_ns`` (first and last entry),
    ``skew_ns``, ``last_rank``, ``margin_ns`` (last entry minus the second last),
    ``transfer_ns`` (median over the arrived ranks of exit minus the last entry),
    ``first_exit_ns``, ``last_exit_ns``, ``complete``. An instance is written once all its
    members arrived, or, incomplete, once its run is ``lag_steps`` steps past it, or at
    the end of the recording.

The tables hold what the recording holds: every message the schema decodes, of every run
(or one, ``run``); a step a rank sent twice appears twice. Where a relay reduced a node's
collectives (`hub.reduce`), their instances are in ``instances.parquet`` but their rows are
not in ``collectives.parquet``. Messages that do not decode are
left out and counted (`ParquetSummary.undecodable`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rankscope.collector import schema
from rankscope.hub.partial import PartError, PartStore, combine
from rankscope.hub.reduce import unpack_node

QUERIES: dict[str, str] = {
    "steps.parquet": (
        "SELECT rank, avg(t_end - t_start) / 1e6 AS step_ms FROM '{dir}/steps.parquet' "
        "GROUP BY rank ORDER BY step_ms DESC LIMIT 5"
    ),
    "phases.parquet": (
        "SELECT phase, sum(t1 - t0) / 1e6 AS total_ms FROM '{dir}/phases.parquet' "
        "GROUP BY phase ORDER BY total_ms DESC"
    ),
    "collectives.parquet": (
        "SELECT c.rank, avg(c.t_enter - i.first_ns) / 1e3 AS late_us "
        "FROM '{dir}/collectives.parquet' c "
        "JOIN '{dir}/instances.parquet' i USING (run, \"group\", seq) "
        "GROUP BY c.rank ORDER BY late_us DESC LIMIT 5"
    ),
    "instances.parquet": (
        "SELECT last_rank, count(*) AS times_last, median(skew_ns) / 1e3 AS skew_us "
        "FROM '{dir}/instances.parquet' WHERE complete "
        "GROUP BY last_rank ORDER BY times_last DESC LIMIT 5"
    ),
}
"""One DuckDB query per table (``{dir}``: the export folder): the slowest ranks' mean step
time, time per phase, mean lateness per rank (a join with the instances), and who arrives
last how often, with the median skew."""

FILES = ("steps.parquet", "phases.parquet", "collectives.parquet", "instances.parquet")
BATCH_ROWS = 1 << 18
"""Rows of one table gathered before they are written as a row group."""
COMPACT_PARTS = 2048
"""Parts (a message's rows each) a table gathers before joining them into one."""
LAG_STEPS = 8
"""Steps a run moves past an instance before it is written incomplete."""

_OPS_OUT = (*schema.OPS, "unknown")


class ParquetUnavailable(RuntimeError):
    """pyarrow is not installed."""


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ParquetUnavailable(
            "Parquet export needs pyarrow: pip install 'rankscope[parquet]' (or pyarrow)"
        ) from None
    return pa, pq


@dataclass
class ParquetSummary:
    """What `write_parquet` wrote."""

    folder: str
    rows: dict[str, int] = field(default_factory=dict)
    """File name -> rows written."""
    row_groups: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    """Messages decoded."""
    undecodable: int = 0
    """Messages the wire schema refused (left out)."""
    runs: list[str] = field(default_factory=list)
    """Every run the recording holds (exported or not)."""


class _Table:
    """One output file: columns gathered in numpy, written a row group at a time."""

    def __init__(self, pq: Any, pa: Any, path: Path, schema_: Any, batch_rows: int) -> None:
        self.pa = pa
        self.schema = schema_
        self.writer = pq.ParquetWriter(str(path), schema_, compression="zstd")
        self.batch_rows = batch_rows
        self.parts: dict[str, list[Any]] = {name: [] for name in schema_.names}
        self.pending = 0
        self.rows = 0
        self.groups = 0

    def add(self, n: int, cols: dict[str, Any]) -> None:
        if n == 0:
            return
        for name, part in cols.items():
            self.parts[name].append(part)
        self.pending += n
        if self.pending >= self.batch_rows:
            self.flush()
        elif len(self.parts[self.schema.names[0]]) >= COMPACT_PARTS:
            self._compact()

    def _compact(self) -> None:
        """Join the gathered parts into one per column: a part per message costs far more
        than its rows where messages hold a row or two (the steps table)."""
        for f in self.schema:
            parts = self.parts[f.name]
            if self.pa.types.is_dictionary(f.type):
                # (codes, names) parts: one dictionary for all of them.
                at: dict[str, int] = {}
                codes = []
                for c, dictionary in parts:
                    remap = np.array([at.setdefault(s, len(at)) for s in dictionary], np.int32)
                    codes.append(remap[c] if remap.size else np.zeros(0, np.int32))
                self.parts[f.name] = [(np.concatenate(codes), list(at))]
            else:
                self.parts[f.name] = [np.concatenate(parts)]

    def flush(self) -> None:
        if not self.pending:
            return
        pa = self.pa
        self._compact()
        arrays = []
        for f in self.schema:
            (part,) = self.parts[f.name]
            if pa.types.is_dictionary(f.type):
                codes, names = part
                arrays.append(
                    pa.DictionaryArray.from_arrays(
                        pa.array(codes, pa.int32()), pa.array(names, pa.string())
                    )
                )
            else:
                arrays.append(pa.array(part, f.type))
        self.writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema))
        self.rows += self.pending
        self.groups += 1
        self.pending = 0
        self.parts = {name: [] for name in self.schema.names}

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _schemas(pa: Any) -> dict[str, Any]:
    name = pa.dictionary(pa.int32(), pa.string())
    ints = {"i": pa.int32(), "l": pa.int64(), "b": pa.int8(), "h": pa.int16()}

    def of(dt: np.dtype) -> Any:
        if dt.kind == "f":
            return pa.float64() if dt.itemsize == 8 else pa.float32()
        return {1: ints["b"], 2: ints["h"], 4: ints["i"], 8: ints["l"]}[dt.itemsize]

    head = [("run", name), ("rank", pa.int32())]
    return {
        "steps.parquet": pa.schema(
            [*head, ("inc", pa.int32()), *((c, of(dt)) for c, dt in schema.STEP_COLUMNS.items())]
        ),
        "phases.parquet": pa.schema(
            [
                *head,
                ("step", pa.int64()),
                ("phase", name),
                ("t0", pa.int64()),
                ("t1", pa.int64()),
                ("cpu_ns", pa.int64()),
            ]
        ),
        "collectives.parquet": pa.schema(
            [
                *head,
                ("step", pa.int64()),
                ("op", name),
                *((c, of(dt)) for c, dt in schema.COLL_COLUMNS.items() if c not in ("step", "op")),
            ]
        ),
        "instances.parquet": pa.schema(
            [
                ("run", name),
                ("group", pa.int32()),
                ("seq", pa.int64()),
                ("op", name),
                ("step", pa.int64()),
                ("nbytes", pa.int64()),
                ("n_members", pa.int32()),
                ("n_arrived", pa.int32()),
                ("first_ns", pa.int64()),
                ("last_ns", pa.int64()),
                ("skew_ns", pa.int64()),
                ("last_rank", pa.int32()),
                ("margin_ns", pa.int64()),
                ("transfer_ns", pa.float64()),
                ("first_exit_ns", pa.int64()),
                ("last_exit_ns", pa.int64()),
                ("complete", pa.bool_()),
            ]
        ),
    }


_MATCH_COLS = ("run", "group", "seq", "step", "rank", "op", "nbytes", "t_enter", "t_exit")


class _Matcher:
    """Collective rows in, instances out, holding only the rows of open instances."""

    def __init__(self, out: _Table, runs: list[str], lag_steps: int) -> None:
        self.out = out
        self.runs = runs
        self.lag = lag_steps
        self.members: dict[tuple[int, int], int] = {}
        """(run code, group id) -> ranks in the group."""
        self.max_step: dict[int, int] = {}
        self.parts: list[dict[str, np.ndarray]] = []
        self.new = 0
        self.open: dict[str, np.ndarray] | None = None

    def add(self, run: int, rank: int, colls: dict[str, np.ndarray]) -> None:
        n = colls["step"].shape[0]
        if not n:
            return
        self.parts.append(
            {
                "run": np.full(n, run, np.int32),
                "group": colls["group"].astype(np.int64),
                "seq": colls["seq"].astype(np.int64),
                "step": colls["step"].astype(np.int64),
                "rank": np.full(n, rank, np.int64),
                "op": colls["op"].astype(np.int64),
                "nbytes": colls["nbytes"].astype(np.int64),
                "t_enter": colls["t_enter"].astype(np.int64),
                "t_exit": colls["t_exit"].astype(np.int64),
            }
        )
        self.max_step[run] = max(self.max_step.get(run, -(2**62)), int(colls["step"].max()))
        self.new += n
        if self.new >= self.out.batch_rows:
            self.match(final=False)

    def match(self, final: bool) -> None:
        parts = self.parts if self.open is None else [self.open, *self.parts]
        self.parts, self.new = [], 0
        if not parts:
            return
        rows = {k: np.concatenate([p[k] for p in parts]) for k in _MATCH_COLS}
        order = np.lexsort((rows["t_enter"], rows["seq"], rows["group"], rows["run"]))
        rows = {k: v[order] for k, v in rows.items()}
        n = order.shape[0]
        change = np.ones(n, dtype=bool)
        change[1:] = (
            (rows["run"][1:] != rows["run"][:-1])
            | (rows["group"][1:] != rows["group"][:-1])
            | (rows["seq"][1:] != rows["seq"][:-1])
        )
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], n)
        counts = ends - starts
        run_k, group_k = rows["run"][starts], rows["group"][starts]
        members = np.array(
            [self.members.get((int(r), int(g)), -1) for r, g in zip(run_k, group_k)],
            dtype=np.int64,
        ).reshape(-1)
        last = ends - 1
        complete = (members > 0) & (counts >= members)
        if final:
            done = np.ones(starts.shape[0], dtype=bool)
        else:
            newest = np.array([self.max_step[int(r)] for r in run_k], dtype=np.int64).reshape(-1)
            done = complete | (rows["step"][last] < newest - self.lag)
        key_of_row = np.repeat(np.arange(starts.shape[0]), counts)
        keep = ~done[key_of_row]
        self.open = {k: v[keep] for k, v in rows.items()} if keep.any() else None
        if done.any():
            self._write(rows, starts[done], ends[done], members[done], complete[done])

    def _write(
        self,
        rows: dict[str, np.ndarray],
        starts: np.ndarray,
        ends: np.ndarray,
        members: np.ndarray,
        complete: np.ndarray,
    ) -> None:
        counts = ends - starts
        last = ends - 1
        enter, exit_ = rows["t_enter"], rows["t_exit"]
        last_ns = enter[last]
        second = np.where(counts >= 2, enter[np.maximum(last - 1, starts)], last_ns)
        # Transfer: exit minus the instance's last entry, median over the rows with an exit.
        key = np.repeat(np.arange(starts.shape[0]), counts)
        at = np.cumsum(counts) - counts
        rows_at = np.repeat(starts - at, counts) + np.arange(int(counts.sum()))
        xfer = np.where(exit_[rows_at] >= 0, exit_[rows_at] - last_ns[key], np.nan)
        by = np.lexsort((np.nan_to_num(xfer, nan=np.inf), key))
        known = np.bincount(key, weights=np.isfinite(xfer), minlength=starts.shape[0])
        known = known.astype(np.int64)
        sx = xfer[by]
        lo = at + np.maximum(known - 1, 0) // 2
        hi = at + known // 2
        transfer = np.where(known > 0, (sx[lo] + sx[hi]) / 2, np.nan)
        ex = np.where(exit_[rows_at] >= 0, exit_[rows_at], np.iinfo(np.int64).max)
        first_exit = np.minimum.reduceat(ex, at) if at.size else ex[:0]
        ex2 = np.where(exit_[rows_at] >= 0, exit_[rows_at], -1)
        last_exit = np.maximum.reduceat(ex2, at) if at.size else ex2[:0]
        first_exit = np.where(first_exit == np.iinfo(np.int64).max, -1, first_exit)
        op = rows["op"][last]
        op = np.where((op >= 0) & (op < len(schema.OPS)), op, len(schema.OPS))
        self.out.add(
            starts.shape[0],
            {
                "run": (rows["run"][starts].astype(np.int32), list(self.runs)),
                "group": rows["group"][starts].astype(np.int32),
                "seq": rows["seq"][starts],
                "op": (op.astype(np.int32), list(_OPS_OUT)),
                "step": rows["step"][last],
                "nbytes": rows["nbytes"][last],
                "n_members": members.astype(np.int32),
                "n_arrived": counts.astype(np.int32),
                "first_ns": enter[starts],
                "last_ns": last_ns,
                "skew_ns": last_ns - enter[starts],
                "last_rank": rows["rank"][last].astype(np.int32),
                "margin_ns": last_ns - second,
                "transfer_ns": transfer,
                "first_exit_ns": first_exit,
                "last_exit_ns": last_exit,
                "complete": complete,
            },
        )


def _messages(path: str | Path, summary: ParquetSummary) -> Iterable[schema.Message]:
    from rankscope.hub.recording import read_frames

    for frame in read_frames(path):
        try:
            msg = schema.decode(frame.payload)
        except schema.SchemaError:
            summary.undecodable += 1
            continue
        summary.messages += 1
        yield msg


def write_parquet(
    folder: str | Path,
    recording: str | Path,
    *,
    run: str | None = None,
    batch_rows: int = BATCH_ROWS,
    lag_steps: int = LAG_STEPS,
) -> ParquetSummary:
    """Write the Parquet tables of a recording into a folder (created when missing).

    Args:
        folder: output folder; existing files of the same names are replaced.
        recording: recording directory (or one segment file).
        run: only this run (all runs when None).
        batch_rows: rows of a table per row group (what is held before a write).
        lag_steps: see ``instances.parquet`` above.

    Returns:
        What was written.

    Raises:
        ParquetUnavailable: pyarrow is not installed.
        ValueError: ``folder`` exists and is not a folder.
        RecordingError: no recording at ``recording``, or a newer format.
    """
    pa, pq = _pyarrow()
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise ValueError(f"Parquet output {str(out)!r} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    summary = ParquetSummary(folder=str(out))
    schemas = _schemas(pa)
    tables = {name: _Table(pq, pa, out / name, schemas[name], batch_rows) for name in FILES}
    runs: list[str] = []
    codes: dict[str, int] = {}
    matcher = _Matcher(tables["instances.parquet"], runs, lag_steps)
    ranks: dict[tuple[int, int], np.ndarray] = {}
    """(run code, group) -> its members, ascending (to combine relays' parts)."""
    held: dict[int, PartStore] = {}
    try:
        seen: set[str] = set()
        for msg in _messages(recording, summary):
            h = msg.header
            if h["run"] not in seen:
                seen.add(h["run"])
                summary.runs.append(h["run"])
            if run is not None and h["run"] != run:
                continue
            code = codes.get(h["run"])
            if code is None:
                code = codes[h["run"]] = len(runs)
                runs.append(h["run"])
            if msg.kind == "groups":
                for g in h.get("groups") or []:
                    matcher.members[(code, int(g["id"]))] = len(g["ranks"])
                    ranks[(code, int(g["id"]))] = np.sort(np.asarray(g["ranks"], np.int64))
                continue
            if msg.kind == "reduced":  # a relay's: its ranks' rows, and what it matched
                _add_reduced(tables["instances.parquet"], msg.tables["instances"], code, runs)
                store = held.setdefault(code, PartStore())
                for inst in _combined(store, msg, code, ranks):
                    _add_reduced(tables["instances.parquet"], inst, code, runs)
                parts = [m for m in unpack_node(msg) if m.kind == "steps"]
            elif msg.kind == "steps":
                parts = [msg]
            else:
                continue
            for part in parts:
                rank = int(part.header["rank"])
                _add_steps(tables, part, code, runs, rank)
                colls = part.tables.get("colls")
                if colls is not None and colls["step"].shape[0]:
                    _add_colls(tables["collectives.parquet"], colls, code, runs, rank)
                    matcher.add(code, rank, colls)
        matcher.match(final=True)
    finally:
        for t in tables.values():
            t.close()
    summary.rows = {name: t.rows for name, t in tables.items()}
    summary.row_groups = {name: t.groups for name, t in tables.items()}
    return summary


def _add_steps(
    tables: dict[str, _Table], msg: schema.Message, code: int, runs: list[str], rank: int
) -> None:
    st = msg.tables["steps"]
    n = st["step"].shape[0]
    head = {
        "run": (np.full(n, code, np.int32), list(runs)),
        "rank": np.full(n, rank, np.int32),
    }
    tables["steps.parquet"].add(
        n, {**head, "inc": np.full(n, int(msg.header["inc"]), np.int32), **st}
    )
    ph = msg.tables.get("phases")
    if ph is None or not ph["step"].shape[0]:
        return
    m = ph["step"].shape[0]
    names = [*schema.PHASES, *(str(x) for x in msg.header.get("phase_names") or [])]
    codes = ph["phase"].astype(np.int64)
    codes = np.where((codes >= 0) & (codes < len(names)), codes, len(names))
    tables["phases.parquet"].add(
        m,
        {
            "run": (np.full(m, code, np.int32), list(runs)),
            "rank": np.full(m, rank, np.int32),
            "step": ph["step"],
            "phase": (codes.astype(np.int32), [*names, "unknown"]),
            "t0": ph["t0"],
            "t1": ph["t1"],
            "cpu_ns": ph["cpu_ns"],
        },
    )


def _combined(
    store: PartStore,
    msg: schema.Message,
    code: int,
    ranks: dict[tuple[int, int], np.ndarray],
) -> list[dict[str, np.ndarray]]:
    """The instances a node message's parts complete (`hub.partial`), as the hub combines
    them; shares that do not add up are left out, as the hub refuses them."""
    if "parts" not in msg.tables or "part_cells" not in msg.tables:
        return []
    tables = {
        name: msg.tables.get(name)
        or {c: np.zeros(0, dt) for c, dt in schema.REDUCED_TABLES[name].items()}
        for name in ("parts", "part_cells", "part_rows")
    }
    sizes = {gid: m.shape[0] for (c, gid), m in ranks.items() if c == code}
    done, _, _ = store.add(tables, sizes, set())
    out = []
    for key, (parts, pid, cells, rows) in (store.pop(done) if done else {}).items():
        members = ranks.get((code, key[0]))
        if members is None:
            continue
        try:
            out.append(combine(members, parts, pid, cells, rows).instances)
        except PartError:
            continue
    return out


def _add_reduced(table: _Table, inst: dict[str, np.ndarray], code: int, runs: list[str]) -> None:
    """The instances a relay matched on its node (`hub.reduce`): complete, every member
    arrived; their rows are not in the recording."""
    n = inst["group"].shape[0]
    if not n:
        return
    op = inst["op"].astype(np.int64)
    op = np.where((op >= 0) & (op < len(schema.OPS)), op, len(schema.OPS))
    table.add(
        n,
        {
            "run": (np.full(n, code, np.int32), list(runs)),
            "group": inst["group"],
            "seq": inst["seq"],
            "op": (op.astype(np.int32), list(_OPS_OUT)),
            "step": inst["step"],
            "nbytes": inst["nbytes"],
            "n_members": inst["n_members"],
            "n_arrived": inst["n_members"],
            "first_ns": inst["first"],
            "last_ns": inst["last"],
            "skew_ns": inst["last"] - inst["first"],
            "last_rank": inst["last_rank"],
            "margin_ns": np.nan_to_num(inst["margin"], nan=0.0).astype(np.int64),
            "transfer_ns": inst["transfer"],
            "first_exit_ns": inst["first_exit"],
            "last_exit_ns": inst["last_exit"],
            "complete": np.ones(n, bool),
        },
    )


def _add_colls(
    table: _Table, colls: dict[str, np.ndarray], code: int, runs: list[str], rank: int
) -> None:
    n = colls["step"].shape[0]
    op = colls["op"].astype(np.int64)
    op = np.where((op >= 0) & (op < len(schema.OPS)), op, len(schema.OPS))
    table.add(
        n,
        {
            "run": (np.full(n, code, np.int32), list(runs)),
            "rank": np.full(n, rank, np.int32),
            **{c: v for c, v in colls.items() if c != "op"},
            "op": (op.astype(np.int32), list(_OPS_OUT)),
        },
    )
