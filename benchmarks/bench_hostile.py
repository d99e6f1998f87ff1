"""Hub memory under hostile senders (issue 17): what each costs against the hub's budgets.

Each sender runs against a fresh store that already holds a small valid job, through the
hub's intake path (`Intake.feed_many`, as the receive loop calls it, with the default
`hub.validate.Limits`). Per sender: the rejects it earned, the store's accounted memory
(ring grids + identities and manifests) before and after, and what Python holds
(`tracemalloc`: *held* after the sender, *peak* during it, both above the state before).
The budget line is the store's cell budget in bytes (``max_cells`` × a cell's bytes)
plus the identity budget: a hub's memory is that plus the fixed overhead measured here.

Two senders reach the hub below Python: a live hub (a subprocess) receiving 40 messages
of 30 MB over 40 connections, and 1 MB clock frames; for those the hub process's resident
peak (``ru_maxrss``) is reported instead.

    python benchmarks/bench_hostile.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_hub import raw_columns  # noqa: E402

from rankscope.collector import schema  # noqa: E402

BASE = 1_700_000_000_000_000_000
STEP_NS = 10_000_000
MiB = 1 << 20


def _header(run: str, rank: int, job: str = "j", inc: int = 0) -> dict[str, Any]:
    return {"job": job, "run": run, "rank": rank, "inc": inc, "batch": 0}


def _ident(rank: int, world: int, **more: Any) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": rank % 8,
        "host": f"node{rank // 8}",
        "node_rank": rank // 8,
        "pid": 1000 + rank,
        **more,
    }


def _hello(run: str = "r1", rank: int = 0, world: int = 4, **kw: Any) -> bytes:
    manifest = kw.pop("manifest", None)
    inc = kw.pop("inc", 0)
    job = kw.pop("job", "j")
    return schema.hello_message(
        _header(run, rank, job, inc), _ident(rank, world, **kw), manifest=manifest
    )


def _steps(
    run: str = "r1", rank: int = 0, ss: list[int] | None = None, rows: int = 1, **cols: Any
) -> bytes:
    ss = ss if ss is not None else [0]
    st = schema.empty_table("steps", len(ss))
    st["step"][:] = ss
    st["t_start"][:] = [BASE + s * STEP_NS for s in ss]
    st["t_end"][:] = [BASE + s * STEP_NS + STEP_NS // 2 for s in ss]
    n = len(ss) * rows
    co = schema.empty_table("colls", n)
    co["step"][:] = np.repeat(ss, rows)
    co["op"][:] = 0
    co["group"][:] = 0
    co["seq"][:] = np.arange(n) + ss[0] * rows
    co["nbytes"][:] = 1 << 20
    co["t_enter"][:] = BASE + co["step"] * STEP_NS + 1000 * (rank + 1)
    co["t_exit"][:] = BASE + co["step"] * STEP_NS + 100_000
    co["flags"][:] = 0
    for k, v in cols.items():
        co[k][:] = v
    return schema.steps_message(_header(run, rank), st, colls=co)


def _valid_job(world: int = 4, steps: int = 8) -> list[bytes]:
    out = [_hello(rank=r, world=world) for r in range(world)]
    groups = [{"id": 0, "name": "world", "ranks": list(range(world))}]
    out.append(schema.groups_message(_header("r1", 0), groups))
    out += [_steps(rank=r, ss=[s], rows=8) for s in range(steps) for r in range(world)]
    return out


def senders(quick: bool) -> list[tuple[str, Callable[[], list[bytes]]]]:
    """(name, messages) of each hostile sender."""
    manifest_mb = 30
    big = {"env": {f"K{i}": "v" * 100 for i in range(manifest_mb * 10_000)}}
    new_runs = 100 if quick else 1000

    def burst() -> list[bytes]:
        # Rank 3's sender stalls 60 steps, then flushes them in one message.
        out = []
        for s in range(8, 100):
            out += [_steps(rank=r, ss=[s], rows=8) for r in range(4 if s < 40 else 3)]
        out.append(_steps(rank=3, ss=list(range(40, 100)), rows=8))
        return out

    return [
        ("hello claiming 4 M ranks (166 B)", lambda: [_hello(run="huge", world=4_000_000)]),
        (
            f"{new_runs} hellos with new run ids",
            lambda: [_hello(run=f"n{i}", job=f"j{i % 50}", world=64) for i in range(new_runs)],
        ),
        (
            f"3 hellos with {manifest_mb} MB manifests",
            lambda: [_hello(rank=r, manifest=big) for r in range(3)],
        ),
        (
            "spoofed incarnations (1 000 hellos)",
            lambda: [
                _hello(rank=r % 4, inc=(10**6 if i % 2 else 1), host="spoof")
                for i, r in enumerate(range(1000))
            ],
        ),
        (
            "impossible values (1 000 steps messages, int64 extremes)",
            lambda: [
                _steps(rank=i % 4, ss=[50 + i], rows=64, t_exit=2**63 - 1, nbytes=-(2**40))
                for i in range(1000)
            ],
        ),
        ("backlog burst (60 steps at once)", burst),
    ]


def _measure(name: str, make: Callable[[], list[bytes]], limits: Any) -> dict[str, Any]:
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store

    store = Store()
    intake = Intake(store, limits=limits)
    for m in _valid_job():
        intake.feed(m, BASE)
    store.settle()
    msgs = make()
    size = sum(len(m) for m in msgs)

    def accounted() -> int:
        return sum(store.ring_nbytes().values()) + store.identity_bytes()

    before = accounted()
    gc.collect()
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        for i in range(0, len(msgs), 512):
            intake.feed_many(msgs[i : i + 512], BASE)
        store.settle()
        dt = time.perf_counter() - t0
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rejects = dict(store.health["rejects"])
    totals = store.totals("r1")
    return {
        "name": name,
        "messages": len(msgs),
        "bytes": size,
        "rejects": rejects,
        "accounted_before": before,
        "accounted_after": accounted(),
        "held": held,
        "peak": peak,
        "runs": len(store.run_ids()),
        "cells": sum(store.ring_cells().values()),
        "max_cells": store.max_cells,
        "incomplete": totals.instances_incomplete,
        "seconds": dt,
    }


def _live_hub(conn, limits_kw: dict[str, Any]) -> None:  # a subprocess
    from rankscope.hub.server import Hub
    from rankscope.hub.validate import Limits

    hub = Hub(limits=Limits(**limits_kw)).start()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    conn.send((hub.endpoint, hub.clock_endpoint, base))
    want = conn.recv()  # the senders are done: wait for the hub to have taken it all
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = hub.health
        if sum(h["rejects"].values()) >= want[0] and h["transport"]["clock_bad"] >= want[1]:
            break
        time.sleep(0.1)
    time.sleep(want[2])  # refused senders retry while they linger: let them
    h = hub.health
    conn.send((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, h["rejects"], h["transport"]))
    hub.stop()


def _live_case(limits_kw: dict[str, Any], n_conn: int) -> str:
    """One hub process under ``n_conn`` connections of a 28 MB message each and 20 1 MB
    clock frames: its resident peak above its start, as a table row."""
    import zmq

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_live_hub, args=(child, limits_kw), daemon=True)
    p.start()
    endpoint, clock_endpoint, base_kb = parent.recv()
    z = zmq.Context()
    # 28 MB messages: a steps message of an unknown run (rejected after decode).
    rows = 28 * MiB // 65  # 65 bytes a collective row raw: just under the 32 MiB cap
    with raw_columns():  # the size is the point
        big = _steps(run="nobody", ss=[0], rows=rows)
    socks = []
    for _ in range(n_conn):
        s = z.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 5000)
        s.connect(endpoint)
        socks.append(s)
        time.sleep(0.02)  # one after another: a cap admits the first N
    clock = z.socket(zmq.DEALER)
    clock.setsockopt(zmq.LINGER, 5000)
    clock.connect(clock_endpoint)
    frame = b"\x00" * MiB
    for _ in range(20):
        clock.send(frame)
    for s in socks:
        s.send(big, copy=False)
    for s in socks:
        s.close()
    clock.close()
    z.term()
    cap = limits_kw.get("max_connections", 0)
    # The clock frames are over the clock socket's MAXMSGSIZE: ZeroMQ resets their
    # connection, so the hub never counts them; wait for the data messages alone.
    parent.send((min(n_conn, cap) if cap else n_conn, 0, 2.0 if cap else 0.0))
    peak_kb, rejects, transport = parent.recv()
    p.join(timeout=30)
    what = f"--max-connections {cap}" if cap else "no connection cap"
    return (
        f"| {n_conn} connections × {len(big) / MiB:.0f} MB messages + 20 × 1 MB clock "
        f"frames, {what} | {(peak_kb - base_kb) / 1024:.0f} MB resident above the started "
        f"hub | rejects {rejects}, clock_bad {transport.get('clock_bad', 0)}, refused for "
        f"the cap {transport.get('too_many_connections', 0)} |"
    )


def live(quick: bool) -> list[str]:
    """Resident peak of a hub process under 40 × 28 MB messages and 1 MB clock frames,
    without a connection cap and with one of 8."""
    n_conn = 10 if quick else 40
    return [_live_case({}, n_conn), _live_case({"max_connections": 8}, n_conn)]


def run(quick: bool) -> str:
    from rankscope.hub.runstate import RunState
    from rankscope.hub.store import Store
    from rankscope.hub.validate import Limits

    limits = Limits()
    store = Store()
    per_cell = RunState("j", "r", 1, 1, 0).ring_nbytes() - 9  # a slot's own 9 bytes
    cell_bytes = store.max_cells * per_cell
    budget = cell_bytes + limits.max_identity_bytes
    rows = [
        "## Hub memory under hostile senders",
        "",
        "Each sender against a fresh store holding a small valid job (4 ranks), through "
        "`Intake.feed_many` with the default `Limits`. *accounted*: ring grids + identities "
        "and manifests (packed), before → after; *held* / *peak*: Python allocations "
        "(`tracemalloc`) after / during the sender, above the state before. Budget: "
        f"{store.max_cells:,} cells × {per_cell} B = {cell_bytes / MiB:.0f} MiB of rings + "
        f"{limits.max_identity_bytes / MiB:.0f} MiB of identities = {budget / MiB:.0f} MiB.",
        "",
        "| sender | sent | rejects | accounted (MiB) | held (MiB) | peak (MiB) | runs | "
        "incomplete instances |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, make in senders(quick):
        r = _measure(name, make, limits)
        rej = ", ".join(f"{k} {v}" for k, v in sorted(r["rejects"].items())) or "none"
        rows.append(
            f"| {name} | {r['bytes'] / MiB:.2f} MB | {rej} | "
            f"{r['accounted_before'] / MiB:.2f} → {r['accounted_after'] / MiB:.2f} | "
            f"{r['held'] / MiB:.1f} | {r['peak'] / MiB:.1f} | {r['runs']} | {r['incomplete']} |"
        )
        print(rows[-1], flush=True)
    rows += [
        "",
        "Below Python (a hub process; resident peak, `ru_maxrss`, so the largest moment):",
        "",
        "| sender | resident | hub counters |",
        "|---|---:|---|",
    ]
    try:
        rows += live(quick)
    except Exception as exc:  # a benchmark reports, never fails the run
        rows.append(f"| live hub | not measured | {exc!r} |")
    rows += [
        "",
        "The 28 MB messages reach Python whole: ZeroMQ assembles each connection's message "
        "before the hub sees it, so what the socket holds is up to connections × "
        "`Limits.max_message_bytes` (its `MAXMSGSIZE`). `--max-connections N` "
        "(`Limits.max_connections`) refuses data connections past N at their handshake, "
        "which bounds it: N × `max_message_bytes`; refused senders retry, and get in only "
        "as others close. The hub's own receive loop takes at most "
        "`Limits.max_queued_bytes` (64 MiB) off the socket at a time.",
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    print(run(ap.parse_args().quick))
