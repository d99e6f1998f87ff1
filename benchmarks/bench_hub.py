"""Hub ingest: collective events per second through the hub, against the raw PULL+decode loop.

Both loops receive the same pre-encoded ``steps`` batches (one message per rank and step)
from a sender process over tcp loopback. The raw loop only does ``recv`` +
``schema.decode``; the hub does everything it does live: receive, decode, validation, store
ingest, the periodic matching pass (instances of a 16-rank all-reduce group) and, in a
second variant, the recording. Two more loops place the raw one (`raw_loop` modes): the
transport alone (``recv`` + ``msgpack.unpackb``), and the least a hub that keeps its data
does (decode, validate, hold until a pass would take the message).

What is measured, per loop: from the end of the first third of the batches (``WARM_PART``:
a running hub's steady state) to the last one processed, with the final matching pass
included, (a) the wall time and (b) the CPU time of the threads that do the work — the raw
loop's thread, or the hub's receive thread, its recording thread (with a recording) and the
thread that runs the final pass. (b) is what "one core" sustains; ZeroMQ's own I/O thread (socket reads,
the same for both loops) is in neither. Each repetition runs every loop back to back and
the ratios are taken inside a repetition, so load from other processes on a shared
machine cancels as far as it can.

The cost of CURVE (`curve_cost`): the same hub loop with and without CURVE on its sockets
(the sender encrypting with an authorised client key). Decryption runs in ZeroMQ's I/O
thread, so there the hub's ingest CPU is its receive thread's plus its I/O thread's, both
per message; the two variants run back to back in each repetition and are compared as a
ratio.

    python benchmarks/bench_hub.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from rankscope.collector import schema

BASE = 1_700_000_000_000_000_000
WARM_PART = 3
"""Both loops time what follows the first 1/WARM_PART of the batches (and the hub's first
matching pass): by then the hub's heap holds the pass's buffers, as in a hub that has been
running (a fresh process first faults those pages in, ~10 ms of CPU here)."""


def _header(rank: int, batch: int = 0) -> dict:
    return {"job": "bench", "run": "bench-run", "rank": rank, "inc": 0, "batch": batch}


@contextlib.contextmanager
def raw_columns() -> Iterator[None]:
    """Messages built inside send every column raw, as collectors of schema 1 did."""
    keep = schema.PACK_MIN_ROWS
    schema.PACK_MIN_ROWS = schema.MAX_ROWS + 1
    try:
        yield
    finally:
        schema.PACK_MIN_ROWS = keep


def make_messages(
    world: int, steps: int, colls: int, mixed: bool = False, packed: bool = True
) -> tuple[list[bytes], list[bytes]]:
    """Hellos + groups, and one steps message per rank and step with ``colls`` rows.

    ``mixed``: every other call goes to the rank's parity group (even or odd ranks) instead
    of the world group, so each message mixes two groups (split into pieces by the pass).
    ``packed=False``: every column raw, as collectors of schema version 1 sent them."""
    if not packed:
        with raw_columns():
            return make_messages(world, steps, colls, mixed)
    head = []
    for r in range(world):
        ident = {
            "rank": r,
            "world_size": world,
            "local_rank": r % 8,
            "host": f"n{r // 8}",
            "node_rank": r // 8,
            "pid": r,
        }
        head.append(schema.hello_message(_header(r), ident))
    table = [{"id": 0, "ranks": list(range(world))}]
    if mixed:
        table += [{"id": 1 + p, "ranks": list(range(p, world, 2))} for p in (0, 1)]
    head.append(schema.groups_message(_header(0), table))
    rng = np.random.default_rng(0)
    body = []
    for s in range(steps):
        t = BASE + s * 100_000_000
        enter = t + np.arange(colls)[None, :] * 20_000 + rng.integers(0, 5_000, (world, colls))
        exit_ = enter.max(axis=0) + 8_000 + rng.integers(0, 500, (world, colls))
        sub = (np.arange(colls) % 2 == 1) & mixed
        for r in range(world):
            st = schema.empty_table("steps", 1)
            st["step"][:] = s
            st["t_start"][:] = t
            st["t_end"][:] = t + 90_000_000
            co = schema.empty_table("colls", colls)
            co["step"][:] = s
            co["op"][:] = 0
            co["group"][:] = np.where(sub, 1 + r % 2, 0)
            n_sub = int(sub.sum())
            co["seq"][~sub] = s * (colls - n_sub) + np.arange(colls - n_sub)
            co["seq"][sub] = s * n_sub + np.arange(n_sub)
            co["nbytes"][:] = 1 << 22
            co["t_enter"][:] = enter[r]
            co["t_exit"][:] = exit_[r]
            co["flags"][:] = 0
            body.append(schema.steps_message(_header(r, s), st, colls=co))
    return head, body


def _sender(
    endpoint: str, world: int, steps: int, colls: int, ready, go, curve=None, packed=True
) -> None:
    head, body = make_messages(world, steps, colls, packed=packed)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    if curve is not None:
        curve.apply(s)
    s.connect(endpoint)
    for m in head:
        s.send(m)
    ready.set()
    go.wait()
    for m in body:
        s.send(m, copy=False)
    s.close(linger=-1)
    ctx.term()


def _spawn(endpoint: str, world: int, steps: int, colls: int, curve=None, packed=True):
    mpc = mp.get_context("spawn")
    ready, go = mpc.Event(), mpc.Event()
    p = mpc.Process(
        target=_sender,
        args=(endpoint, world, steps, colls, ready, go, curve, packed),
        daemon=True,
    )
    p.start()
    return p, ready, go


RAW_MODES = ("decode", "unpack", "keep")


def raw_loop(world: int, steps: int, colls: int, mode: str = "decode") -> tuple[float, float]:
    """(wall, cpu) seconds for a loop that receives every batch and, by ``mode``:

    - ``decode``: decodes it with ``schema.decode`` (msgpack, then the schema's checks and
      a numpy view of each column): the raw loop the hub is compared with;
    - ``unpack``: only ``msgpack.unpackb`` with the options ``schema.decode`` uses: the
      transport's own share;
    - ``keep``: decodes it, validates it against a store that knows the ranks
      (`hub.validate.check`) and holds it until a hub's matching pass would take it
      (``Store.settle_rows`` rows), then drops it. That is the least a hub that keeps what
      it receives does: decode then writes each message's columns into memory that is not
      in cache, where the bare loop reuses the memory it has just freed."""
    from rankscope.hub.store import Store
    from rankscope.hub.validate import check

    if mode not in RAW_MODES:
        raise ValueError(f"mode must be one of {RAW_MODES}, not {mode!r}")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, schema.MAX_MESSAGE_BYTES)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    p, ready, go = _spawn(f"tcp://127.0.0.1:{port}", world, steps, colls)
    ready.wait()
    store = Store()
    for _ in range(world + 1):
        msg = schema.decode(pull.recv())
        store.ingest(msg, check(msg, store).keep_steps)
    go.set()
    n = world * steps
    skip = _skip(world, steps, colls)
    held: list[schema.Message] = []
    hold = max(1, store.settle_rows // colls)
    unpackb, limit = msgpack.unpackb, schema.MAX_MESSAGE_BYTES

    def loop(count: int) -> None:
        # One loop per mode, so that the bare loops carry no call or branch per message.
        if mode == "decode":
            for _ in range(count):
                schema.decode(pull.recv())
        elif mode == "unpack":
            for _ in range(count):
                unpackb(pull.recv(), raw=False, strict_map_key=True, max_bin_len=limit)
        else:
            for _ in range(count):
                msg = schema.decode(pull.recv())
                check(msg, store)
                held.append(msg)
                if len(held) >= hold:
                    held.clear()

    loop(skip)
    t0, c0 = time.perf_counter(), time.thread_time()
    loop(n - skip)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    p.join()
    pull.close(0)
    ctx.term()
    return wall * n / (n - skip), cpu * n / (n - skip)


def _skip(world: int, steps: int, colls: int) -> int:
    """Untimed batches at the start: the first 1/WARM_PART, and at least enough for the
    hub's first matching pass (``Store.settle_rows`` rows)."""
    from rankscope.hub.store import Store

    first_pass = Store().settle_rows // colls + world
    skip = max(world * (steps // WARM_PART), first_pass)
    assert skip < world * steps // 2, "too few batches to time after the warm-up"
    return skip


def _thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def zmq_io_cpu() -> float:
    """CPU seconds used so far by this process's ZeroMQ I/O threads (``ZMQbg/IO/*``;
    their totals drop when a context ends, so compare readings within one context)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ZMQbg/IO"):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9


def hub_loop(world: int, steps: int, colls: int, record: bool) -> tuple[float, float]:
    """(wall, cpu) seconds for the hub to ingest, match (and record) every batch; cpu is
    the receive thread's, the recording thread's and the final matching pass and flush."""
    from rankscope.hub.server import Hub

    with tempfile.TemporaryDirectory() as tmp:
        hub = Hub(record_dir=os.path.join(tmp, "rec") if record else None).start()
        p, ready, go = _spawn(hub.endpoint, world, steps, colls)
        ready.wait()
        while hub.store.message_count < world + 1:
            time.sleep(0.001)
        go.set()
        head = world + 1
        n = world * steps + head
        skip = _skip(world, steps, colls)
        while hub.store.message_count < head + skip:
            time.sleep(0.0002)
        # The recording's own thread (checksums and writes) works for the hub too.
        writer = hub.recorder._thread if hub.recorder is not None else None
        w0 = _thread_cpu(writer) if writer is not None else 0.0
        t0, c0 = time.perf_counter(), _thread_cpu(hub._threads[0])
        k0 = hub.store.message_count  # read after the clocks: never counts too many
        while hub.store.message_count < n:
            time.sleep(0.002)
        c1 = _thread_cpu(hub._threads[0])
        m0 = time.thread_time()
        hub.store.settle()
        if hub.recorder is not None:
            hub.recorder.flush()  # what is still buffered; waits for the thread's write
        wall = time.perf_counter() - t0
        cpu = c1 - c0 + time.thread_time() - m0
        if writer is not None:
            cpu += _thread_cpu(writer) - w0
        health = hub.store.health
        p.join()
        hub.stop()
        assert not health["rejects"], health["rejects"]
        totals = hub.store.totals("bench-run")
        assert totals.instances_complete == steps * colls, totals.instances_complete
    timed = n - k0
    m = n - head
    return wall * m / timed, cpu * m / timed


def queued_loop(
    world: int, steps: int, colls: int, keys: Path | None = None, packed: bool = True
) -> tuple[float, float]:
    """(receive thread, I/O thread) CPU seconds for the hub to take a whole run that
    arrived while its receive thread waited: the sender (and, with ``keys``, its
    encryption) has finished, and the hub's I/O thread has read (and decrypted) every
    message, before the receive thread takes the first. On two cores the flood of
    `hub_loop` runs the sender's threads beside the hub's, and the receive thread's CPU per
    message then moves with that contention (±30 % between repetitions here); this loop
    leaves the hub's two threads only what the hub itself does."""
    from rankscope.collector.security import load_client_curve
    from rankscope.hub.intake import Intake
    from rankscope.hub.security import load_hub_security
    from rankscope.hub.server import Hub

    security = load_hub_security(keys) if keys is not None else None
    curve = load_client_curve(keys) if keys is not None else None
    holding, release = threading.Event(), threading.Event()
    feed_many = Intake.feed_many

    def held(self, batch, t_recv):
        if holding.is_set():
            release.wait()
        return feed_many(self, batch, t_recv)

    Intake.feed_many = held  # type: ignore[method-assign]
    try:
        hub = Hub(security=security, rcvhwm=world * steps + world + 2).start()
        try:
            p, ready, go = _spawn(hub.endpoint, world, steps, colls, curve, packed)
            ready.wait()
            while hub.store.message_count < world + 1:
                time.sleep(0.001)
            holding.set()
            io0 = zmq_io_cpu()
            go.set()
            p.join()
            # The sender has handed everything to its socket; wait until the hub's I/O
            # thread has read it all (its CPU stops moving).
            last, still = -1.0, 0
            while still < 5:
                time.sleep(0.05)
                now = zmq_io_cpu()
                still = still + 1 if now == last else 0
                last = now
            c0 = _thread_cpu(hub._threads[0])
            release.set()
            n = world * steps + world + 1
            while hub.store.message_count < n:
                time.sleep(0.002)
            c1 = _thread_cpu(hub._threads[0])
            m0 = time.thread_time()
            hub.store.settle()
            cpu = c1 - c0 + time.thread_time() - m0
            io = zmq_io_cpu() - io0
            assert not hub.store.health["rejects"], hub.store.health["rejects"]
        finally:
            release.set()
            hub.stop()
    finally:
        Intake.feed_many = feed_many  # type: ignore[method-assign]
    return cpu, io


def breakdown(
    world: int, steps: int, colls: int, mixed: bool = False, packed: bool = True
) -> dict[str, float]:
    """CPU ns per collective row of each stage, in-process on the same batches.

    Steady state: the second half of the batches, a matching pass every 160k rows as the
    hub's timer would run one. Stages are timed in bulk (a CPU clock read costs about a
    microsecond here, too much to take per message): decode of every batch, then
    validation + ingest with the passes timed apart, then recording.
    """
    from rankscope.hub.allocator import keep_freed_memory
    from rankscope.hub.intake import Intake
    from rankscope.hub.recording import RecordingWriter
    from rankscope.hub.store import Store
    from rankscope.hub.validate import check

    keep_freed_memory()  # as `Hub.start` does
    head, body = make_messages(world, steps, colls, mixed, packed)
    store = Store()
    intake = Intake(store)
    for m in head:
        intake.feed(m)
    every = max(1, 160_000 // colls)
    half = len(body) // 2
    for data in body[:half]:
        intake.feed(data)
    store.settle()
    rest = body[half:]
    c0 = time.thread_time()
    msgs = [schema.decode(data) for data in rest]
    t_decode = time.thread_time() - c0
    t_pass = 0.0
    c0 = time.thread_time()
    for i, msg in enumerate(msgs):
        store.ingest(msg, check(msg, store).keep_steps)
        if i % every == every - 1 or i == len(msgs) - 1:
            p0 = time.thread_time()
            store.settle()
            t_pass += time.thread_time() - p0
    t_ingest = time.thread_time() - c0 - t_pass
    with tempfile.TemporaryDirectory() as tmp:
        rec = RecordingWriter(tmp)
        c0 = time.thread_time()
        for data in rest:
            rec.append(data, 0)
        rec.close()
        t_rec = time.thread_time() - c0
    rows = len(rest) * colls
    t = {
        "decode": t_decode,
        "validate + ingest": t_ingest,
        "matching pass": t_pass,
        "recording": t_rec,
    }
    return {k: v / rows * 1e9 for k, v in t.items()}


def encode_cost(colls: int, packed: bool, reps: int = 5, n: int = 200) -> float:
    """CPU µs to build one steps message of ``colls`` rows (median of ``reps`` × ``n``)."""
    st = schema.empty_table("steps", 1)
    co = schema.empty_table("colls", colls)
    rng = np.random.default_rng(0)
    co["step"][:] = 3
    co["op"][:] = 0
    co["group"][:] = 0
    co["seq"][:] = 3 * colls + np.arange(colls)
    co["nbytes"][:] = 1 << 22
    co["t_enter"][:] = BASE + np.arange(colls) * 20_000 + rng.integers(0, 5_000, colls)
    co["t_exit"][:] = co["t_enter"] + 8_000
    co["flags"][:] = 0
    times = []
    with contextlib.nullcontext() if packed else raw_columns():
        for _ in range(reps):
            c0 = time.thread_time()
            for _ in range(n):
                schema.steps_message(_header(0), st, colls=co)
            times.append((time.thread_time() - c0) / n * 1e6)
    return statistics.median(times)


def curve_cost(world: int, steps: int, colls: int, reps: int) -> list[str]:
    """The hub with and without CURVE (`queued_loop`), back to back in each repetition
    (alternating which goes first).

    Args:
        world: ranks; steps: steps per rank; colls: rows per message.
        reps: repetitions.

    Returns:
        Markdown lines: a table of CPU per message and events per second, and the overhead.
    """
    from rankscope.commands.keys import make_keys

    forms = (True, False)
    runs: dict[bool, list[tuple[tuple[float, float], tuple[float, float]]]] = {f: [] for f in forms}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        make_keys(keys, ["client"], force=False)
        for i in range(reps):
            for packed in forms if i % 2 == 0 else forms[::-1]:
                order = (None, keys) if i % 2 == 0 else (keys, None)
                got = {k is not None: queued_loop(world, steps, colls, k, packed) for k in order}
                runs[packed].append((got[False], got[True]))
    msgs = world * steps
    size = {f: len(make_messages(1, 1, colls, packed=f)[1][0]) for f in forms}

    lines = [
        "",
        f"CURVE: the hub taking {msgs:,} messages of {colls} rows with CURVE on its sockets "
        "and an authorised client key at the sender, against plain ZeroMQ, back to back in "
        f"each of {reps} repetition(s), with the integer columns packed (schema 2, "
        f"{size[True]:,} bytes a message) and raw (schema 1, {size[False]:,} bytes). "
        "CURVE decrypts in ZeroMQ's I/O thread, so *ingest* is the receive thread's CPU "
        "plus the hub's I/O thread's, per message. The run arrives while the receive thread "
        "waits (`queued_loop`): the sender, which encrypts too, shares these two cores, and "
        "in a flood its threads beside the hub's move the receive thread's CPU per message "
        "by ±30 % between repetitions. Medians.",
        "",
        "| columns | transport | receive thread µs/msg | I/O thread µs/msg | ingest µs/msg "
        "| M events/s (cpu) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for packed in forms:
        for name, j in (("plain", 0), ("CURVE", 1)):
            rs = runs[packed]
            recv = statistics.median(rep[j][0] for rep in rs) / msgs * 1e6
            io = statistics.median(rep[j][1] for rep in rs) / msgs * 1e6
            total = statistics.median(sum(rep[j]) for rep in rs) / msgs * 1e6
            lines.append(
                f"| {'packed' if packed else 'raw'} | {name} | {recv:.1f} | {io:.1f} "
                f"| {total:.1f} | {colls / total:.2f} |"
            )

    def med(packed: bool, f) -> float:
        return statistics.median(f(rep) for rep in runs[packed])

    def io_extra(rep) -> float:
        return (rep[1][1] - rep[0][1]) / sum(rep[0])

    def io_share(rep) -> float:
        return (rep[1][1] - rep[0][1]) / sum(rep[1])

    def extra(rep) -> float:
        return sum(rep[1]) / sum(rep[0]) - 1

    def recv(rep) -> float:
        return rep[1][0] / rep[0][0] - 1

    build = {f: encode_cost(colls, f) for f in forms}
    plain_ratio = statistics.median(
        sum(p[0]) / sum(r[0]) for p, r in zip(runs[True], runs[False], strict=True)
    )
    lines += [
        "",
        f"Packed: the encryption (the I/O thread's extra CPU) costs "
        f"{med(True, io_extra):.1%} of a plain hub's ingest CPU per message, "
        f"{med(True, io_share):.1%} of a CURVE hub's (target ≤ 15 %); raw columns: "
        f"{med(False, io_extra):.1%} and {med(False, io_share):.1%}. The receive thread "
        "does the same work either way (it sees the same decrypted bytes); its CPU per "
        f"message differed by {med(True, recv):+.1%} packed and {med(False, recv):+.1%} raw "
        f"(medians of the pairs), the whole ingest by {med(True, extra):+.1%} and "
        f"{med(False, extra):+.1%}. A plain hub's ingest CPU per message packed is "
        f"{plain_ratio:.2f} of raw. The sender pays for the packing: building one "
        f"{colls}-row steps message (`schema.steps_message`) takes {build[True]:.0f} µs of "
        f"CPU packed against {build[False]:.0f} µs raw (tables under "
        f"{schema.PACK_MIN_ROWS} rows travel raw, so the short tables of a step-by-step "
        "collector pay nothing).",
    ]
    return lines


def run(quick: bool) -> str:
    """Measure and return the Markdown section."""
    from rankscope.hub.allocator import keep_freed_memory

    # `Hub.start` sets the allocator for the whole process; set it first, so that the raw
    # loop of the first repetition runs under the same heap settings as every later one.
    keep_freed_memory()
    world = 16
    cases = [(1000, 40 if quick else 60), (250, 150 if quick else 200)]
    reps = 1 if quick else 5
    lines = [
        "## Hub ingest",
        "",
        "Collective events per second, sender in another process over tcp loopback; "
        f"{world} ranks, one all-reduce group, batches of one step per rank. *raw* = `recv` "
        "+ `schema.decode` only; *hub* = receive, decode, validation, store, periodic "
        "matching and folding of every instance; *hub+rec* adds the recording. *cpu* rows: "
        "CPU time of the threads doing the work (the hub's receive thread, the recording's "
        "writer thread and the final matching pass and flush) — what one core sustains, "
        "whatever else runs on the machine; "
        "*wall* rows: elapsed time. All loops run with the heap settings the hub sets "
        "(`hub.allocator`) and are timed after the first third of the batches and the "
        "hub's first matching pass (by then it holds the pass's buffers, as a hub that "
        "has been running does). Each repetition runs raw, hub, hub+rec and the two loops "
        "of the second table back to back; "
        f"rates are medians of {reps} repetition(s), ratios medians of the per-repetition "
        "ratios.",
        "",
        "| rows/batch | events | raw loop | hub | hub / raw | hub+rec | hub+rec / raw |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    idle: dict[int, list[float]] = {}
    floors: list[tuple[int, int, list[Any]]] = []
    for colls, steps in cases:
        events = world * steps * colls
        runs = []
        for _ in range(reps):
            runs.append(
                (
                    raw_loop(world, steps, colls),
                    hub_loop(world, steps, colls, False),
                    hub_loop(world, steps, colls, True),
                    raw_loop(world, steps, colls, "keep"),
                    raw_loop(world, steps, colls, "unpack"),
                )
            )
        floors.append((colls, world * steps, runs))
        for i, what in enumerate(("wall", "cpu")):
            r, h, c = (
                events / statistics.median(rep[j][i] for rep in runs) / 1e6 for j in range(3)
            )
            hr = statistics.median(rep[0][i] / rep[1][i] for rep in runs)
            cr = statistics.median(rep[0][i] / rep[2][i] for rep in runs)
            lines.append(
                f"| {colls} ({what}) | {events:,} | {r:.2f} | {h:.2f} | {hr:.2f} "
                f"| {c:.2f} | {cr:.2f} |"
            )
            idle.setdefault(colls, []).append(r)
    lines += [
        "",
        "The raw loop waits for the sender: its CPU rate is "
        + " and ".join(f"{c / w:.1f}x its wall rate ({k} rows)" for k, (w, c) in idle.items())
        + ", so its wall rate measures the sender and a wall ratio flatters the hub; the CPU "
        "rows compare the two loops on what one core does.",
        "",
        "Where the raw loop's time goes and what keeping the data costs, in the same "
        "repetitions (CPU µs per message, medians). *recv + unpack* only receives and "
        "unpacks the msgpack: the transport's share; the rest of *raw* is the schema's "
        "checks and a numpy view of each column (`schema.decode`). *raw + keep* decodes "
        "and validates each message as the hub does and holds it until a matching pass "
        "would take it (`Store.settle_rows` rows), then drops it: the least a hub that "
        "keeps what it receives does, with no store, matching or folding. Holding the "
        "messages costs by itself: the bare loop decodes into memory it has just freed, "
        "still in cache, a keeping loop into memory that is not. *ceiling* is raw over "
        "raw + keep, the best hub / raw any keeping hub reaches; *room* is what a hub at "
        "0.5 of the raw loop could spend on its store, matching and folding (2 x raw - "
        "(raw + keep)); *spent* is what this hub spends on them (hub - (raw + keep)).",
        "",
        "| rows/batch | recv + unpack | raw | raw + keep | ceiling | hub | room at 0.5 | spent |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for colls, msgs, runs in floors:
        raw, hub, keep, unpack = (
            statistics.median(rep[j][1] for rep in runs) / msgs * 1e6 for j in (0, 1, 3, 4)
        )
        ceiling = statistics.median(rep[0][1] / rep[3][1] for rep in runs)
        lines.append(
            f"| {colls} | {unpack:.1f} | {raw:.1f} | {keep:.1f} | {ceiling:.2f} | {hub:.1f} "
            f"| {2 * raw - keep:.1f} | {hub - keep:.1f} |"
        )
    lines += [
        "",
        "CPU time per collective row of each stage, in-process on the same batches "
        "(ns/row, median of 3). *two groups*: every message mixes the world group and the "
        "rank's parity group, so the matching pass first splits each message into one piece "
        "per group (one stable sort of the pass's rows), then stacks the pieces of a group's "
        "ranks as blocks; *unpacked*: every column raw, as schema-1 collectors sent them "
        "(tables of 1000 rows travel packed, 250 rows raw):",
        "",
        "| rows/batch | decode | validate + ingest | matching pass | recording | total |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(c, s, False, True) for c, s in cases]
    rows += [(1000, cases[0][1], True, True), (1000, cases[0][1], False, False)]
    for colls, steps, mixed, packed in rows:
        bs = [breakdown(world, steps, colls, mixed, packed) for _ in range(1 if quick else 3)]
        b = {k: statistics.median(x[k] for x in bs) for k in bs[0]}
        cells = " | ".join(f"{v:.0f}" for v in b.values())
        name = f"{colls}" + (", two groups" if mixed else "") + ("" if packed else ", unpacked")
        lines.append(f"| {name} | {cells} | {sum(b.values()):.0f} |")
    lines += curve_cost(world, 80 if quick else 240, cases[0][0], 3 if quick else 7)
    lines += [
        "",
        "Targets (ARCHITECTURE §9): ≥ 5 M events/s and ≥ 0.5 of the raw loop.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sys.stdout.write(run(args.quick))
