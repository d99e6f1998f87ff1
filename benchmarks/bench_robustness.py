"""The diagnosis on streams broken the way real deployments break them.

Each simulated run (32 ranks in hosts of 8, 16 steps, no baseline: what `diagnose` sees of a
run alone) is diagnosed as sent, then once per perturbation of its messages:

- *lossy delivery*: 3 % of the steps messages dropped, 5 % of all messages sent twice, the
  messages shuffled after the hellos and group tables;
- *thin collectors*: no phases, half the ranks without device samples, only every third
  step reported, rank 5 joining at step 5;
- *data the window cannot vouch for*: rank 5's collectives not timed, rank 5 or half the
  ranks silent after their hello, host 1's clock 12 ms ahead and not aligned.

A lossy or thin stream **keeps** the verdict when its top mechanism and its first named rank
are the clean run's. A stream with data the window cannot vouch for is **right** when the
clean run's fault is still named (score ≥ 0.5; ranks of a healthy run: none), the affected
ranks are named by ``unexplained_straggler`` and ``healthy`` is not claimed.

    python benchmarks/run.py robustness          # or: python benchmarks/bench_robustness.py
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np

from rankscope.collector import schema
from rankscope.diagnosis import diagnose
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store
from rankscope.sim import load_scenario
from rankscope.sim.emit import iter_messages

T0 = 1_700_000_000_000_000_000
SCENARIOS = ("healthy", "slow-device", "host-gap", "network-rail", "data-imbalance")
Msgs = list[tuple[int, bytes]]


def _run(name: str, seed: int, steps: int = 16) -> list[tuple[int, bytes]]:
    """The messages of a seeded 32-rank simulated run (hosts of 8), as sent, with the rank
    that sends each."""
    scenario = load_scenario(name, ranks=32, topology__gpus_per_host=8, seed=seed)
    msgs = iter_messages(scenario, steps, run_id="r", t0_ns=T0)
    return [(int(schema.decode(d).header["rank"]), d) for d in msgs]


def _kind(data: bytes) -> str:
    return schema.decode(data).kind


def _first_step(data: bytes) -> int:
    return int(schema.decode(data).tables["steps"]["step"].min())


def _rebuilt(data: bytes, edit: Callable[[dict[str, dict[str, np.ndarray]]], None]) -> bytes:
    """A steps message with its tables edited in place by ``edit``."""
    m = schema.decode(data)
    tables = {n: {c: np.array(v) for c, v in t.items()} for n, t in m.tables.items()}
    edit(tables)
    h = {k: m.header[k] for k in ("job", "run", "rank", "inc", "batch")}
    return schema.steps_message(
        h, tables["steps"], tables.get("phases"), tables.get("colls"), m.header.get("phase_names")
    )


def _shift(tables: dict[str, dict[str, np.ndarray]], ns: int) -> None:
    for name, cols in (
        ("steps", ("t_start", "t_end")),
        ("phases", ("t0", "t1")),
        ("colls", ("t_enter", "t_start", "t_end", "t_exit")),
    ):
        for c in cols if name in tables else ():
            a = tables[name][c]
            a[a != schema.NO_TIME] += ns


def _map_steps(msgs: Msgs, ranks: range | set[int], fn: Callable[[bytes], bytes | None]) -> Msgs:
    out = []
    for r, d in msgs:
        if r in ranks and _kind(d) == "steps":
            got = fn(d)
            if got is None:
                continue
            d = got
        out.append((r, d))
    return out


def _shuffled(msgs: Msgs, rng: random.Random) -> Msgs:
    head = [m for m in msgs if _kind(m[1]) in ("hello", "groups")]
    rest = [m for m in msgs if _kind(m[1]) not in ("hello", "groups")]
    rng.shuffle(rest)
    return head + rest


def _dup(msgs: Msgs, rng: random.Random) -> Msgs:
    return [m for m in msgs for _ in range(2 if rng.random() < 0.05 else 1)]


def _drop(msgs: Msgs, rng: random.Random) -> Msgs:
    return [m for m in msgs if not (_kind(m[1]) == "steps" and rng.random() < 0.03)]


def _no_phases(d: bytes) -> bytes:
    return _rebuilt(d, lambda t: t.pop("phases", None))


def _no_colls(d: bytes) -> bytes:
    return _rebuilt(d, lambda t: t.pop("colls", None))


ALL = set(range(32))
KEEPS: dict[str, Callable[[Msgs, random.Random], Msgs]] = {
    "3 % of steps dropped": _drop,
    "5 % sent twice": _dup,
    "shuffled": _shuffled,
    "no phases": lambda m, _: _map_steps(m, ALL, _no_phases),
    "half without samples": lambda m, _: [
        x for x in m if not (x[0] % 2 == 0 and _kind(x[1]) == "samples")
    ],
    "every third step": lambda m, _: _map_steps(
        m, ALL, lambda d: d if _first_step(d) % 3 == 0 else None
    ),
    "rank 5 joins at step 5": lambda m, _: _map_steps(
        m, {5}, lambda d: d if _first_step(d) >= 5 else None
    ),
}
"""Perturbations that must keep the clean run's verdict."""

DOUBTS: dict[str, tuple[Callable[[Msgs, random.Random], Msgs], tuple[int, ...]]] = {
    "rank 5 times no collective": (lambda m, _: _map_steps(m, {5}, _no_colls), (5,)),
    "rank 5 silent after hello": (lambda m, _: _map_steps(m, {5}, lambda d: None), (5,)),
    "ranks 0-15 silent after hello": (
        lambda m, _: _map_steps(m, set(range(16)), lambda d: None),
        tuple(range(16)),
    ),
    "host 1 clock +12 ms": (
        lambda m, _: _map_steps(
            m, range(8, 16), lambda d: _rebuilt(d, lambda t: _shift(t, 12_000_000))
        ),
        tuple(range(8, 16)),
    ),
}
"""Perturbations the verdict must name (with the ranks affected), the fault kept."""


def _verdict(msgs: Msgs):  # type: ignore[no-untyped-def]
    store = Store(history_steps=64, raw_steps=16)
    Intake(store).feed_many([d for _, d in msgs], 0)
    store.settle()
    return diagnose(store.window("r")).verdict


def run(quick: bool) -> str:
    """Benchmark section (Markdown)."""
    seeds = (3,) if quick else (3, 4)
    keeps = {k: [0, 0] for k in KEEPS}
    doubts = {k: [0, 0] for k in DOUBTS}
    misses: list[str] = []
    t0 = time.perf_counter()
    for name in SCENARIOS:
        for seed in seeds:
            msgs = _run(name, seed)
            clean = _verdict(msgs).top
            for label, fn in KEEPS.items():
                top = _verdict(fn(msgs, random.Random(seed))).top
                ok = top.mechanism == clean.mechanism and top.ranks[:1] == clean.ranks[:1]
                keeps[label][0] += ok
                keeps[label][1] += 1
                if not ok:
                    misses.append(
                        f"{label}, {name} seed {seed}: {top.mechanism} {top.ranks[:4]} "
                        f"(clean: {clean.mechanism} {clean.ranks[:4]})"
                    )
            for label, (fn, affected) in DOUBTS.items():
                v = _verdict(fn(msgs, random.Random(seed)))
                named = v.get("unexplained_straggler")
                fault = clean.mechanism in ("healthy", "unexplained_straggler") or (
                    v.get(clean.mechanism).score >= 0.5
                )
                ok = (
                    set(affected) <= set(named.ranks)
                    and named.score == 1.0
                    and v.get("healthy").score == 0.0
                    and v.top.mechanism != "healthy"
                    and fault
                )
                doubts[label][0] += ok
                doubts[label][1] += 1
                if not ok:
                    misses.append(
                        f"{label}, {name} seed {seed}: top {v.top.mechanism} {v.top.ranks[:4]}, "
                        f"the clean run's {clean.mechanism} now "
                        f"{v.get(clean.mechanism).score:.2f}"
                    )
    rows = [f"| {k} | keeps | {a}/{n} |" for k, (a, n) in keeps.items()]
    rows += [f"| {k} | named, fault kept | {a}/{n} |" for k, (a, n) in doubts.items()]
    runs = len(SCENARIOS) * len(seeds)
    out = [
        "## Diagnosis on broken streams (`bench_robustness.py`)",
        "",
        f"{len(SCENARIOS)} scenarios ({', '.join(SCENARIOS)}) × {len(seeds)} seed(s), 32 ranks, "
        f"16 steps, no baseline: {runs} clean runs and {runs * (len(KEEPS) + len(DOUBTS))} "
        f"perturbed ones in {time.perf_counter() - t0:.0f} s. What each row must hold is in "
        "the module's docstring.",
        "",
        "| perturbation | must | runs right |",
        "|---|---|---:|",
        *rows,
        "",
    ]
    if misses:
        out += ["Not right:", "", *(f"- {m}" for m in misses), ""]
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
