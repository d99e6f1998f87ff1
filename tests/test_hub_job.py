"""A synthetic job as wire messages, for the hub tests (and checks of the generator itself).

`job` builds what R ranks would send for S steps — hello, groups, steps with phases and
collectives, samples, stats — with one rank entering every collective ``delay`` ns late,
plus the same data as raw tables for ``build_window``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankscope.collector import schema

BASE = 1_700_000_000_000_000_000
STEP_NS = 10_000_000


@dataclass
class Job:
    run: str
    job: str
    world: int
    messages: list[bytes] = field(default_factory=list)
    """hellos and groups first, then every rank's steps interleaved, then samples, stats."""
    hellos: list[bytes] = field(default_factory=list)
    steps: list[list[bytes]] = field(default_factory=list)
    """steps[rank][i]: rank's i-th steps message."""
    raw: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    identities: dict[int, dict] = field(default_factory=dict)
    groups: list[dict] = field(default_factory=list)


def header(run: str, rank: int, job: str = "j", inc: int = 0, batch: int = 0) -> dict:
    return {"job": job, "run": run, "rank": rank, "inc": inc, "batch": batch}


def identity(rank: int, world: int, hosts: int = 2) -> dict:
    per = max(world // hosts, 1)
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": rank % per,
        "host": f"node{rank // per}",
        "node_rank": rank // per,
        "pid": 1000 + rank,
        "rail": rank % per,
        "gpu_index": rank % per,
    }


def _cat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def job(
    world: int = 4,
    steps: int = 6,
    colls: int = 3,
    slow: int = 2,
    delay: int = 50_000,
    run: str = "r1",
    name: str = "j",
    seed: int = 0,
    first_step: int = 0,
    async_buckets: bool = True,
) -> Job:
    """Build the messages of a synthetic job (see module docstring)."""
    rng = np.random.default_rng(seed)
    out = Job(run=run, job=name, world=world)
    groups = [
        {"id": 0, "name": "world", "ranks": list(range(world)), "backend": "gloo", "desc": ""},
        {"id": 1, "name": "even", "ranks": list(range(0, world, 2)), "backend": "gloo"},
    ]
    out.groups = groups
    for r in range(world):
        ident = identity(r, world)
        out.identities[r] = {**ident, "incarnation": 0}
        h = schema.hello_message(
            header(run, r, name), ident, manifest={"torch": "2.13", "rank": r}, t_start_ns=BASE
        )
        out.hellos.append(h)
        out.messages.append(h)
        out.messages.append(schema.groups_message(header(run, r, name), groups))
    per_rank: list[list[bytes]] = [[] for _ in range(world)]
    raw_steps, raw_phases, raw_colls = [], [], []
    seq = {0: 0, 1: 0}
    for i in range(steps):
        step = first_step + i
        t0 = BASE + i * STEP_NS
        start = t0 + rng.integers(0, 1000, world)
        n_c = colls + (1 if async_buckets else 0)
        enter = np.zeros((world, n_c), np.int64)
        exit_ = np.zeros((world, n_c), np.int64)
        grp = np.zeros(n_c, np.int32)
        sq = np.zeros(n_c, np.int64)
        flags = np.zeros(n_c, np.int32)
        for c in range(n_c):
            g = 1 if (c == n_c - 1 and world > 2) else 0
            grp[c] = g
            sq[c] = seq[g]
            seq[g] += 1
            e = start + 1_000_000 * (c + 1) + rng.integers(0, 2000, world)
            e[slow] += delay
            members = groups[g]["ranks"]
            last = e[members].max()
            enter[:, c] = e
            exit_[:, c] = last + 200_000 + rng.integers(0, 3000, world)
            if async_buckets and c == 0:
                flags[c] = schema.FLAG_DDP_BUCKET | schema.FLAG_ASYNC
        end = exit_.max(axis=1) + 500_000
        for r in range(world):
            st = schema.empty_table("steps", 1)
            st["step"][:] = step
            st["t_start"][:] = start[r]
            st["t_end"][:] = end[r]
            st["tokens"][:] = 1000 + r
            st["attn_cost"][:] = 1.5 * (r + 1)
            ph = schema.empty_table("phases", 3)
            ph["step"][:] = step
            ph["phase"][:] = [
                schema.PHASE_INDEX["forward"],
                schema.PHASE_INDEX["backward"],
                len(schema.PHASES),
            ]
            ph["t0"][:] = [start[r], start[r] + 300_000, start[r] + 900_000]
            ph["t1"][:] = [start[r] + 300_000, start[r] + 800_000, start[r] + 950_000]
            mine = [g_ for g_ in range(n_c) if r in groups[grp[g_]]["ranks"]]
            co = schema.empty_table("colls", len(mine))
            co["step"][:] = step
            co["op"][:] = schema.OP_INDEX["all_reduce"]
            co["group"][:] = grp[mine]
            co["seq"][:] = sq[mine]
            co["nbytes"][:] = 4096
            co["t_enter"][:] = enter[r, mine]
            co["t_exit"][:] = exit_[r, mine]
            co["flags"][:] = flags[mine]
            per_rank[r].append(
                schema.steps_message(
                    header(run, r, name, batch=i), st, ph, co, phase_names=["mine"]
                )
            )
            raw_steps.append({**st, "rank": np.array([r], np.int32)})
            raw_phases.append({**ph, "rank": np.full(3, r, np.int32)})
            raw_colls.append({**co, "rank": np.full(len(mine), r, np.int32)})
    out.steps = per_rank
    # Interleave ranks step by step, the slow rank's message last.
    order = [r for r in range(world) if r != slow] + [slow]
    for i in range(steps):
        for r in order:
            out.messages.append(per_rank[r][i])
    smp = []
    for r in range(world):
        s = schema.empty_table("samples", steps)
        s["t"][:] = BASE + np.arange(steps) * STEP_NS + 2_000_000
        s["sm_clock_mhz"][:] = 1400.0 - 100.0 * (r == slow)
        s["throttle"][:] = 4 if r == slow else 0
        s["rss_bytes"][:] = 1 << 30
        out.messages.append(schema.samples_message(header(run, r, name), s))
        smp.append({**s, "rank": np.full(steps, r, np.int32)})
        out.messages.append(
            schema.stats_message(
                header(run, r, name),
                {"dropped_batches": r, "dropped_events": 10 * r, "clock_error_ns": 1000 + r},
            )
        )
    out.raw = {
        "steps": _cat(raw_steps),
        "phases": _cat(raw_phases),
        "colls": _cat(raw_colls),
        "samples": _cat(smp),
    }
    return out


def test_generator_delays_the_slow_rank() -> None:
    j = job(world=4, steps=3, slow=1, delay=80_000)
    co = j.raw["colls"]
    world0 = co["group"] == 0
    by_rank = [co["t_enter"][world0 & (co["rank"] == r)] for r in range(4)]
    assert (by_rank[1] > np.maximum(by_rank[0], by_rank[2])).all()
    assert len(j.messages) == 4 * 2 + 4 * 3 + 4 * 2
    assert all(schema.decode(m).kind in schema.KINDS for m in j.messages)


def assert_windows_equal(a, b, skip: tuple[str, ...] = ("health",)) -> None:
    """Field-by-field equality of two Windows (NaN equal to NaN)."""
    import dataclasses

    def walk(x, y, path: str) -> None:
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                if path == "" and f.name in skip:
                    continue
                walk(getattr(x, f.name), getattr(y, f.name), f"{path}.{f.name}")
        elif isinstance(x, dict):
            assert set(x) == set(y), f"{path}: keys {sorted(map(str, set(x) ^ set(y)))}"
            for k in x:
                walk(x[k], y[k], f"{path}[{k}]")
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=path)
        else:
            assert x == y, f"{path}: {x!r} != {y!r}"

    walk(a, b, "")
