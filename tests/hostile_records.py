"""Hostile recordings: what a reader may find on disk, and every reader run over it.

A recording written by an older hub (or a hub with a validation gap) may hold records the
current hub would refuse: a hello whose mesh coordinate is a string, a rail outside 32
bits, garbage msgpack, a table whose columns hold extreme values. This module writes such
recordings directly with `RecordingWriter` (no hub validation in between) and runs every
reader over them in-process, collecting what raised.

Used by ``tests/test_recording_hostile.py`` (a few examples per test) and by
``benchmarks/fuzz_readers.py`` (a long run).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import random
import shutil
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from test_hub_job import header, identity, job

from rankscope.collector import schema
from rankscope.hub.recording import FORMAT_VERSION, RecordingWriter, segments

INT_EXTREMES = (
    0,
    1,
    -1,
    -2,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**32,
    2**53 + 1,
    2**62,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
)
"""Integers msgpack can carry, around every boundary a reader's arrays have."""

FLOAT_EXTREMES = (math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e-300)

ODD_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    "",
    "x",
    "é\u202e\x00/../",
    "n" * 3000,
    b"\x00\xff",
    [],
    [1, "a", None],
    {},
    {"a": {"b": [1, 2.5]}},
    1.5,
    math.nan,
    *INT_EXTREMES,
)
"""Values of any msgpack type, for fields whose type a reader may rely on."""


def pack(obj: Any) -> bytes:
    """msgpack exactly as the wire carries it, without the schema's builders."""
    return msgpack.packb(obj, use_bin_type=True)


def _hello(rank: int = 1, world: int = 4, run: str = "r1", **ident: Any) -> dict[str, Any]:
    return {
        **header(run, rank),
        "v": schema.SCHEMA_VERSION,
        "kind": "hello",
        "identity": {**identity(rank, world), **ident},
        "scope": "full",
        "parent_run": None,
        "manifest": {},
        "t_start_ns": None,
    }


def bad_records() -> dict[str, bytes]:
    """Hand-written records a careful hub refuses, each named for what is wrong with it."""
    good = schema.hello_message(header("r1", 1), identity(1, 4))
    steps = msgpack.unpackb(job(world=4, steps=1).steps[1][0], raw=False)
    steps_short = {**steps, "tables": {**steps["tables"]}}
    steps_short["tables"]["steps"] = {**steps["tables"]["steps"], "n": 2}
    out = {
        "hello_mesh_str": pack(_hello(mesh={"tp": "x"})),
        "hello_mesh_list": pack(_hello(mesh={"tp": [1], "dp": None})),
        "hello_mesh_float": pack(_hello(mesh={"pp": 1.5})),
        "hello_mesh_not_map": pack({**_hello(), "identity": {**identity(1, 4), "mesh": [1]}}),
        "hello_mesh_big": pack(_hello(mesh={"dp": 2**40})),
        "hello_rail_big": pack(_hello(rail=2**40)),
        "hello_rail_u64": pack(_hello(rail=2**64 - 1)),
        "hello_gpu_index_neg": pack(_hello(gpu_index=-(2**40))),
        "hello_node_rank_big": pack(_hello(node_rank=2**63 - 1)),
        "hello_local_rank_big": pack(_hello(local_rank=2**32)),
        "hello_shard_big": pack(_hello(shard=-(2**63))),
        "hello_world_huge": pack(_hello(rank=0, world=2**40, run="huge")),
        "hello_inc_big": pack({**_hello(rank=2), "inc": 2**63 - 1}),
        "hello_host_not_str": pack({**_hello(), "identity": {**identity(1, 4), "host": 7}}),
        "hello_manifest_odd": pack(
            {**_hello(rank=3), "manifest": {"b": b"\xff", "n": [math.nan], "d": {"": None}}}
        ),
        "hello_t_start_u64": pack({**_hello(rank=0), "t_start_ns": 2**64 - 1}),
        "hello_parent_not_str": pack({**_hello(rank=0, run="child"), "parent_run": 7}),
        "garbage": b"\xc1\xc1\xc1 not msgpack \x00\xff",
        "empty": b"",
        "truncated_msgpack": good[: len(good) // 2],
        "top_level_list": pack([1, 2, 3]),
        "wrong_version": pack({**_hello(), "v": 99}),
        "steps_wrong_rows": pack(steps_short),
        "stats_odd": pack(
            {
                **header("r1", 1),
                "v": schema.SCHEMA_VERSION,
                "kind": "stats",
                "stats": {
                    "dropped_batches": "lots",
                    "dropped_events": 2**64 - 1,
                    "errors": [1, 2],
                    "clock_error_ns": math.inf,
                    "clock_offset_ns": "x",
                },
            }
        ),
        "groups_odd": pack(
            {
                **header("r1", 1),
                "v": schema.SCHEMA_VERSION,
                "kind": "groups",
                "groups": [
                    {"id": 2**63 - 1, "ranks": [0, 1], "name": 5, "backend": [], "desc": b""},
                    {"id": -(2**63), "ranks": [], "name": None},
                ],
            }
        ),
    }
    return out


@dataclass(frozen=True)
class Mutation:
    """One change to a valid message: ``kind`` says what, ``where`` picks the message and
    the field (taken modulo what exists), ``value`` is the new value."""

    kind: str
    where: int
    value: Any


MUTATION_KINDS = (
    "header",  # a header field (job, run, rank, inc, batch, scope, parent_run, t_start_ns)
    "identity",  # a hello identity field
    "mesh",  # a mesh coordinate of a hello
    "column",  # every value of one table column set to an extreme
    "column_bytes",  # one table column's bytes replaced with random bytes of its length
    "column_packed",  # one table column sent packed: the value as base, any width, random offsets
    "stats",  # a stats field
    "manifest",  # a manifest field
    "group",  # a groups message field
    "bad_record",  # a hand-written bad record inserted
    "garbage",  # random bytes inserted as a record
    "truncate",  # a message cut short
    "duplicate",  # a message recorded twice
)

_HEADER_KEYS = ("job", "run", "rank", "inc", "batch", "scope", "parent_run", "t_start_ns", "kind")
_IDENTITY_KEYS = (
    *schema.HELLO_REQUIRED,
    *schema.HELLO_OPTIONAL,
)
_STATS_KEYS = (
    "dropped_batches",
    "dropped_events",
    "errors",
    "clock_offset_ns",
    "clock_error_ns",
    "stats",
)


def _column_value(dtype: np.dtype, value: Any) -> Any:
    """``value`` as something ``dtype`` can hold (wrapped, so it stays extreme)."""
    if dtype.kind == "f":
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            return math.nan
    if isinstance(value, bool) or not isinstance(value, int):
        return -1
    bits = dtype.itemsize * 8
    v = value % (1 << bits)
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def apply(messages: list[bytes], mutations: Sequence[Mutation], seed: int = 0) -> list[bytes]:
    """Apply ``mutations`` to a copy of a message list (bytes); see `MUTATION_KINDS`."""
    out = list(messages)
    rng = random.Random(seed)
    bad = list(bad_records().values())
    for m in mutations:
        if not out:
            out.append(pack({}))
        i = m.where % len(out)
        if m.kind == "bad_record":
            out.insert(i, bad[m.where % len(bad)])
            continue
        if m.kind == "garbage":
            n = zlib.crc32(repr(m.value).encode()) % 200
            out.insert(i, bytes(rng.randrange(256) for _ in range(n)))
            continue
        if m.kind == "truncate":
            out[i] = out[i][: m.where % max(len(out[i]), 1)]
            continue
        if m.kind == "duplicate":
            out.insert(i, out[i])
            continue
        try:
            msg = msgpack.unpackb(out[i], raw=False, strict_map_key=False)
        except Exception:
            continue
        if not isinstance(msg, dict):
            continue
        _mutate(msg, m, rng)
        try:
            out[i] = pack(msg)
        except (OverflowError, TypeError, ValueError):
            continue
    return out


def _pick(keys: Sequence[Any], where: int) -> Any:
    return keys[(where // 7) % len(keys)]


def _mutate(msg: dict[str, Any], m: Mutation, rng: random.Random) -> None:
    kind, where, value = m.kind, m.where, m.value
    if kind == "header":
        msg[_pick(_HEADER_KEYS, where)] = value
    elif kind == "identity" and isinstance(msg.get("identity"), dict):
        msg["identity"][_pick(_IDENTITY_KEYS, where)] = value
    elif kind == "mesh" and isinstance(msg.get("identity"), dict):
        mesh = msg["identity"].get("mesh")
        mesh = dict(mesh) if isinstance(mesh, dict) else {}
        mesh[_pick(schema.MESH_DIMS, where)] = value
        msg["identity"]["mesh"] = mesh if where % 5 else value
    elif kind == "stats" and isinstance(msg.get("stats"), dict):
        msg["stats"][_pick(_STATS_KEYS, where)] = value
    elif kind == "manifest" and "manifest" in msg:
        man = msg.get("manifest")
        man = dict(man) if isinstance(man, dict) else {}
        man[str(_pick(("torch", "env", "argv", "config", "rank"), where))] = value
        msg["manifest"] = man
    elif kind == "group" and isinstance(msg.get("groups"), list) and msg["groups"]:
        g = msg["groups"][where % len(msg["groups"])]
        if isinstance(g, dict):
            g[_pick(("id", "name", "ranks", "backend", "desc"), where)] = value
    elif kind in ("column", "column_bytes", "column_packed") and isinstance(
        msg.get("tables"), dict
    ):
        names = sorted(t for t in msg["tables"] if t in schema.TABLES)
        if not names:
            return
        tname = _pick(names, where)
        table = msg["tables"][tname]
        if not isinstance(table, dict) or not isinstance(table.get("cols"), dict):
            return
        spec = schema.TABLES[tname]
        col = _pick(sorted(spec), where // 3)
        dt = spec[col]
        n = table.get("n") if isinstance(table.get("n"), int) else 0
        if not 0 <= n <= 10_000:
            return
        if kind == "column":
            with np.errstate(over="ignore"):  # 1e308 as float32 is inf: extreme, as meant
                arr = np.full(n, _column_value(dt, value), dtype=dt)
            table["cols"][col] = arr.tobytes()
        elif kind == "column_bytes":
            table["cols"][col] = bytes(rng.randrange(256) for _ in range(n * dt.itemsize))
        else:
            width = (0, 1, 2, 4, 3, 8)[where % 6]
            offsets = bytes(rng.randrange(256) for _ in range(n * width))
            table["cols"][col] = [value, width, offsets]


def random_value(rng: random.Random) -> Any:
    """An extreme or odd value, as `Mutation.value`."""
    r = rng.random()
    if r < 0.45:
        return rng.choice(INT_EXTREMES)
    if r < 0.55:
        return rng.choice(FLOAT_EXTREMES)
    if r < 0.85:
        return rng.choice(ODD_VALUES)
    return rng.randint(-(2**63), 2**64 - 1)


def random_mutations(rng: random.Random, n: int) -> list[Mutation]:
    """``n`` random mutations (the long fuzz run's source; Hypothesis draws its own)."""
    return [
        Mutation(rng.choice(MUTATION_KINDS), rng.randrange(1 << 30), random_value(rng))
        for _ in range(n)
    ]


@dataclass(frozen=True)
class Plan:
    """A hostile recording: a synthetic job, mutations of its messages, how many hub
    sessions wrote it, and damage done to the files afterwards."""

    world: int = 4
    steps: int = 4
    seed: int = 0
    mutations: tuple[Mutation, ...] = ()
    sessions: int = 1
    flips: int = 0
    """Bytes flipped at random in the segment files."""
    truncate: bool = False
    """Cut the last segment at a random byte."""
    reruns: bool = False
    """Add a one-node rerun of the run (ladder and rerun have a child to read)."""
    format_version: int = FORMAT_VERSION
    """Recording format the writer writes (1: a raw message a frame; 2: compressed)."""


def random_plan(rng: random.Random) -> Plan:
    """A random `Plan` (the long fuzz run)."""
    return Plan(
        world=rng.randint(1, 6),
        steps=rng.randint(1, 8),
        seed=rng.randrange(1 << 30),
        mutations=tuple(random_mutations(rng, rng.randint(0, 6))),
        sessions=rng.randint(1, 3),
        flips=rng.choice((0, 0, 0, 1, 3)),
        truncate=rng.random() < 0.2,
        reruns=rng.random() < 0.3,
        format_version=rng.choice((1, 2, 2)),
    )


def plan_messages(plan: Plan) -> list[bytes]:
    """The messages of a plan, mutated, in recorded order."""
    world = max(int(plan.world), 1)
    j = job(world=world, steps=max(plan.steps, 1), slow=plan.seed % world, seed=plan.seed)
    messages = list(j.messages)
    if plan.reruns:
        child = job(world=1, steps=max(plan.steps, 1), slow=0, seed=plan.seed + 1, run="r1-one")
        for k, m in enumerate(child.messages):
            if k == 0:
                d = msgpack.unpackb(m, raw=False)
                d.update(scope="one-rank", parent_run="r1")
                m = pack(d)
            messages.append(m)
    return apply(messages, plan.mutations, plan.seed)


def write_recording(
    path: Path,
    messages: Sequence[bytes],
    sessions: int = 1,
    format_version: int = FORMAT_VERSION,
) -> None:
    """Write ``messages`` as the recording writer does, bypassing any validation, split
    over ``sessions`` hub sessions (one segment each), in ``format_version``."""
    sessions = max(1, int(sessions))
    per = max(1, math.ceil(len(messages) / sessions))
    t = 1_700_000_000_000_000_000
    for s in range(sessions):
        w = RecordingWriter(
            path, info={"endpoint": "tcp://127.0.0.1:1"}, format_version=format_version
        )
        for m in messages[s * per : (s + 1) * per]:
            t += 1000
            w.append(m, t)
        w.close()


def damage(path: Path, flips: int, truncate: bool, rng: random.Random) -> None:
    """Flip ``flips`` random bytes of the segment files (headers included) and optionally
    cut the last segment short."""
    segs = segments(path)
    if not segs:
        return
    for _ in range(flips):
        seg = rng.choice(segs)
        data = bytearray(seg.read_bytes())
        if data:
            k = rng.randrange(len(data))
            data[k] ^= 1 << rng.randrange(8)
            seg.write_bytes(bytes(data))
    if truncate:
        seg = segs[-1]
        size = seg.stat().st_size
        with open(seg, "r+b") as f:
            f.truncate(rng.randrange(size + 1))


def build(path: Path, plan: Plan) -> list[bytes]:
    """Write the recording of ``plan`` at ``path``; returns the messages written."""
    messages = plan_messages(plan)
    write_recording(path, messages, plan.sessions, plan.format_version)
    damage(path, plan.flips, plan.truncate, random.Random(plan.seed))
    return messages


# -- the readers ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the readers did over one recording."""

    ran: list[str] = field(default_factory=list)
    """Readers that finished (including with a one-line error, exit status 2)."""
    failures: list[tuple[str, str]] = field(default_factory=list)
    """(reader, traceback) of every reader that raised or printed a traceback."""
    records: int = 0
    """Records the replay went through."""
    bad_records: int = 0
    """Records the replay skipped as bad."""


class _ErrorLogs(logging.Handler):
    """Collects log records carrying a traceback (a reader thread that died logs one)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(self.format(record))


@contextlib.contextmanager
def _error_logs() -> Iterator[_ErrorLogs]:
    h = _ErrorLogs()
    h.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("rankscope")
    logger.addHandler(h)
    try:
        yield h
    finally:
        logger.removeHandler(h)


def _cli(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        from rankscope.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        if "Traceback" in err.getvalue() or "Traceback" in out.getvalue():
            raise AssertionError(f"{argv[0]} printed a traceback:\n{err.getvalue()}")
        if rc not in (0, 2):
            raise AssertionError(f"{argv[0]} exited {rc}:\n{err.getvalue()[-2000:]}")
        if rc == 2 and len(err.getvalue().strip().splitlines()) < 1:
            raise AssertionError(f"{argv[0]} failed without saying why")

    return run


def _library_readers(path: Path, outcome: Outcome) -> list[tuple[str, Callable[[], None]]]:
    from rankscope.hub import replay
    from rankscope.hub.inspection import inspect_recording
    from rankscope.hub.recording import RecordingError, read_frames

    def frames() -> None:
        try:
            for _ in read_frames(path):
                pass
        except RecordingError:
            pass

    def store() -> None:
        try:
            s = replay.load(path, history_steps=8, raw_steps=8)
        except RecordingError:
            return
        rec = s.health["recording"]
        outcome.records = rec["frames"]
        outcome.bad_records = rec.get("bad_records", 0)
        for run in s.run_ids():
            w = s.window(run, last=8)
            s.totals(run)
            s.run_health(run)
            w.ranks.world_size  # noqa: B018 - the identity table is built lazily
        s.runs()
        s.health  # noqa: B018

    def inspect() -> None:
        try:
            inspect_recording(path)
        except RecordingError:
            pass

    def follower() -> None:
        if not segments(path):
            return
        try:
            n = sum(1 for _ in read_frames(path))
        except RecordingError:  # a newer format: the follower stops on it, with one line
            n = 0
        f = replay.Follower(path, poll_s=0.01).start()
        deadline = time.monotonic() + 20
        while f.report.frames < n and time.monotonic() < deadline:
            time.sleep(0.01)
        f.stop()
        for run in f.store.run_ids():
            f.store.window(run, last=8).ranks.world_size  # noqa: B018

    def viewer() -> None:
        # What ``rankscope open --no-follow`` samples for its panels; the sampler turns a
        # store's exception into Sample.error, which here is a failure all the same.
        from rankscope.tui.sources import RecordingSource, sample

        try:
            src = RecordingSource(path, follow=False)
        except RecordingError:
            return
        for run in [None, *src.store.run_ids()]:
            got = sample(src, run, 8)
            if got.error not in (None, "", "no runs yet", "no steps yet"):
                raise AssertionError(f"the viewer's sample of {run!r} failed: {got.error}")

    return [
        ("read_frames", frames),
        ("load", store),
        ("inspect_recording", inspect),
        ("follow", follower),
        ("open (sample)", viewer),
    ]


def command_readers(path: Path, work: Path) -> list[tuple[str, Callable[[], None]]]:
    """Every reading command, in-process, as (name, callable)."""
    p = str(path)
    return [
        ("inspect", _cli(["inspect", p])),
        ("inspect --json", _cli(["inspect", p, "--json"])),
        ("diagnose", _cli(["diagnose", p, "--steps", "8"])),
        ("diagnose --json", _cli(["diagnose", p, "--json", "--steps", "8"])),
        ("snapshot", _cli(["snapshot", p, "--out", str(work / "snap"), "--steps", "8"])),
        (
            "export",
            _cli(["export", p, "--csv", str(work / "csv"), "--perfetto", str(work / "t.json")]),
        ),
        ("ladder --json", _cli(["ladder", p, "--json", "--steps", "8"])),
        ("rerun --json", _cli(["rerun", p, "--scope", "one-node", "--json", "--steps", "8"])),
    ]


def run_readers(path: Path, *, commands: bool = True) -> Outcome:
    """Run every reader over the recording at ``path``; collect what raised.

    Args:
        path: the recording.
        commands: also run the CLI commands (slower: a diagnosis each).

    Returns:
        The `Outcome`.
    """
    outcome = Outcome()
    work = Path(tempfile.mkdtemp(prefix="rs-hostile-"))
    readers = _library_readers(path, outcome)
    if commands:
        readers += command_readers(path, work)
    try:
        with _error_logs() as logs:
            for name, fn in readers:
                try:
                    fn()
                except BaseException as exc:  # a reader must never raise, whatever the type
                    if isinstance(exc, KeyboardInterrupt):
                        raise
                    outcome.failures.append((name, traceback.format_exc()))
                else:
                    outcome.ran.append(name)
                for text in logs.seen:
                    outcome.failures.append((f"{name} (logged)", text))
                logs.seen.clear()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return outcome
