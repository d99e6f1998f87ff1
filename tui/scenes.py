"""Small seeded synthetic runs for the TUI's tests and benchmark.

Each run is built from raw rows (steps, phases, collectives, device samples) through the
same ``build_window`` the hub uses, so the windows carry matched collective instances and
per-rank aggregates exactly as live data would. One step: input wait, forward, an
intra-host collective, backward, a world all-reduce that every rank enters when its
backward ends, then the optimizer. A slow rank enters late; everyone else waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import NO_TIME, OP_INDEX, PHASE_INDEX, empty_table
from rankscope.diagnosis.arrivals import build_window
from rankscope.diagnosis.window import Window

MS = 1_000_000
EPOCH_NS = 1_700_000_000 * 1_000_000_000
"""A fixed origin, so windows are identical run to run."""


@dataclass(frozen=True)
class Fault:
    """What goes wrong in a synthetic run."""

    kind: str = "healthy"
    """``healthy``, ``slow_device`` (one rank slower every step, low SM clock),
    ``data_imbalance`` (a different rank gets the heavy batch each step),
    ``slow_input`` (one host's ranks wait for data) or ``hang`` (in the last step the rank
    never reaches the world all-reduce: the others entered it and wait; nobody ends the
    step)."""
    rank: int = 0
    """The slow rank (``slow_device``) or any rank of the slow host (``slow_input``)."""
    extra_ms: float = 40.0
    """Extra time the fault costs the affected rank in a step."""


def synthetic_run(
    world: int = 64,
    steps: int = 60,
    *,
    fault: Fault | None = None,
    seed: int = 0,
    job: str = "demo-llm",
    run: str = "run-b",
    ranks_per_host: int = 8,
    first_step: int = 1000,
    manifest: dict | None = None,
) -> Window:
    """A seeded run of ``world`` ranks over ``steps`` steps.

    Args:
        world: ranks.
        steps: steps.
        fault: what goes wrong (default healthy).
        seed: random seed for the jitter.
        job: job name.
        run: run id.
        ranks_per_host: ranks per host (a host is one intra-host group).
        first_step: id of the first step.
        manifest: the run's manifest (default: a small fixed one).

    Returns:
        The window over every step.
    """
    fault = fault or Fault()
    rng = np.random.default_rng(seed)
    R, S = world, steps
    host = np.arange(R) // ranks_per_host
    n_hosts = int(host.max()) + 1
    input_ms = 2.0 + rng.gamma(2.0, 0.3, (R, S))
    fwd_ms = 30.0 + rng.normal(0, 0.4, (R, S))
    bwd_ms = 60.0 + rng.normal(0, 0.8, (R, S))
    sm = np.full((R, S), 1980.0) + rng.normal(0, 5, (R, S))
    if fault.kind == "slow_device":
        fwd_ms[fault.rank] += fault.extra_ms / 3
        bwd_ms[fault.rank] += fault.extra_ms * 2 / 3
        sm[fault.rank] = 1410.0 + rng.normal(0, 5, S)
    elif fault.kind == "data_imbalance":
        heavy = rng.integers(0, R, S)
        bwd_ms[heavy, np.arange(S)] += fault.extra_ms
    elif fault.kind == "slow_input":
        input_ms[host == host[fault.rank]] += fault.extra_ms
    elif fault.kind not in ("healthy", "hang"):
        raise ValueError(f"unknown fault {fault.kind!r}")
    hang = fault.kind == "hang"

    step_ids = first_step + np.arange(S)
    # Per rank and step: start, forward start, tp enter, tp exit, backward end, dp exit,
    # step end, last tp entry.
    t = np.zeros((R, S, 8), dtype=np.int64)
    rows: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "step", "op", "group", "seq")}
    times: dict[str, list[np.ndarray]] = {k: [] for k in ("t_enter", "t_exit", "nbytes")}
    start = np.full(R, EPOCH_NS, dtype=np.int64)
    ranks = np.arange(R)
    for j in range(S):
        t0 = start.copy()
        f0 = t0 + (input_ms[:, j] * MS).astype(np.int64)
        tp_enter = f0 + (fwd_ms[:, j] * MS).astype(np.int64)
        tp_last = np.zeros(R, dtype=np.int64)
        for h in range(n_hosts):
            members = host == h
            tp_last[members] = tp_enter[members].max()
        tp_exit = tp_last + int(0.4 * MS)
        bwd_end = tp_exit + (bwd_ms[:, j] * MS).astype(np.int64)
        dp_exit = bwd_end.max() + int(6 * MS) + rng.integers(0, MS // 5, R)
        end = dp_exit + int(3 * MS)
        t[:, j] = np.stack([t0, f0, tp_enter, tp_exit, bwd_end, dp_exit, end, tp_last], axis=1)
        for gid, enter, exit_, op, nbytes in (
            (1 + host, tp_enter, tp_exit, OP_INDEX["all_gather"], 8 << 20),
            (np.zeros(R, np.int64), bwd_end, dp_exit, OP_INDEX["all_reduce"], 200 << 20),
        ):
            rows["rank"].append(ranks)
            rows["step"].append(np.full(R, step_ids[j]))
            rows["op"].append(np.full(R, op))
            rows["group"].append(np.asarray(gid))
            rows["seq"].append(np.full(R, j))
            times["t_enter"].append(enter)
            times["t_exit"].append(exit_)
            times["nbytes"].append(np.full(R, nbytes))
        start = np.full(R, end.max() + int(0.5 * MS), dtype=np.int64)

    colls = {k: np.concatenate(v) for k, v in rows.items()}
    colls.update({k: np.concatenate(v) for k, v in times.items()})
    if hang:
        # The world all-reduce of the last step: the hung rank has no row, the others
        # entered and never left.
        last_dp = (colls["step"] == step_ids[-1]) & (colls["group"] == 0)
        colls["t_exit"][last_dp] = NO_TIME
        keep = ~(last_dp & (colls["rank"] == fault.rank))
        colls = {k: v[keep] for k, v in colls.items()}
    n_coll = colls["rank"].size
    colls.update(
        t_start=np.full(n_coll, NO_TIME, np.int64),
        t_end=np.full(n_coll, NO_TIME, np.int64),
        flags=np.zeros(n_coll, np.int32),
    )
    # A hung step never ends: its phases and samples are missing, and only the ranks still
    # inside it report the step, with no end time.
    S_done = S - 1 if hang else S
    grid_r, grid_s = np.meshgrid(ranks, np.arange(S_done), indexing="ij")
    rr, ss = grid_r.ravel(), grid_s.ravel()
    flat = t[:, :S_done].reshape(R * S_done, 8)
    tokens = np.full(R * S_done, 8192)
    step_table = {
        "rank": rr,
        "step": step_ids[ss],
        "t_start": flat[:, 0],
        "t_end": flat[:, 6],
        "tokens": tokens,
        "valid_tokens": tokens - rng.integers(0, 400, R * S_done),
        "samples": np.full(R * S_done, 4),
        "attn_cost": np.full(R * S_done, np.nan),
        "flops": np.full(R * S_done, np.nan),
        "mem_allocated": np.full(R * S_done, 40 << 30),
        "mem_reserved": np.full(R * S_done, 48 << 30),
        "mem_peak": np.full(R * S_done, 44 << 30),
        "alloc_retries": np.zeros(R * S_done, np.int32),
    }
    if hang:
        waiting = ranks[ranks != fault.rank]
        extra = empty_table("steps", waiting.size)
        extra.update(
            step=np.full(waiting.size, step_ids[-1]),
            t_start=t[waiting, -1, 0],
            t_end=np.full(waiting.size, NO_TIME),
        )
        step_table = {
            k: np.r_[v, waiting if k == "rank" else extra[k]] for k, v in step_table.items()
        }
    spans = (
        ("input", 0, 1),
        ("forward", 1, 3),
        ("backward", 3, 4),
        ("optimizer", 5, 6),
    )
    phases = {
        "rank": np.tile(rr, len(spans)),
        "step": np.tile(step_ids[ss], len(spans)),
        "phase": np.concatenate([np.full(R * S_done, PHASE_INDEX[p]) for p, _, _ in spans]),
        "t0": np.concatenate([flat[:, a] for _, a, _ in spans]),
        "t1": np.concatenate([flat[:, b] for _, _, b in spans]),
    }
    mid = (flat[:, 0] + flat[:, 6]) // 2
    samples = {
        "rank": rr,
        "t": mid,
        "sm_clock_mhz": sm[:, :S_done].ravel().astype(np.float32),
        "mem_clock_mhz": np.full(R * S_done, 2619.0, np.float32),
        "power_w": (600 - (1980 - sm[:, :S_done].ravel()) * 0.3).astype(np.float32),
        "temp_c": np.full(R * S_done, 62.0, np.float32),
        "throttle": np.zeros(R * S_done, np.int64),
        "gpu_util": np.full(R * S_done, 97.0, np.float32),
        "cpu_pct": np.full(R * S_done, 35.0, np.float32),
        "load1": np.full(R * S_done, 6.0, np.float32),
        "rss_bytes": np.full(R * S_done, 12 << 30),
    }
    identities = {
        r: {
            "rank": r,
            "world_size": R,
            "local_rank": r % ranks_per_host,
            "host": f"gpu-node-{h:03d}",
            "node_rank": h,
            "pid": 1000 + r,
            "gpu_index": r % ranks_per_host,
            "rail": r % ranks_per_host,
            "rack": f"rack-{h // 4:02d}",
            "nic": f"mlx5_{r % ranks_per_host}",
            "mesh": {"tp": r % ranks_per_host, "dp": r // ranks_per_host},
            "shard": r // ranks_per_host,
        }
        for r, h in zip(ranks.tolist(), host.tolist())
    }
    groups = [{"id": 0, "name": "dp", "ranks": ranks.tolist(), "backend": "nccl", "desc": ""}]
    groups += [
        {
            "id": 1 + h,
            "name": f"tp{h}",
            "ranks": np.flatnonzero(host == h).tolist(),
            "backend": "nccl",
            "desc": "",
        }
        for h in range(n_hosts)
    ]
    return build_window(
        job=job,
        run=run,
        identities=identities,
        groups=groups,
        steps=step_table,
        phases=phases,
        colls=colls,
        samples=samples,
        manifest=manifest
        or {
            "versions": {"torch": "2.13.0", "nccl": "2.27.3"},
            "config": {"global_batch": 4096, "micro_batch": 4, "seq_len": 8192},
        },
        world_size=R,
        clock_error_ns=np.full(R, 0.05 * MS),
        health={"events_per_s": 0},
    )
