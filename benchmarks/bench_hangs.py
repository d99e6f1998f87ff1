"""Hangs: how fast the hub flags a real hung job and names its culprit, and what a beat costs.

Each round runs the four hung jobs of ``tests/test_real_hangs.py`` at once (torchrun, gloo,
CPU, two ranks: a rank that sleeps for ever, one SIGSTOPped, one that exits, one that skips
a collective) against one hub whose `HangWatch` judges every 0.25 s. Per job it reports

- flag: hub time of the first stalled verdict minus the last progress any rank made;
- named: hub time the verdict first named the right rank and case, minus the same.

Then the wire cost of the heartbeat (bytes of beat messages per rank and second, from the
recording) and the background thread's time per beat (in process; the training thread
runs no code of it).

Run: ``python benchmarks/bench_hangs.py [--rounds 5]`` (about 40 s a round).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

HUNG = ("sleep", "stop", "exit", "skip")


def one_round(tmp: Path) -> tuple[dict[str, tuple[float, float]], float]:
    import test_real_hangs as jobs

    from rankscope.collector import schema
    from rankscope.hub.hang import HangWatch
    from rankscope.hub.recording import read_frames
    from rankscope.hub.server import Hub

    (tmp / "job.py").write_text(jobs.JOB)
    hub = Hub(record_dir=str(tmp / "rec")).start()
    watch = HangWatch(hub.store, tmp / "bundles", every_s=0.25).start()
    procs = {m: jobs._launch(tmp, hub, m) for m in HUNG}
    first_flag: dict[str, int] = {}
    named: dict[str, tuple[int, int]] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(named) < len(HUNG):
            time.sleep(0.1)
            for m in HUNG:
                rec = watch.records.get(f"hang-{m}")
                if rec is None or not rec.hang.stalled:
                    continue
                h = rec.hang
                first_flag.setdefault(m, h.now_ns)
                ok = [c.rank for c in h.culprits] == [1] and h.case == jobs.CASES[m][3]
                if ok and m not in named:
                    named[m] = (h.now_ns, h.last_progress_ns)
    finally:
        for p in procs.values():
            jobs._kill(p)
        watch.stop()
        hub.stop()
    out = {}
    for m, (t_named, last) in named.items():
        out[m] = ((first_flag[m] - last) / 1e9, (t_named - last) / 1e9)
    beats: dict[tuple[str, int], list[int]] = {}
    for frame in read_frames(str(tmp / "rec")):
        payload = frame.payload
        try:
            msg = schema.decode(payload)
        except schema.SchemaError:
            continue
        if msg.kind == "beat" and not msg.header.get("stacks"):
            beats.setdefault((msg.header["run"], msg.header["rank"]), []).append(len(payload))
    rates = [np.mean(v) for v in beats.values() if len(v) > 3]
    return out, float(np.mean(rates)) if rates else float("nan")


def beat_cost_us(n: int = 2000) -> float:
    """Background-thread time of one beat (position, frames, encoding; sending stubbed)."""
    from rankscope.collector.identity import Identity
    from rankscope.collector.monitor import Monitor

    ident = Identity(rank=0, world_size=1, local_rank=0, host="h", node_rank=0, pid=1)
    mon = Monitor(job="j", run="r", identity=ident, hub="tcp://127.0.0.1:1", clock_sync=False)
    hb = mon.pump.heartbeat
    mon.pump._send = lambda data: None  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for i in range(n):
        hb.beat(i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    flags: dict[str, list[float]] = {m: [] for m in HUNG}
    nameds: dict[str, list[float]] = {m: [] for m in HUNG}
    sizes = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as d:
            got, size = one_round(Path(d))
        sizes.append(size)
        for m in HUNG:
            if m in got:
                flags[m].append(got[m][0])
                nameds[m].append(got[m][1])
        print(
            f"round {r + 1}: " + ", ".join(f"{m} {v[1]:.1f} s" for m, v in got.items()), flush=True
        )
    all_named = np.array([v for m in HUNG for v in nameds[m]])
    all_flag = np.array([v for m in HUNG for v in flags[m]])
    missed = sum(args.rounds - len(nameds[m]) for m in HUNG)
    print(f"\n{args.rounds} rounds x {len(HUNG)} jobs; culprit not named in {missed}")
    print("| job | flag p50 s | named p50 s | named max s |")
    print("|---|---|---|---|")
    for m in HUNG:
        if nameds[m]:
            print(
                f"| {m} | {np.median(flags[m]):.1f} | {np.median(nameds[m]):.1f} "
                f"| {max(nameds[m]):.1f} |"
            )
    if all_named.size:
        print(
            f"| all | {np.median(all_flag):.1f} (p90 {np.percentile(all_flag, 90):.1f}) "
            f"| {np.median(all_named):.1f} (p90 {np.percentile(all_named, 90):.1f}) "
            f"| {all_named.max():.1f} |"
        )
    print(
        f"beat size {np.nanmean(sizes):.0f} B, one a second: {np.nanmean(sizes):.0f} B/s per rank"
    )
    print(f"background thread per beat: {beat_cost_us():.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
