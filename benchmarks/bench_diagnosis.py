"""Diagnosis benchmark: one full ``diagnose()`` pass over a large window.

The window — 4,096 ranks × 100 steps, every rank calling 200 collectives a step — is built
once, outside the timed region, directly as the arrays a `Window` holds (per-rank-step
aggregates and the instance table; no raw rows, as the hub's store keeps them only for the
latest steps). Two layouts bound the instance count: FSDP-like, every collective over all
ranks (200 instances a step), and tensor parallel inside each 8-GPU host, 192 of the 200
calls in the 512 tensor-parallel groups (about 98,000 instances a step, ~10 M in the
window). A slow GPU is planted so the verdict has something to find. Figures are medians
of a few runs on this machine; the target is ≤ 1 s.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis.engine import diagnose
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout


def big_window(n_ranks: int, n_steps: int, calls: int, tp: int, seed: int = 0):
    """A synthetic window of the given size with one slow rank.

    Args:
        n_ranks: ranks.
        n_steps: steps.
        calls: collectives each rank calls per step.
        tp: tensor-parallel group size (1: every collective spans all ranks).
        seed: random seed.

    Returns:
        The window and its instance count.
    """
    rng = np.random.default_rng(seed)
    ranks = rank_layout(n_ranks, ranks_per_host=8, tp=tp)
    step = 1e9 * (1 + 0.003 * rng.standard_normal((n_ranks, n_steps)))
    slow = n_ranks // 3
    compute = 0.7 * step
    compute[slow] *= 1.2
    t_start = np.cumsum(np.full((n_ranks, n_steps), 1.3e9), axis=1)
    top = compute.max(axis=0)
    wait = top - compute
    # The forward and backward spans contain the waits; the exposed transfer and the
    # input wait lie between spans.
    dur = top + 0.1e9 + 5e6
    phases = {
        "forward": 0.4 * compute + 0.5 * wait,
        "backward": 0.6 * compute + 0.5 * wait,
        "input": np.full((n_ranks, n_steps), 5e6),
    }
    n_tp = calls - 8 if tp > 1 else 0
    n_dp = calls - n_tp
    members = []
    names = []
    if tp > 1:
        members += [list(range(g * tp, (g + 1) * tp)) for g in range(n_ranks // tp)]
        names += [f"tp{g}" for g in range(n_ranks // tp)]
        members += [list(range(t, n_ranks, tp)) for t in range(tp)]
        names += [f"dp{t}" for t in range(tp)]
    else:
        members.append(list(range(n_ranks)))
        names.append("world")
    groups = make_groups(ranks, members, names)
    n_tp_groups = n_ranks // tp if tp > 1 else 0
    per_step_tp = n_tp_groups * n_tp
    per_step_dp = (tp if tp > 1 else 1) * n_dp
    per_step = per_step_tp + per_step_dp
    n = per_step * n_steps
    step_of = np.repeat(np.arange(n_steps), per_step)
    within = np.tile(np.arange(per_step), n_steps)
    is_tp = within < per_step_tp
    gid = np.where(
        is_tp,
        within // max(n_tp, 1),
        n_tp_groups + (within - per_step_tp) // max(n_dp, 1),
    )
    size = np.array([len(m) for m in members])
    first = t_start[0, step_of] + rng.uniform(0, 1e9, n)
    skew = rng.exponential(2e5, n)
    inst = instance_table(
        group=gid,
        seq=within + step_of * per_step,
        step=step_of,
        op=np.full(n, schema.OP_INDEX["all_reduce"]),
        nbytes=np.where(is_tp, 1 << 24, 1 << 27),
        n_members=size[gid],
        first=first,
        last=first + skew,
        last_rank=rng.integers(0, n_ranks, n),
        margin=skew * rng.uniform(0, 1, n),
        transfer=np.where(is_tp, 1e5, 3e6) * rng.lognormal(0, 0.05, n),
    )
    coll = {
        "n": np.full((n_ranks, n_steps), float(calls)),
        "coll_ns": wait + 0.1e9,
        "wait_ns": wait,
        "transfer_ns": np.full((n_ranks, n_steps), 0.1e9),
        "late_ns": compute - compute.min(axis=0),
        "times_last": np.zeros((n_ranks, n_steps)),
        "exposed_wait_ns": wait,
        "exposed_transfer_ns": np.full((n_ranks, n_steps), 0.1e9),
    }
    work = {
        "tokens": np.full((n_ranks, n_steps), 8192.0),
        "attn_cost": rng.uniform(4e7, 5e7, (n_ranks, n_steps)),
    }
    device = {
        "sm_clock_mhz": np.full((n_ranks, n_steps), 1980.0),
        "temp_c": 62 + rng.standard_normal((n_ranks, n_steps)),
    }
    device["sm_clock_mhz"][slow] = 1650.0
    w = make_window(
        t_start,
        t_start + dur,
        ranks=ranks,
        groups=groups,
        phase_ns=phases,
        coll=coll,
        instances=inst,
        work=work,
        device=device,
        memory={"mem_reserved": np.full((n_ranks, n_steps), 6e10)},
        clock_error_ns=np.full(n_ranks, 5e3),
    )
    return w, n, slow


def _time(window, repeats: int) -> tuple[float, float, str]:
    times = []
    top = ""
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        d = diagnose(window)
        times.append(time.perf_counter() - t0)
        top = f"{d.verdict.top.mechanism} (ranks {list(d.verdict.top.ranks[:3])})"
    return statistics.median(times), min(times), top


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run(quick: bool) -> str:
    """Time full diagnosis passes; returns a Markdown section."""
    n_ranks, n_steps, calls = (1024, 50, 200) if quick else (4096, 100, 200)
    repeats = 3 if quick else 5
    rows = []
    load = _load()
    for label, tp in (("FSDP-like, world groups", 1), ("tp=8 inside hosts", 8)):
        window, n_inst, slow = big_window(n_ranks, n_steps, calls, tp)
        med, best, top = _time(window, repeats)
        rows.append((label, n_inst, med, best, top, slow))
        del window
        gc.collect()
    out = [
        f"Full `diagnose(window)` pass over {n_ranks:,} ranks × {n_steps} steps × {calls} "
        "collectives per rank-step (window built outside the timed region; median and best "
        f"of {repeats} runs; load average before the runs: {load}). Target ≤ 1 s.",
        "",
        "| layout | instances | median | best | median / target | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, n_inst, med, best, top, slow in rows:
        out.append(
            f"| {label} | {n_inst:,} | {med:.2f} s | {best:.2f} s | {med:.2f}x | {top}; "
            f"planted rank {slow} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
