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

from rankscope.collector.schema import NO_TIME, OP_INDEX, PHASE_INDEX
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
    ``data_imbalance`` (a different rank gets the heavy batch each step) or
    ``slow_input`` (one host's ranks wait for data)."""
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
    elif fault.kind != "healthy":
        raise ValueError(f"unknown fault {fault.kind!r}")

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

    n_coll = R * S * 2
    colls = {k: np.concatenate(v) for k, v in rows.items()}
    colls.update({k: np.concatenate(v) for k, v in times.items()})
    colls.update(
        t_start=np.full(n_coll, NO_TIME, np.int64),
        t_end=np.full(n_coll, NO_TIME, np.int64),
        flags=np.zeros(n_coll, np.int32),
    )
    grid_r, grid_s = np.meshgrid(ranks, np.arange(S), indexing="ij")
    rr, ss = grid_r.ravel(), grid_s.ravel()
    flat = t.reshape(R * S, 8)
    tokens = np.full(R * S, 8192)
    step_table = {
        "rank": rr,
        "step": step_ids[ss],
        "t_start": flat[:, 0],
        "t_end": flat[:, 6],
        "tokens": tokens,
        "valid_tokens": tokens - rng.integers(0, 400, R * S),
        "samples": np.full(R * S, 4),
        "attn_cost": np.full(R * S, np.nan),
        "flops": np.full(R * S, np.nan),
        "mem_allocated": np.full(R * S, 40 << 30),
        "mem_reserved": np.full(R * S, 48 << 30),
        "mem_peak": np.full(R * S, 44 << 30),
        "alloc_retries": np.zeros(R * S, np.int32),
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
        "phase": np.concatenate([np.full(R * S, PHASE_INDEX[p]) for p, _, _ in spans]),
        "t0": np.concatenate([flat[:, a] for _, a, _ in spans]),
        "t1": np.concatenate([flat[:, b] for _, _, b in spans]),
    }
    mid = (flat[:, 0] + flat[:, 6]) // 2
    samples = {
        "rank": rr,
        "t": mid,
        "sm_clock_mhz": sm.ravel().astype(np.float32),
        "mem_clock_mhz": np.full(R * S, 2619.0, np.float32),
        "power_w": (600 - (1980 - sm.ravel()) * 0.3).astype(np.float32),
        "temp_c": np.full(R * S, 62.0, np.float32),
        "throttle": np.zeros(R * S, np.int64),
        "gpu_util": np.full(R * S, 97.0, np.float32),
        "cpu_pct": np.full(R * S, 35.0, np.float32),
        "load1": np.full(R * S, 6.0, np.float32),
        "rss_bytes": np.full(R * S, 12 << 30),
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
