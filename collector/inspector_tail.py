"""Live NCCL Inspector: device-timed collectives from the plugin's growing output file.

With ``rankscope run --nccl-inspector PLUGIN.so`` (or ``rankscope.start(nccl_inspector=...)``
or ``RANKSCOPE_NCCL_INSPECTOR``) every rank loads NVIDIA's Inspector profiler plugin
(``NCCL_PROFILER_PLUGIN``, ``NCCL_INSPECTOR_ENABLE=1``, verbose, a 1 ms dump thread, a dump
directory per run). The plugin's dump thread appends one JSON object per line to
``<dump dir>/<hostname>-pid<pid>.log``: the latest completed collective of each
communicator that completed one since the previous dump. The Inspector therefore samples:
collectives that complete faster than its dump interval are not all written.

`InspectorTail` runs on the collector's background thread (a ``Pump`` task, never the
training thread). Each wake it reads what the file gained since the last one (at most
`READ_BYTES`), keeps a partial last line for later, counts and skips a line that is not
an Inspector record, finds files that appear late and starts over on a file that was
replaced or truncated. Records are parsed by the importer's parser
(`rankscope.hub.importers.nccl_inspector.add_record`).

Matching a record to the row the collector recorded on the host side:

- communicator -> group: the registered group whose size is the record's ``n_ranks`` and
  in whose rank list this rank sits at the record's ``rank``. When several groups fit,
  the first record whose ``(group, coll_sn)`` names a held row of the same op (then of
  the same size) in exactly one of them decides. The choice is kept per communicator.
- ``coll_sn`` -> ``seq``: ``coll_sn`` is NCCL's ``comm->seqNumber[func]``, a count per
  communicator *and NCCL function* (AllReduce, AllGather, ReduceScatter, Broadcast,
  Reduce) from 0. The collector's ``seq`` counts all of a group's collectives. So the tail
  numbers the group's rows per NCCL function as it sees them (`nccl_func`: a ``barrier``
  is NCCL's AllReduce; all-to-all, send and recv are point-to-point, which the Inspector
  does not record) and the ``k``-th row of function ``f`` in the group is
  ``coll_sn == k`` of ``f``. They agree when the collector sees the group's collectives
  of that function from its first (true for the torch wrappers and DDP's comm hook,
  installed before the process group runs one; a function NCCL ran without the collector
  seeing it, like DDP's parameter broadcast, shifts only that function's numbering). The
  held row gets the record's device times (first kernel start and last kernel stop of
  verbose output; without it ``coll_exec_time_us`` before the dump time) and
  ``FLAG_DEVICE_TIMED | FLAG_INSPECTOR``.
- anything else — a ``coll_sn`` the collector never recorded (after a wait of `WAIT_NS`
  for its host row), a communicator no group fits — cannot be matched exactly: the record
  is sent as its own row with ``FLAG_INSPECTOR_OWN`` in a group of its own per
  communicator and function (`own_group_id`, the same on every member; members those of
  the group it was mapped to, else the whole world when the communicator spans it), with
  ``seq = coll_sn``. A record for a row already shipped is counted ``late`` and dropped:
  it would count the collective twice.

While a communicator is mapped, rows of its group wait up to `HOLD_NS` for their record
(the pump's ``hold``), so the device times travel in the row itself. A group no record has
been mapped to yet is expected to be one: its rows of an NCCL function wait too, so a
job's first collectives (and a sub-group's, made later) are not shipped before the first
dump could be read. A group whose rows ship unmatched after their whole wait
`GIVE_UP_ROWS` times is not one NCCL times (a gloo group, a plugin that never loaded), and
its rows stop waiting.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rankscope.collector import schema
from rankscope.collector.clock import realtime_minus_monotonic_ns
from rankscope.collector.pump import FLAG_PENDING

if TYPE_CHECKING:
    from rankscope.collector.monitor import Monitor

log = logging.getLogger("rankscope")

ENV_PLUGIN = "RANKSCOPE_NCCL_INSPECTOR"
"""Path of the Inspector plugin; set for every rank by ``rankscope run --nccl-inspector``."""

DUMP_INTERVAL_US = 1000
"""The plugin's dump thread period set by rankscope (it writes only when something new
completed, so a short period costs little and loses fewer collectives)."""

SOURCE = "nccl-inspector"
"""The manifest's ``device_time_source`` while the Inspector is on."""

HOLD_NS = 1_000_000_000
"""How long a row of a mapped group waits for its Inspector record before it ships."""

GIVE_UP_ROWS = 8
"""Rows of a group that no record was mapped to, shipped after their whole wait, before
the tail stops holding that group's rows (`InspectorTail.hold`)."""

WAIT_NS = 1_000_000_000
"""How long a record waits for a host row the collector has not recorded yet."""

READ_BYTES = 1 << 20
"""Bytes read from one file per wake (the rest is read at the next)."""

MAX_LINE = 64 << 10
"""A partial line longer than this is garbage (an Inspector record is ~1 KiB)."""

MAX_WAITING = 4096
"""Records held waiting for a host row; more are sent as their own rows at once."""

MAX_OWN = 8192
"""Own rows held for the next shipment; more are dropped and counted."""

HEAD_BYTES = 4096
"""Leading bytes of a file (its first record or more) kept to tell a replaced file from a
grown one."""

RESCAN_NS = 2_000_000_000
"""How often the dump directory is listed for files that appear late."""

OWN_GROUP_BIT = 1 << 30
"""Own-row group ids have this bit set (`own_group_id`)."""

_FLAGS_MATCHED = schema.FLAG_DEVICE_TIMED | schema.FLAG_INSPECTOR
_FLAGS_OWN = schema.FLAG_DEVICE_TIMED | schema.FLAG_INSPECTOR | schema.FLAG_INSPECTOR_OWN

# Row layout of the importer's parser (its COLUMNS) and of the collector's ring.
_COMM, _CRANK, _NRANKS, _SEQ, _OP, _NBYTES, _EXEC, _DUMP, _ENTER, _KSTART, _KEND = range(11)
_R_OP, _R_GROUP, _R_NBYTES, _R_FLAGS = 1, 2, 4, 9


_NCCL_FUNC = {
    schema.OP_INDEX[name]: schema.OP_INDEX[func]
    for name, func in (
        ("all_reduce", "all_reduce"),
        ("barrier", "all_reduce"),  # c10d's NCCL barrier is a one-element all-reduce
        ("all_gather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("broadcast", "broadcast"),
        ("reduce", "reduce"),
    )
}


_NCCL_OPS = np.array(sorted(_NCCL_FUNC), np.int64)


def nccl_func(op: int) -> int:
    """The NCCL collective function (as a `schema.OPS` index) a collector op runs as, -1
    for point-to-point ops and ops the Inspector does not record."""
    return _NCCL_FUNC.get(op, -1)


def own_group_id(comm: str, func: int) -> int:
    """Group id of the own rows of communicator ``comm`` and NCCL function ``func``: the
    same on every member (from the communicator hash), with `OWN_GROUP_BIT` set."""
    try:
        h = int(comm, 16)
    except ValueError:
        h = sum(comm.encode())
    return OWN_GROUP_BIT | ((h * 31 + func) & (OWN_GROUP_BIT - 1))


def check_plugin(path: str) -> str:
    """The plugin path made absolute, once it names a file.

    Raises:
        ValueError: a one-line reason when it does not.
    """
    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.exists(full):
        raise ValueError(f"NCCL Inspector plugin {path!r} does not exist")
    if not os.path.isfile(full):
        raise ValueError(f"NCCL Inspector plugin {path!r} is not a file")
    return full


def default_dump_dir(run: str | None) -> str:
    """The per-run dump directory (``$TMPDIR/rankscope-nccl-inspector/<run>``; a launcher
    that has no run id yet names it by its pid)."""
    name = run or f"pid{os.getpid()}"
    return os.path.join(tempfile.gettempdir(), "rankscope-nccl-inspector", name)


def plugin_env(plugin: str, dump_dir: str) -> dict[str, str]:
    """The environment that makes NCCL load and run the Inspector with rankscope's settings.

    Args:
        plugin: absolute path of ``libnccl-profiler-inspector.so``.
        dump_dir: where the plugin writes its files.
    """
    return {
        ENV_PLUGIN: plugin,
        "NCCL_PROFILER_PLUGIN": plugin,
        "NCCL_INSPECTOR_ENABLE": "1",
        "NCCL_INSPECTOR_DUMP_DIR": dump_dir,
        "NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": str(DUMP_INTERVAL_US),
        "NCCL_INSPECTOR_DUMP_VERBOSE": "1",
        "NCCL_INSPECTOR_PROM_DUMP": "0",
    }


class _File:
    """Read position of one Inspector file."""

    __slots__ = ("buf", "head", "ino", "path", "pos")

    def __init__(self, path: str) -> None:
        self.path = path
        self.ino = -1
        self.pos = 0
        self.buf = b""
        self.head = b""
        """The file's first bytes as read: a file replaced under the same name (the inode
        number may be reused) shows other ones."""


class InspectorTail:
    """Tails this process's Inspector output and fills device times of its collectives.

    Attributes:
        records: Inspector records read.
        matched: records whose device times went into the host row.
        own: records sent as their own rows (no exact match).
        late: records whose host row had already shipped (dropped).
        malformed: lines that were not an Inspector record (skipped).
        unplaced: records of a communicator with no known members (dropped).
        cpu_ns: thread CPU time spent in `poll`.
    """

    def __init__(
        self,
        mon: Monitor,
        dump_dir: str,
        *,
        plugin: str = "",
        pid: int | None = None,
        hold_ns: int = HOLD_NS,
        wait_ns: int = WAIT_NS,
    ) -> None:
        from rankscope.hub.importers import nccl_inspector

        self._parser = nccl_inspector
        self.mon = mon
        self.dump_dir = dump_dir
        self.plugin = plugin
        self.suffix = f"-pid{os.getpid() if pid is None else pid}.log"
        self.hold_ns = hold_ns
        self.wait_ns = wait_ns
        self.files: dict[str, _File] = {}
        self._rec = nccl_inspector.Records()
        self._next_scan = 0
        self._comm_group: dict[str, int] = {}
        """Communicator id -> group id it was mapped to."""
        self._own_groups: dict[tuple[str, int], int] = {}
        """(communicator id, function) -> own-row group id registered for it."""
        self._mapped: np.ndarray = np.zeros(0, np.int64)
        self._unmatched: dict[int, int] = {}
        """Unmapped group -> its rows shipped after their whole wait (`GIVE_UP_ROWS`)."""
        self._given_up: np.ndarray = np.zeros(0, np.int64)
        """Unmapped groups whose rows no longer wait."""
        self._index: dict[tuple[int, int, int], int] = {}
        """(group, NCCL function, ordinal) -> ring row, for unread rows."""
        self._order: deque[tuple[int, tuple[int, int, int]]] = deque()
        self._indexed = 0
        self._count: dict[tuple[int, int], int] = {}
        """(group, NCCL function) -> rows of it seen so far (the next ordinal)."""
        self._waiting: deque[tuple[int, str, tuple[int, ...]]] = deque()
        self._own: list[tuple[int, ...]] = []
        self.records = 0
        self.matched = 0
        self.own = 0
        self.late = 0
        self.malformed = 0
        self.unplaced = 0
        self.cpu_ns = 0

    def install(self) -> InspectorTail:
        """Hook into the monitor's pump (before it starts) and its manifest. Returns self."""
        pump = self.mon.pump
        pump.tasks.append(self.poll)
        pump.hold = self.hold
        pump.extra_manifest["device_time_source"] = SOURCE
        pump.extra_manifest["nccl_inspector"] = {
            "plugin": self.plugin,
            "dump_dir": self.dump_dir,
            "dump_interval_us": DUMP_INTERVAL_US,
        }
        self.mon.inspector = self
        return self

    def counters(self) -> dict[str, int]:
        """The tail's counters by name."""
        return {
            "records": self.records,
            "matched": self.matched,
            "own": self.own,
            "late": self.late,
            "malformed": self.malformed,
            "unplaced": self.unplaced,
        }

    # -- the pump's hold ---------------------------------------------------------------
    def hold(self, colls: np.ndarray, now: int) -> int:
        """How many leading unread collective rows may ship: a row of an NCCL function
        without Inspector times waits up to ``hold_ns`` after it was recorded when its
        group is mapped, or not mapped yet (until the group is given up on)."""
        n = int(colls["group"].shape[0])
        if n == 0:
            return n
        group = colls["group"]
        timed = np.isin(colls["op"], _NCCL_OPS)  # point-to-point rows never get a record
        mapped = timed & np.isin(group, self._mapped)
        expected = timed & ~mapped & ~np.isin(group, self._given_up)
        untimed = (colls["flags"] & schema.FLAG_INSPECTOR) == 0
        t = colls["t_exit"]
        t = np.where(t != schema.NO_TIME, t, colls["t_enter"])
        waiting = (mapped | expected) & untimed & (t > now - self.hold_ns)
        k = int(np.argmax(waiting)) if waiting.any() else n
        gave = group[:k][expected[:k] & untimed[:k]]
        if gave.size:
            self._note_unmatched(gave)
        return k

    def _note_unmatched(self, groups: np.ndarray) -> None:
        """Count rows of unmapped groups that ship after their whole wait; give up on a
        group after `GIVE_UP_ROWS` of them."""
        given = False
        for g, c in zip(*np.unique(groups, return_counts=True)):
            total = self._unmatched.get(int(g), 0) + int(c)
            self._unmatched[int(g)] = total
            given |= total >= GIVE_UP_ROWS
        if given:
            out = [g for g, c in self._unmatched.items() if c >= GIVE_UP_ROWS]
            self._given_up = np.array(sorted(out), np.int64)

    # -- the pump task -----------------------------------------------------------------
    def poll(self) -> None:
        """Read what the files gained, match it, ship own rows (pump thread; never blocks
        on anything but a local file read)."""
        c0 = time.thread_time_ns()
        try:
            now = time.monotonic_ns()
            self._ship_own()
            if now >= self._next_scan or not self.files:
                self._scan()
                self._next_scan = now + RESCAN_NS
            for f in list(self.files.values()):
                self._read(f)
            self._index_rows()
            rows, comms = self._rec.rows, self._rec.comms
            if rows or self._waiting:
                # Inspector times are CLOCK_REALTIME µs; rows are on the monotonic clock.
                shift = realtime_minus_monotonic_ns()
                self._rec.rows = []
                retry, self._waiting = self._waiting, deque()
                for t_seen, comm, row in retry:
                    self._place(comm, row, shift, now, t_seen)
                for row in rows:
                    self._place(comms[row[_COMM]], row, shift, now, now)
        except Exception as exc:  # the tail must never stop the pump
            self.mon._error("nccl_inspector", exc)
        self.cpu_ns += time.thread_time_ns() - c0

    def _scan(self) -> None:
        try:
            names = os.listdir(self.dump_dir)
        except OSError:
            return  # not there yet: the plugin creates it when NCCL starts
        for name in names:
            if name.endswith(self.suffix):
                path = os.path.join(self.dump_dir, name)
                if path not in self.files:
                    self.files[path] = _File(path)

    def _read(self, f: _File) -> None:
        try:
            with open(f.path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if (
                    st.st_ino != f.ino
                    or st.st_size < f.pos
                    or (f.head and fh.read(len(f.head)) != f.head)
                ):
                    # A new file under the name (rotation) or a truncated one: from the top.
                    f.ino, f.pos, f.buf, f.head = st.st_ino, 0, b"", b""
                if st.st_size == f.pos:
                    return
                fh.seek(f.pos)
                data = fh.read(READ_BYTES)
        except OSError:
            return  # gone for now (rotation in progress); the next scan finds what is there
        if len(f.head) < HEAD_BYTES and f.pos == len(f.head):
            f.head = (f.head + data)[:HEAD_BYTES]
        f.pos += len(data)
        buf = f.buf + data
        end = buf.rfind(b"\n")
        if end < 0:
            f.buf = buf if len(buf) <= MAX_LINE else self._garbage(b"")
            return
        f.buf = buf[end + 1 :]
        if len(f.buf) > MAX_LINE:
            f.buf = self._garbage(b"")
        for line in buf[:end].split(b"\n"):
            if line.strip():
                self._line(line)

    def _garbage(self, rest: bytes) -> bytes:
        self._malformed("a partial line longer than MAX_LINE")
        return rest

    def _malformed(self, why: str) -> None:
        self.malformed += 1
        self.mon._error("nccl_inspector_line", ValueError(why))

    def _line(self, line: bytes) -> None:
        rec = self._rec
        try:
            # One object per line: the plugin ends each record with a newline.
            obj = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            self._malformed(f"not an Inspector record: {str(exc)[:80]}")
            return
        bad, n = rec.bad, len(rec.rows)
        self._parser.add_record(rec, obj)
        if rec.bad != bad or len(rec.rows) == n:
            self._malformed("a JSON line without the Inspector's header/coll_perf fields")
            return
        self.records += 1

    # -- matching --------------------------------------------------------------------
    def _index_rows(self) -> None:
        """Index new unread rows by (group, NCCL function, ordinal); forget rows shipped."""
        ring = self.mon._colls
        tail, head = ring.tail, ring.head
        order, index = self._order, self._index
        while order and order[0][0] < tail:
            i, key = order.popleft()
            if index.get(key) == i:
                del index[key]
        slots, mask, count, funcs = ring.slots, ring.mask, self._count, _NCCL_FUNC
        for i in range(max(self._indexed, tail), head):
            row = slots[i & mask]
            if row is None:
                continue
            func = funcs.get(int(row[_R_OP]), -1)
            if func < 0:
                continue
            gf = (int(row[_R_GROUP]), func)
            k = count.get(gf, 0)
            count[gf] = k + 1
            key = (gf[0], func, k)
            index[key] = i
            order.append((i, key))
        self._indexed = head

    def _candidates(self, comm_rank: int, n_ranks: int) -> list[int]:
        me = self.mon.identity.rank
        _, groups = self.mon._groups_snapshot()
        out = []
        for g in groups:
            ranks = g["ranks"]
            if len(ranks) == n_ranks and 0 <= comm_rank < n_ranks and ranks[comm_rank] == me:
                out.append(int(g["id"]))
        return out

    def _group_of(self, comm: str, row: tuple[int, ...]) -> int | None:
        gid = self._comm_group.get(comm)
        if gid is not None:
            return gid
        cands = self._candidates(row[_CRANK], row[_NRANKS])
        if len(cands) > 1:
            ring = self.mon._colls
            fits: list[tuple[int, int]] = []
            for g in cands:
                i = self._index.get((g, row[_OP], row[_SEQ]))
                slot = ring.slots[i & ring.mask] if i is not None else None
                if slot is not None:
                    fits.append((g, int(slot[_R_NBYTES])))
            cands = [g for g, _ in fits]
            if len(cands) > 1:
                # That function at that count in several: the message size may tell.
                cands = [g for g, nbytes in fits if nbytes == row[_NBYTES]]
        if len(cands) != 1:
            return None
        self._comm_group[comm] = cands[0]
        self._mapped = np.array(sorted(set(self._comm_group.values())), np.int64)
        return cands[0]

    def _place(self, comm: str, row: tuple[int, ...], shift: int, now: int, t_seen: int) -> None:
        gid = self._group_of(comm, row)
        if gid is None:
            if now - t_seen < self.wait_ns and len(self._waiting) < MAX_WAITING:
                self._waiting.append((t_seen, comm, row))  # its groups may come later
            else:
                self._add_own(comm, row, shift)
            return
        key = (gid, row[_OP], row[_SEQ])
        ring = self.mon._colls
        i = self._index.get(key)
        if i is not None:
            slot = ring.slots[i & ring.mask]
            if (
                slot is not None
                and int(slot[_R_FLAGS]) & FLAG_PENDING
                and now - t_seen < self.wait_ns
                and len(self._waiting) < MAX_WAITING
            ):
                # CUDA events still to resolve would overwrite the Inspector's times.
                self._waiting.append((t_seen, comm, row))
                return
            t_start, t_end = _device_times(row, shift)
            if ring.update(i, {"t_start": t_start, "t_end": t_end}, set_bits=_FLAGS_MATCHED):
                self.matched += 1
            else:
                self.late += 1
            return
        if row[_SEQ] >= self._count.get((gid, row[_OP]), 0):
            if now - t_seen < self.wait_ns and len(self._waiting) < MAX_WAITING:
                self._waiting.append((t_seen, comm, row))  # its host row may come yet
            else:
                self._add_own(comm, row, shift)
            return
        self.late += 1  # at or below what was recorded and no longer held: shipped already

    def _add_own(self, comm: str, row: tuple[int, ...], shift: int) -> None:
        gid = self._own_group(comm, row)
        if gid is None:
            self.unplaced += 1
            return
        if len(self._own) >= MAX_OWN:
            self.mon._error("nccl_inspector_own_full", RuntimeError("own rows dropped"))
            return
        t_start, t_end = _device_times(row, shift)
        enter = row[_ENTER] - shift if row[_ENTER] >= 0 else schema.NO_TIME
        self._own.append(
            (self.mon._step, row[_OP], gid, row[_SEQ], row[_NBYTES], enter, t_start, t_end, t_end)
        )
        self.own += 1

    def _own_group(self, comm: str, row: tuple[int, ...]) -> int | None:
        gid = self._own_groups.get((comm, row[_OP]))
        if gid is not None:
            return gid
        mon = self.mon
        mapped = self._comm_group.get(comm)
        ranks: list[int] | None = None
        if mapped is not None:
            _, groups = mon._groups_snapshot()
            ranks = next((list(g["ranks"]) for g in groups if g["id"] == mapped), None)
        elif row[_NRANKS] == mon.identity.world_size and row[_CRANK] == mon.identity.rank:
            ranks = list(range(mon.identity.world_size))
        if ranks is None:
            return None
        gid = own_group_id(comm, row[_OP])
        name = f"nccl {comm} {schema.OPS[row[_OP]]}"
        mon.register_group(gid, name, ranks, backend="nccl", desc="NCCL Inspector")
        self._own_groups[(comm, row[_OP])] = gid
        return gid

    def _ship_own(self) -> None:
        """Send the own rows gathered at the previous wake (their groups went out since)."""
        pump = self.mon.pump
        if not self._own or pump._groups_sent != self.mon._groups_version:
            return
        rows, self._own = self._own, []
        arr = np.array(rows, np.int64)
        off = pump.clock.offset_ns
        co: dict[str, Any] = {
            "step": arr[:, 0],
            "op": arr[:, 1].astype(np.int8),
            "group": arr[:, 2].astype(np.int32),
            "seq": arr[:, 3],
            "nbytes": arr[:, 4],
            "flags": np.full(len(rows), _FLAGS_OWN, np.int32),
        }
        for j, name in ((5, "t_enter"), (6, "t_start"), (7, "t_end"), (8, "t_exit")):
            col = arr[:, j]
            co[name] = np.where(col != schema.NO_TIME, col + off, col)
        pump._send(schema.steps_message(pump._header(), schema.empty_table("steps", 0), None, co))
        pump.sent_rows += len(rows)


def _device_times(row: tuple[int, ...], shift: int) -> tuple[int, int]:
    """A record's device start and end on the monotonic clock: the first kernel start and
    the last kernel stop (verbose output), else ``exec`` before the dump time."""
    if row[_KSTART] >= 0 and row[_KEND] >= 0:
        return row[_KSTART] - shift, row[_KEND] - shift
    if row[_DUMP] >= 0 and row[_EXEC] >= 0:
        return row[_DUMP] - row[_EXEC] - shift, row[_DUMP] - shift
    return schema.NO_TIME, schema.NO_TIME


def start_tail(mon: Monitor, plugin: str, env: Mapping[str, str] | None = None) -> InspectorTail:
    """Set the plugin's environment in this process (kept where already set, as
    ``rankscope run`` sets it for every rank) and hook a tail into ``mon``.

    NCCL reads the environment when it first initialises: call before the first NCCL
    communicator is created.

    Args:
        mon: the monitor (not started yet).
        plugin: absolute plugin path (`check_plugin`).
        env: the environment to read and fill (``os.environ`` by default).
    """
    e: Any = os.environ if env is None else env
    dump_dir = e.get("NCCL_INSPECTOR_DUMP_DIR") or default_dump_dir(mon.run)
    for key, value in plugin_env(plugin, dump_dir).items():
        if not e.get(key):
            e[key] = value
    try:
        os.makedirs(dump_dir, exist_ok=True)  # the plugin creates one level only
    except OSError as exc:
        mon._error("nccl_inspector_dir", exc)
    return InspectorTail(mon, dump_dir, plugin=plugin).install()
