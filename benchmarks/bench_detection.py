"""Detection latency: how many steps after a straggler appears the view names it.

A simulated job runs healthy, then one GPU throttles from step ``ONSET`` on (the scenario's
``fault.onset``). Its messages go, step by step, through the hub's `Intake` into a `Store`,
exactly as the live hub takes them. After each step the benchmark reads what the main
screen reads: the window of the TUI's default length (``ViewSettings.window_steps``), the
"last to arrive" ranking (`tui.mainmodel.last_ranking`) and the verdict line
(`diagnosis.diagnose`). A rank counts as *on screen* from the first step at which it tops
the ranking (or the verdict names it) and stays there for every later step measured.

Latency is in steps after the onset step itself: 1 = named once the first slow step
arrived. The live view adds its sampling interval (``refresh.sample_hz``) to the panel and
its diagnosis interval (``refresh.diagnosis_s``) to the verdict.

Target (ARCHITECTURE §9): a straggler on screen within 3 steps of onset.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

ONSET = 30
"""Healthy steps before the fault: the window already holds a history of healthy lasts."""
AFTER = 8
"""Steps measured from the onset on."""


@dataclass(frozen=True)
class Detection:
    ranks: int
    seed: int
    slow_rank: int
    ranking_steps: int | None
    """Steps after the onset until the slow rank tops the last-arriver ranking for good."""
    verdict_steps: int | None
    """Same for the verdict: top hypothesis ``slow_device`` naming the slow rank."""
    step_s: float
    """Wall seconds per step for ingest + window + ranking + verdict (what the view pays)."""


def _settled(hits: list[bool]) -> int | None:
    """1-based index of the first hit after which every entry is a hit."""
    for i in range(len(hits)):
        if all(hits[i:]):
            return i + 1
    return None


def detect(n_ranks: int, seed: int) -> Detection:
    """Run one job and measure when the slow rank is named.

    Args:
        n_ranks: world size.
        seed: scenario seed (picks the slow GPU and its slowdown).

    Returns:
        The measurement.
    """
    from rankscope.diagnosis import diagnose
    from rankscope.diagnosis.regime import current_regime
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store
    from rankscope.sim import Cluster, load_scenario
    from rankscope.sim.emit import Emitter, RankStreams
    from rankscope.tui.mainmodel import last_ranking
    from rankscope.tui.settings import ViewSettings

    window_steps = ViewSettings().window_steps
    scenario = load_scenario("slow-device", ranks=n_ranks, seed=seed, fault__onset=ONSET)
    cluster = Cluster(scenario, t0_ns=time.time_ns())  # hub-clock times, as a live job sends
    (slow,) = cluster.truth["ranks"]
    sent: list[bytes] = []

    class _Collect:
        def send(self, data: bytes, timeout_ms: float = 0, *, cancel: object = None) -> bool:
            sent.append(data)
            return True

    store = Store(history_steps=max(window_steps, ONSET + AFTER))
    intake = Intake(store)
    streams = RankStreams(cluster, Emitter([_Collect()], 0.0, None), run_id="onset", scope="full")
    streams.start()
    ranking_hits: list[bool] = []
    verdict_hits: list[bool] = []
    spent = 0.0
    for k in range(ONSET + AFTER):
        streams.add(cluster.step(k))
        t0 = time.perf_counter()
        for data in sent:
            intake.feed(data, time.time_ns())
        sent.clear()
        if k < ONSET:
            continue
        store.settle()
        w = store.window("onset", last=window_steps)
        regime = current_regime(w)  # as the main screen's model does
        top = last_ranking(w, limit=1, first_index=regime.start_index if regime else 0)
        ranking_hits.append(bool(top) and top[0].rank == slow)
        best = diagnose(w).verdict.hypotheses[0]
        verdict_hits.append(best.mechanism == "slow_device" and slow in best.ranks)
        spent += time.perf_counter() - t0
    return Detection(
        ranks=n_ranks,
        seed=seed,
        slow_rank=int(slow),
        ranking_steps=_settled(ranking_hits),
        verdict_steps=_settled(verdict_hits),
        step_s=spent / AFTER,
    )


def _fmt(steps: int | None) -> str:
    return f"> {AFTER}" if steps is None else str(steps)


def run(quick: bool) -> str:
    """Measure and report (Markdown)."""
    from rankscope.tui.settings import RefreshSettings, ViewSettings

    sizes = [512] if quick else [512, 4096]
    seeds = [3, 21] if quick else [3, 21, 40]
    rows = [detect(n, s) for n in sizes for s in seeds]
    lines = [
        "### Detection latency",
        "",
        f"A GPU throttles from step {ONSET} of a simulated `slow-device` job (the steps before "
        "are healthy); each step's messages go through the hub's intake into a store, and "
        f"after each step the view's window ({ViewSettings().window_steps} steps) is read as "
        "the main screen reads it. *Steps to name it*: steps after the onset (1 = the first "
        "slow step) until the slow rank tops the *last to arrive* panel, or the verdict line "
        "says `slow_device` naming it, and stays so for every later step measured "
        f"({AFTER}). The live view adds its sampling interval "
        f"({1 / RefreshSettings().sample_hz:g} s) to the panel and its diagnosis interval "
        f"({RefreshSettings().diagnosis_s:g} s) to the verdict. *s/step*: wall time of ingest, window, "
        "ranking and verdict per step on this machine.",
        "",
        "| ranks | seed | slow rank | steps to top the last-arriver panel | steps to the "
        "verdict | s/step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for d in rows:
        lines.append(
            f"| {d.ranks:,} | {d.seed} | {d.slow_rank} | {_fmt(d.ranking_steps)} | "
            f"{_fmt(d.verdict_steps)} | {d.step_s:.2f} |"
        )
    worst = [d.ranking_steps for d in rows]
    worst_v = [d.verdict_steps for d in rows]

    def most(xs: list[int | None]) -> str:
        return f"> {AFTER}" if any(x is None for x in xs) else str(max(x for x in xs if x))

    def met(xs: list[int | None]) -> str:
        return "met" if all(x is not None and x <= 3 for x in xs) else "not met"

    lines += [
        "",
        f"Target ≤ 3 steps: worst case {most(worst)} for the panel ({met(worst)}), "
        f"{most(worst_v)} for the verdict ({met(worst_v)}).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
