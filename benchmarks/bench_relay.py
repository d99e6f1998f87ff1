"""Hub CPU per rank-step, direct, in relays' bundles, and with relays that reduce.

The simulated healthy job (tp=8 inside hosts of 8 GPUs, 200 collectives per rank and step)
is encoded once; the same messages then go to a real hub in another process, one way after
another in each repetition:

- *direct*: one message at a time, as ranks send without a relay;
- *a node a bundle*: multipart bundles of the consecutive messages of one host (8: one
  node's ranks, one step), what a forwarding relay sends per step;
- *full bundles*: bundles of 1,024 messages, the relay's bound, which a busy relay reaches;
- *through a relay*: through one real `rankscope relay` process over ipc, which forms its
  own bundles; its CPU is given too (it runs on the node, not on the hub's machine);
- *node relays reducing*: what a ``rankscope relay --reduce`` on each host sends
  (`rankscope.hub.reduce`: the host's tensor-parallel collectives matched on the node, the
  host's messages gathered into one per step), made beforehand by one reducer per host
  in this process; its CPU per rank-step is the relay column;
- *node and rack relays*: the same node messages gathered again by a relay per rack of 32
  hosts (``--reduce`` one level up): one message per rack and step, with the data-parallel
  buckets (a member per host) reduced to parts the hub combines (`rankscope.hub.partial`),
  and at scale only the rack's share of the hub's instance table listed
  (`rankscope.hub.reduce.INSTANCE_STEPS`).

The sender is this process, waiting for room rather than dropping. What is compared is the
hub process's CPU time (all its threads: ZeroMQ's I/O thread, receive, validation,
matching; no recording) over the steady state: from when the first two steps (hellos,
group tables, the rings' first allocations) are ingested and matched to when the last
message is, per rank-step of the steps after them.

    python benchmarks/run.py relay            # or: python benchmarks/bench_relay.py [--quick]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from rankscope.collector import schema
from rankscope.hub.reduce import NodeReducer
from rankscope.sim import Cluster, load_scenario
from rankscope.sim.emit import Kept, RankStreams

RANKS_PER_HOST = 8
HOSTS_PER_RACK = 32
WARM_STEPS = 2
"""Steps ingested before the hub's CPU is read: hellos, group tables, first allocations."""

_HUB_CHILD = r"""
import json, sys, time
from rankscope.hub.server import Hub
from rankscope.hub.store import Store
hub = Hub(store=Store(history_steps=16, raw_steps=2)).start()
print(hub.endpoint, flush=True)
warm, want = map(int, sys.stdin.readline().split())

def reach(n):
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        h = hub.health
        if h["messages"] + sum(h["rejects"].values()) >= n:
            break
        time.sleep(0.005)
    hub.store.settle()

reach(warm)
c0 = time.process_time()
print("warm", flush=True)
reach(want)
cpu = time.process_time() - c0
h = hub.health
hub.stop()
print(json.dumps({"messages": h["messages"], "rejects": h["rejects"], "cpu_s": cpu,
                  "bundles": h["transport"]["bundles"]}))
"""

_RELAY_CHILD = r"""
import json, signal, sys, threading, time
from rankscope.hub.relay import Relay
relay = Relay(sys.argv[1], sys.argv[2]).start()
c0 = time.process_time()
print("ready", flush=True)
stop = threading.Event()
signal.signal(signal.SIGINT, lambda *_: stop.set())
stop.wait(900)
relay.stop()
c = relay.counters
print(json.dumps({"forwarded": c.forwarded, "dropped": c.dropped, "bundles": c.bundles,
                  "cpu_s": time.process_time() - c0}), flush=True)
"""


def messages(ranks: int, steps: int) -> list[list[tuple[int, bytes]]]:
    """The healthy tp=8 job's messages, step by step (the first holds the hellos and
    group tables, each node's too), with the rank that sends each."""
    scenario = load_scenario(
        "healthy",
        ranks=ranks,
        layout__tp=8,
        workload__grad_accum=2,
        topology__gpus_per_host=RANKS_PER_HOST,
    )
    cluster = Cluster(scenario, t0_ns=time.time_ns())
    keep = Kept()
    streams = RankStreams(cluster, keep, run_id=f"bench-{ranks}", scope="full", node_groups=True)
    streams.start()
    out = []
    for k in range(steps):  # no finish(): its last counters are no steady-state traffic
        streams.add(cluster.step(k))
        out.append(keep.out)
        keep.out = []
    return out


def by_node(msgs: list[tuple[int, bytes]]) -> list[list[bytes]]:
    """Consecutive messages of one host, at most `RANKS_PER_HOST` a bundle."""
    out: list[list[bytes]] = []
    host = -1
    for rank, data in msgs:
        h = rank // RANKS_PER_HOST
        if h != host or len(out[-1]) >= RANKS_PER_HOST:
            out.append([])
            host = h
        out[-1].append(data)
    return out


def through_reducers(
    per_step: list[list[tuple[int, bytes]]], ranks_per_relay: int
) -> tuple[list[list[bytes]], float, float]:
    """What reducing relays send, one per ``ranks_per_relay`` consecutive ranks (a host's,
    or a rack's), step by step (each flushes once a step), and their CPU seconds together:
    in all, and over the steps after the first `WARM_STEPS` (the hellos and group tables,
    which a long run reads once, come with the first).

    Args:
        per_step: each step's messages with the rank that sent each (for a rack's relays,
            the node messages with the lowest rank of each).
        ranks_per_relay: ranks a relay carries.
    """
    relays: dict[int, NodeReducer] = {}
    out = []
    c0 = time.process_time()
    steady = 0.0
    for k, msgs in enumerate(per_step):
        s0 = time.process_time()
        step: list[bytes] = []
        for rank, data in msgs:
            relay = relays.setdefault(rank // ranks_per_relay, NodeReducer())
            step += relay.take(data, now=0.0)
        for relay in relays.values():
            step += relay.due(now=0.0)
        out.append(step)
        if k >= WARM_STEPS:
            steady += time.process_time() - s0
    out[-1] += [f for relay in relays.values() for f in relay.flush_all()]
    return out, time.process_time() - c0, steady


def _senders(per_step: list[list[bytes]]) -> list[list[tuple[int, bytes]]]:
    """Messages with the rank each names as its sender."""
    return [[(int(schema.decode(d).header["rank"]), d) for d in step] for step in per_step]


def _split(
    stream: list[list[bytes]], form: Callable[[list[bytes]], list[list[bytes]]]
) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """A stream of steps as (the first `WARM_STEPS` steps, the rest), each formed into what
    is sent at once (``form``: one message a send, or bundles)."""
    return (
        form([d for step in stream[:WARM_STEPS] for d in step]),
        form([d for step in stream[WARM_STEPS:] for d in step]),
    )


def _singles(frames: list[bytes]) -> list[list[bytes]]:
    return [[d] for d in frames]


def _hub() -> tuple[subprocess.Popen[str], str]:
    hub = subprocess.Popen(
        [sys.executable, "-c", _HUB_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert hub.stdout is not None
    return hub, hub.stdout.readline().strip()


def _send(push: zmq.Socket, bundles: list[list[bytes]]) -> None:
    for b in bundles:
        if len(b) == 1:
            push.send(b[0])  # waits for room: the harness never drops
        else:
            push.send_multipart(b)


def _once(warm: list[list[bytes]], rest: list[list[bytes]], relayed: bool) -> dict:
    """One way: ``warm`` then (once the hub has ingested it) ``rest``; the hub's CPU over
    ``rest``."""
    hub, endpoint = _hub()
    assert hub.stdin is not None and hub.stdout is not None
    n_warm = sum(len(b) for b in warm)
    n = n_warm + sum(len(b) for b in rest)
    hub.stdin.write(f"{n_warm} {n}\n")
    hub.stdin.flush()
    relay_out: dict = {}
    target = endpoint
    if relayed:
        listen = f"ipc://{tempfile.mkdtemp(prefix='bench-relay-')}/r"
        relay = subprocess.Popen(
            [sys.executable, "-c", _RELAY_CHILD, listen, endpoint],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
        target = listen
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.connect(target)
    _send(push, warm)
    assert hub.stdout.readline().strip() == "warm"
    t0 = time.perf_counter()
    _send(push, rest)
    push.close(linger=-1)
    got = json.loads(hub.stdout.readline())
    got["wall_s"] = time.perf_counter() - t0
    hub.wait(timeout=60)
    if relayed:
        relay.send_signal(2)
        out, _ = relay.communicate(timeout=60)
        relay_out = json.loads(out.strip().splitlines()[-1])
        Path(listen[len("ipc://") :]).parent.rmdir()
    got["relay"] = relay_out
    got["sent"] = n
    return got


def run(quick: bool) -> str:
    """Benchmark section (Markdown)."""
    sizes = [(512, 6), (4096, 4)] if quick else [(4096, 5), (16384, 4)]
    reps = 2 if quick else 3
    verdicts: list[str] = []
    rows = [
        "| ranks | steps timed | way | hub CPU µs per rank-step | ratio to direct (range) | "
        "hub messages | relay CPU µs per rank-step | accepted/sent |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for ranks, steps in sizes:
        per_step = messages(ranks, steps)
        timed = ranks * (steps - WARM_STEPS)
        node, _, node_cpu = through_reducers(per_step, RANKS_PER_HOST)
        rack, _, rack_cpu = through_reducers(_senders(node), RANKS_PER_HOST * HOSTS_PER_RACK)

        raw = [[d for _, d in step] for step in per_step]
        one = _split(raw, _singles)
        ways: list[tuple[str, tuple[list[list[bytes]], list[list[bytes]]], bool, str]] = [
            ("direct", one, False, "-"),
            (
                "a node a bundle",
                (
                    by_node([m for step in per_step[:WARM_STEPS] for m in step]),
                    by_node([m for step in per_step[WARM_STEPS:] for m in step]),
                ),
                False,
                "-",
            ),
            (
                "full bundles",
                _split(raw, lambda ds: [ds[i : i + 1024] for i in range(0, len(ds), 1024)]),
                False,
                "-",
            ),
            ("through a relay", one, True, ""),
            (
                "node relays reducing",
                _split(node, _singles),
                False,
                f"{node_cpu / timed * 1e6:.0f}",
            ),
            (
                f"node and rack relays ({HOSTS_PER_RACK} hosts a rack)",
                _split(rack, _singles),
                False,
                f"{node_cpu / timed * 1e6:.0f} + {rack_cpu / timed * 1e6:.0f}",
            ),
        ]
        cpu: dict[str, list[float]] = {w: [] for w, _, _, _ in ways}
        ratio: dict[str, list[float]] = {w: [] for w, _, _, _ in ways}
        relay_cpu: list[float] = []
        last: dict[str, dict] = {}
        for _ in range(reps):
            base = None
            for name, (warm, rest), relayed, _ in ways:
                got = _once(warm, rest, relayed)
                assert not got["rejects"], (name, got["rejects"])
                us = got["cpu_s"] / timed * 1e6
                base = us if base is None else base
                cpu[name].append(us)
                ratio[name].append(us / base)
                if relayed:
                    relay_cpu.append(got["relay"]["cpu_s"] / (ranks * steps) * 1e6)
                last[name] = got
        for name, _, relayed, rc in ways:
            g = last[name]
            r = ratio[name]
            if relayed:
                rc = f"{statistics.median(relay_cpu):.0f}"
            rows.append(
                f"| {ranks:,} | {steps - WARM_STEPS} | {name} | {statistics.median(cpu[name]):.1f} | "
                f"{statistics.median(r):.3f} ({min(r):.3f}–{max(r):.3f}) | {g['messages']:,} | "
                f"{rc} | {g['messages']:,}/{g['sent']:,} |"
            )
            print(rows[-1], flush=True)
        for name in (
            "node relays reducing",
            f"node and rack relays ({HOSTS_PER_RACK} hosts a rack)",
        ):
            m = statistics.median(ratio[name])
            verdicts.append(
                f"{ranks:,} ranks, {name}: {m:.3f} ({'met' if m <= 1 / 8 else 'not met'})"
            )
    return (
        "Hub CPU per rank-step over the steady state (all threads of the hub process, from "
        f"the first {WARM_STEPS} steps ingested and matched to the last message), medians of "
        f"{reps} repetitions, each running every way back to back on the same encoded "
        "messages; *ratio*: the per-repetition ratio to direct (median, lowest–highest). "
        "Forwarding relays leave the hub the same decode, validation and matching; reducing "
        "relays leave it one message per node (or rack) and step, with the node's "
        "tensor-parallel instances already matched and, at a rack, its data-parallel "
        "buckets reduced to parts. *Relay CPU*: the reducing relays' CPU per rank-step on "
        "their nodes (node + rack) over the same steps, one process each here.\n\n"
        + "\n".join(rows)
        + "\n\nTarget (issue: relays) hub CPU per rank-step ≤ 1/8 (0.125) of direct: "
        + "; ".join(verdicts)
        + ".\n"
        + "\n"
        + ring_cost(512 if quick else 4096)
        + ".\n"
        + ("" if quick else "\nAt scale (one repetition): " + at_scale(65536) + ".\n")
    )


def ring_cost(ranks: int = 4096, steps: int = 4, reps: int = 3) -> str:
    """What a relay's raw ring (``--raw-ring``) adds to a reducing node relay's CPU: its
    ``add`` of every message (a decode for kind, rank and steps, and the bookkeeping)
    against the reduction's ``take`` of the same messages, per rank-step, both in this
    process on the same encoded messages (medians of ``reps``).

        python benchmarks/bench_relay.py --ring
    """
    from rankscope.hub.rawring import RawRing

    per_step = messages(ranks, steps)
    frames = [(r, d) for step in per_step for r, d in step]
    ring_us, reduce_us = [], []
    for _ in range(reps):
        rings: dict[int, RawRing] = {}
        c0 = time.process_time()
        for rank, data in frames:
            rings.setdefault(rank // RANKS_PER_HOST, RawRing(256 << 20)).add(data, 0)
        ring_us.append((time.process_time() - c0) / (ranks * steps) * 1e6)
        _, cpu, _ = through_reducers(per_step, RANKS_PER_HOST)
        reduce_us.append(cpu / (ranks * steps) * 1e6)
    held = sum(r.nbytes for r in rings.values()) / len(rings) / steps
    ring, red = statistics.median(ring_us), statistics.median(reduce_us)
    return (
        f"raw ring at {ranks:,} ranks x 200 collectives: {ring:.0f} us per rank-step on the "
        f"node ({ring / red:.2f} of the reduction's {red:.0f} us, which it adds to); "
        f"{held / (1 << 20):.2f} MiB a node a step held, so a 256 MiB ring keeps the last "
        f"{int((256 << 20) // held)} steps of a node of {RANKS_PER_HOST}"
    )


def at_scale(ranks: int, steps: int = 4) -> str:
    """The hub's CPU per step for ``ranks`` through node and rack relays only (one
    repetition; the direct way is left out at this size): the 65,536-rank figure.

        python benchmarks/bench_relay.py --scale 65536      # ~17 min, ~8 GB
    """
    per_step = messages(ranks, steps)
    node, node_all, node_cpu = through_reducers(per_step, RANKS_PER_HOST)
    del per_step
    rack, rack_all, rack_cpu = through_reducers(_senders(node), RANKS_PER_HOST * HOSTS_PER_RACK)
    del node
    timed = ranks * (steps - WARM_STEPS)
    got = _once(*_split(rack, _singles), False)
    assert not got["rejects"], got["rejects"]
    per_step_s = got["cpu_s"] / (steps - WARM_STEPS)
    return (
        f"{ranks:,} ranks x 200 collectives through node and rack relays: hub CPU "
        f"{per_step_s:.2f} s per step ({got['cpu_s'] / (ranks * (steps - WARM_STEPS)) * 1e6:.1f} "
        f"us per rank-step; {1 / per_step_s:.2f} steps/s in its own CPU time, target >= 1); "
        f"relays {node_cpu / timed * 1e6:.0f} + {rack_cpu / timed * 1e6:.0f} us per rank-step "
        f"on their nodes over the same steps ({node_all / (ranks * steps) * 1e6:.0f} + "
        f"{rack_all / (ranks * steps) * 1e6:.0f} over all {steps}, with the hellos and group "
        "tables)"
    )


if __name__ == "__main__":
    if "--ring" in sys.argv:
        print(ring_cost())
    elif "--scale" in sys.argv:
        print(at_scale(int(sys.argv[sys.argv.index("--scale") + 1])))
    else:
        print(run(quick="--quick" in sys.argv))
