"""Recording volume and cost: format 2 (compressed, re-encoded columns) against format 1.

Two parts, each comparing the formats inside one run:

- volume: the simulator's tp=8 job (200 collectives per rank and step, as `bench_sim`),
  every message it sends written by `RecordingWriter` in format 1, in format 2 at zstd
  levels 1 and 3: bytes on disk per collective row, the writer's CPU per row (append,
  encode, compress, checksum, write: all of it, in this thread) and a full read back
  (`read_frames`) per row;
- ingest: `bench_hub`'s hub loop (16 ranks, one all-reduce group, sender in another
  process) without a recording, with a format-1 recording and with a format-2 one, back to
  back in each repetition: events per second (wall, and over the CPU of the hub's receive
  thread, its recording thread and the final pass and flush) and their ratios.

    python benchmarks/run.py recording      # or: python benchmarks/bench_recording.py [--quick]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hub  # from this folder, put on the path above

from rankscope.collector import schema
from rankscope.hub import server
from rankscope.hub.recording import RecordingWriter, read_frames, segments


class _Capture:
    """A collector `Sender` stand-in that keeps every message."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def send(self, data: bytes, timeout_ms: float = 0, *, cancel: Any = None) -> bool:
        self.out.append(bytes(data))
        return True

    def close(self, linger_ms: int | None = None) -> None:
        pass


def sim_messages(ranks: int, steps: int) -> tuple[list[bytes], int, list[bytes]]:
    """Every message the simulated tp=8 job sends (8 GPUs a host), its collective rows, and
    what reducing relays, one a host, send for them (`rankscope.hub.reduce`, flushed once a
    step)."""
    from rankscope.hub.reduce import NodeReducer
    from rankscope.sim import Cluster, load_scenario
    from rankscope.sim.emit import Emitter, RankStreams

    scenario = load_scenario(
        "healthy", ranks=ranks, layout__tp=8, workload__grad_accum=2, topology__gpus_per_host=8
    )
    cluster = Cluster(scenario)
    cap = _Capture()
    streams = RankStreams(
        cluster, Emitter([cap], 0.0, None), run_id="bench", scope="full", node_groups=True
    )
    streams.start()
    rows = 0
    relays: dict[int, NodeReducer] = {}
    reduced: list[bytes] = []
    host = cluster.layout.host
    seen = 0
    for k in range(steps):
        tables = cluster.step(k)
        rows += tables.colls["op"].shape[0]
        streams.add(tables)
        for data in cap.out[seen:]:
            rank = int(schema.decode(data).header["rank"])
            reduced += relays.setdefault(int(host[rank]), NodeReducer()).take(data, now=0.0)
        seen = len(cap.out)
        for relay in relays.values():
            reduced += relay.due(now=0.0)
    for relay in relays.values():
        reduced += relay.flush_all()
    return cap.out, rows, reduced


def _write(path: Path, messages: list[bytes], **kw: Any) -> float:
    """CPU seconds of this thread to write ``messages`` (no writer thread: all of it here)."""
    c0 = time.thread_time()
    w = RecordingWriter(path, **kw)
    t = 1_700_000_000_000_000_000
    for m in messages:
        t += 1000
        w.append(m, t)
    w.close()
    return time.thread_time() - c0


def _read(path: Path, messages: list[bytes]) -> float:
    c0 = time.thread_time()
    n = sum(1 for _ in read_frames(path))
    cpu = time.thread_time() - c0
    assert n == len(messages), (n, len(messages))
    return cpu


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("format 1", {"format_version": 1}),
    ("format 2, zstd 1", {"format_version": 2, "level": 1}),
    ("format 2, zstd 3", {"format_version": 2, "level": 3}),
]


def volume(ranks: int, steps: int, reps: int) -> list[str]:
    messages, rows, reduced = sim_messages(ranks, steps)
    wire = sum(map(len, messages))
    size: dict[str, int] = {}
    write: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
    read: dict[str, list[float]] = {name: [] for name, _ in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for i, (name, kw) in enumerate(VARIANTS):
                path = Path(tmp) / f"r{rep}-{i}"
                write[name].append(_write(path, messages, **kw))
                size[name] = sum(p.stat().st_size for p in segments(path))
                read[name].append(_read(path, messages))
                for p in path.iterdir():
                    p.unlink()
                path.rmdir()
    base = size["format 1"]
    lines = [
        f"Volume: the simulator's tp=8 job, {ranks:,} ranks × {steps} steps × 200 collectives "
        f"({rows:,} collective rows, {len(messages):,} messages: hellos with manifests, the "
        f"group table, steps, samples; {wire / rows:.1f} wire bytes per row), written by "
        "`RecordingWriter` in this thread (append, encode, compress, checksum, write) and "
        f"read back with `read_frames`; CPU medians of {reps} repetition(s).",
        "",
        "| writer | MB on disk | bytes / collective row | of format 1 | write ns/row (cpu) "
        "| read ns/row (cpu) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, _ in VARIANTS:
        lines.append(
            f"| {name} | {size[name] / 1e6:.1f} | {size[name] / rows:.1f} | "
            f"{size[name] / base:.3f} | {statistics.median(write[name]) / rows * 1e9:.0f} | "
            f"{statistics.median(read[name]) / rows * 1e9:.0f} |"
        )
    with tempfile.TemporaryDirectory() as tmp:
        w = [_write(Path(tmp) / f"red{rep}", reduced) for rep in range(reps)]
        red_size = sum(p.stat().st_size for p in segments(Path(tmp) / "red0"))
        r = [_read(Path(tmp) / f"red{rep}", reduced) for rep in range(reps)]
    lines.append(
        f"| format 2, zstd 3, from reducing relays | {red_size / 1e6:.1f} | "
        f"{red_size / rows:.1f} | {red_size / base:.3f} | "
        f"{statistics.median(w) / rows * 1e9:.0f} | {statistics.median(r) / rows * 1e9:.0f} |"
    )
    new = "format 2, zstd 3"
    lines += [
        "",
        f"Format 2 (zstd 3, the default) takes {size[new] / base:.3f} of format 1's bytes "
        f"({size[new] / rows:.1f} bytes per collective row) for "
        f"{statistics.median(write[new]) / statistics.median(write['format 1']):.2f}x its "
        "writer CPU per row (the disk writes format 1 saves on count here too). The last "
        f"row records what relays reducing on each host send instead ({len(reduced):,} "
        "messages: the hosts' tensor-parallel instances matched, each host's messages "
        "gathered once a step), per collective row of the same job: "
        f"{red_size / rows:.1f} bytes (target ≤ 4 per rank-collective for the reduced "
        f"long-run recording: {'met' if red_size / rows <= 4 else 'not met'}).",
    ]
    return lines


def ingest(world: int, cases: list[tuple[int, int]], reps: int) -> list[str]:
    lines = [
        f"Ingest: `bench_hub`'s hub loop ({world} ranks, one all-reduce group, one message "
        "per rank and step from another process over tcp loopback; synthetic times with "
        "random jitter, which compress less than the simulator's), without a recording, "
        "with format 1 and with format 2 (zstd 3, the default), back to back in each of "
        f"{reps} repetition(s), alternating the order of the two recordings. *cpu*: events "
        "over the CPU of the hub's receive thread, the recording's writer thread (where "
        "format 2 encodes and compresses) and the final matching pass and flush. Rates in "
        "M events/s (medians); ratios are of rates (above 1: format 2 ingests faster), "
        "medians of the per-repetition ratios with their lowest and highest.",
        "",
        "| rows/batch | clock | no recording | format 1 | format 2 | format 2 / format 1 "
        "| format 2 / no recording |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    original = server.RecordingWriter
    try:
        for colls, steps in cases:
            events = world * steps * colls
            runs: list[dict[str, tuple[float, float, float]]] = []
            for rep in range(reps):
                got: dict[str, tuple[float, float, float]] = {}
                got["none"] = bench_hub.hub_loop(world, steps, colls, False)
                order = (1, 2) if rep % 2 == 0 else (2, 1)
                for fmt in order:
                    server.RecordingWriter = functools.partial(original, format_version=fmt)
                    got[f"v{fmt}"] = bench_hub.hub_loop(world, steps, colls, True)
                server.RecordingWriter = original
                runs.append(got)
            for i, clock in enumerate(("wall", "cpu")):
                rate = {
                    k: events / statistics.median(r[k][i] for r in runs) / 1e6
                    for k in ("none", "v1", "v2")
                }
                r21 = [r["v1"][i] / r["v2"][i] for r in runs]
                r2n = [r["none"][i] / r["v2"][i] for r in runs]
                lines.append(
                    f"| {colls} | {clock} | {rate['none']:.2f} | {rate['v1']:.2f} | "
                    f"{rate['v2']:.2f} | {_ratio(r21)} | {_ratio(r2n)} |"
                )
    finally:
        server.RecordingWriter = original
    return lines


def _ratio(values: list[float]) -> str:
    """Median (lowest – highest) of per-repetition ratios."""
    return f"{statistics.median(values):.2f} ({min(values):.2f} – {max(values):.2f})"


def hub_volume(world: int, colls: int, steps: int) -> str:
    """Bytes per row of the hub loop's own messages in each format (what `ingest` wrote)."""
    head, body = bench_hub.make_messages(world, steps, colls)
    messages = head + body
    rows = len(body) * colls
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in (1, 2):
            _write(Path(tmp) / f"v{fmt}", messages, format_version=fmt)
            sizes[fmt] = sum(p.stat().st_size for p in segments(Path(tmp) / f"v{fmt}"))
    return (
        f"The hub loop's own {colls}-row messages take {sizes[1] / rows:.1f} bytes per row in "
        f"format 1 and {sizes[2] / rows:.1f} in format 2 (their entry jitter is uniform "
        "random noise, and their rows are in one group, so sequence numbers and op codes "
        "cost nothing)."
    )


def run(quick: bool) -> str:
    """Benchmark section (Markdown)."""
    from rankscope.hub.allocator import keep_freed_memory

    keep_freed_memory()  # as `Hub.start` does, for every loop alike
    ranks, steps = (512, 4) if quick else (4096, 4)
    world = 16
    cases = [(1000, 40 if quick else 60), (250, 150 if quick else 200)]
    reps = 1 if quick else 5
    lines = ["## Recording volume", ""]
    lines += volume(ranks, steps, 1 if quick else 3)
    lines += ["", *ingest(world, cases, reps), ""]
    lines.append(hub_volume(world, cases[0][0], cases[0][1]))
    lines += [
        "",
        f"Target: ≤ 24 bytes per collective row at full detail ({schema.MAX_MESSAGE_BYTES >> 20} "
        "MiB bound on every frame's decompressed size), ingest at its rate.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.stdout.write(run(quick="--quick" in sys.argv))
