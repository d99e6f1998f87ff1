"""Simulated cluster throughput: steps/s and collective events/s through the real pipeline.

Each size runs the healthy scenario with 200 collectives per rank and step (tp=8, 24
layers, 2 micro batches: 192 tensor-parallel all-reduces + 8 gradient buckets). Three
figures per size:

- model: `Cluster.step` alone (the vectorised timeline, tables assembled);
- emit: model + building every rank's messages with the wire schema (no socket);
- pipeline: model + messages + `Sender` → another process: a PULL socket that decodes every
  message with the wire schema, or a real `Hub` (decode, validate, store), counted when the
  receiver has taken in every message.

    python benchmarks/run.py sim            # or: python benchmarks/bench_sim.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from rankscope.sim import Cluster, load_scenario
from rankscope.sim import run as run_sim
from rankscope.sim.emit import Emitter, RankStreams

COLLS_PER_STEP = 200
_SINK_CHILD = r"""
import json, sys, threading, time, zmq
from rankscope.collector import schema
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.MAXMSGSIZE, schema.MAX_MESSAGE_BYTES)
port = pull.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{port}", flush=True)
seen = {"messages": 0, "events": 0, "rejects": 0}
def loop():
    while True:
        buf = pull.recv()
        try:
            msg = schema.decode(buf)
        except schema.SchemaError:
            seen["rejects"] += 1
            continue
        seen["messages"] += 1
        if "colls" in msg.tables:
            seen["events"] += msg.tables["colls"]["op"].shape[0]
threading.Thread(target=loop, daemon=True).start()
want = int(sys.stdin.readline())
deadline = time.monotonic() + 600
while seen["messages"] + seen["rejects"] < want and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"messages": seen["messages"], "rejects": {"schema": seen["rejects"]}}))
"""
"""A PULL socket that decodes and validates every message with the wire schema, and
nothing else: the transport and decode side of the pipeline without the hub's store."""

_HUB_CHILD = r"""
import json, sys, time
from rankscope.hub.server import Hub
from rankscope.hub.store import Store
hub = Hub(store=Store(history_steps=16, raw_steps=2)).start()
print(hub.endpoint, flush=True)
want = int(sys.stdin.readline())
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    h = hub.health
    if h["messages"] + sum(h["rejects"].values()) >= want:
        break
    time.sleep(0.02)
h = hub.health
hub.stop()
print(json.dumps({"messages": h["messages"], "rejects": h["rejects"], "events": h["events"]}))
"""


class _Null:
    sent = dropped = 0

    def send(self, data: bytes, timeout_ms: float = 0, *, cancel=None) -> bool:
        return True

    def close(self, linger_ms: int | None = None) -> None:
        pass


def _scenario(ranks: int):
    return load_scenario("healthy", ranks=ranks, layout__tp=8, workload__grad_accum=2)


def _model_and_emit(ranks: int, steps: int) -> tuple[float, float, int]:
    cluster = Cluster(_scenario(ranks))
    streams = RankStreams(cluster, Emitter([_Null()], 0.0, None), run_id="b", scope="full")
    streams.start()
    model_s = emit_s = 0.0
    events = 0
    for k in range(steps):
        t0 = time.perf_counter()
        tables = cluster.step(k)
        t1 = time.perf_counter()
        streams.add(tables)
        t2 = time.perf_counter()
        model_s += t1 - t0
        emit_s += t2 - t0
        events += tables.colls["op"].shape[0]
    assert events == ranks * steps * COLLS_PER_STEP, events
    return model_s, emit_s, events


def _pipeline(ranks: int, steps: int, child_code: str, per_msg: int) -> tuple[float, int, dict]:
    child = subprocess.Popen(
        [sys.executable, "-c", child_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    endpoint = child.stdout.readline().strip()
    t0 = time.perf_counter()
    info = run_sim(
        _scenario(ranks),
        endpoint,
        steps,
        senders=2,
        steps_per_message=per_msg,
        run_id=f"bench-{ranks}",
    )
    child.stdin.write(f"{info.messages}\n")
    child.stdin.flush()
    hub = json.loads(child.stdout.readline())
    wall = time.perf_counter() - t0
    child.wait(timeout=60)
    hub["dropped"] = info.dropped
    return wall, info.messages, hub


def run(quick: bool) -> str:
    """Benchmark section (Markdown).

    Args:
        quick: fewer steps, and 16,384 ranks skipped.

    Returns:
        The Markdown text.
    """
    sizes = [(64, 20), (512, 10), (4096, 4), (16384, 2)]
    if quick:
        sizes = [(64, 10), (512, 4), (4096, 2)]
    rows = [
        "| ranks | steps | model | + messages | → decoding PULL | → Hub | → Hub, 4 steps/msg "
        "| Hub events/s | Hub events/s, 4 steps/msg | Hub accepted/sent | rejects |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best_4096 = None
    for ranks, steps in sizes:
        _model_and_emit(ranks, 1)  # warm up imports and caches
        model_s, emit_s, events = _model_and_emit(ranks, steps)
        sink_wall, _, sink = _pipeline(ranks, steps, _SINK_CHILD, 1)
        hub_wall, messages, hub = _pipeline(ranks, steps, _HUB_CHILD, 1)
        hub4_wall, messages4, hub4 = _pipeline(ranks, steps, _HUB_CHILD, 4)
        rejects = sum(hub["rejects"].values()) + sum(hub4["rejects"].values())
        rejects += sum(sink["rejects"].values())
        rows.append(
            f"| {ranks:,} | {steps} | {steps / model_s:.2f} | {steps / emit_s:.2f} | "
            f"{steps / sink_wall:.2f} | {steps / hub_wall:.2f} | {steps / hub4_wall:.2f} | "
            f"{events / hub_wall / 1e6:.2f} M | {events / hub4_wall / 1e6:.2f} M | "
            f"{hub['messages'] + hub4['messages']:,}/"
            f"{messages + messages4:,} | {rejects} |"
        )
        if ranks == 4096:
            best_4096 = (steps / sink_wall, steps / hub_wall, steps / hub4_wall)
        print(rows[-1], flush=True)
    lines = [
        f"Steps/s per column; {COLLS_PER_STEP} collectives per rank and step, events = "
        "collective rows. *model*: `Cluster.step` alone; *+ messages*: and every rank's "
        "messages built with the wire schema; *→ decoding PULL*: sent through `Sender` to a "
        "PULL socket in another process that decodes and validates each message; *→ Hub*: "
        "to a real `Hub` in another process (decode, validate, store), one message per rank "
        "and step, then four steps per message. The simulator waits for room instead of "
        "dropping, so each pipeline rate is bounded by the slower side.",
        "",
        *rows,
        "",
    ]
    if best_4096 is not None:
        sink, hub, hub4 = best_4096
        lines.append(
            f"Target ≥ 1 step/s at 4,096 ranks: {sink:.2f} steps/s through Sender and the wire "
            f"decode alone; {hub:.2f} ({hub4:.2f} with 4 steps a message) end to end into the "
            "hub (decode, validation, store and matching of every instance)."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
