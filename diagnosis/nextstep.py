"""The next smallest experiment for each hypothesis (seed: "Write a falsifiable
perturbation" and "Reduce to the smallest sufficient experiment").

Each experiment names the scope to run at, the one change, the observation that would
support the hypothesis and the one that would reject it — stated before the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.diagnosis.controlled import Perturbation


@dataclass(frozen=True)
class NextExperiment:
    """One falsifiable perturbation."""

    scope: str
    """``one-rank``, ``one-node``, ``two-node``, ``full`` or ``none``."""
    change: str
    """The one change."""
    metric: str
    """The diagnostic metric that should move (a name `experiment.METRICS` measures)."""
    direction: str
    """``down`` or ``up``."""
    supports: str
    rejects: str
    perturbation: Perturbation | None = None
    """The controlled swap or sweep that separates the mechanism from its rivals, with its
    ranks chosen from the data (`controlled.perturbation`); None where none does."""


def _list(items: tuple | list, limit: int = 4) -> str:
    items = [str(i) for i in items]
    if not items:
        return "-"
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def next_experiment(
    mechanism: str,
    *,
    ranks: tuple[int, ...] = (),
    hosts: tuple[str, ...] = (),
    rails: tuple[int, ...] = (),
    groups: tuple[str, ...] = (),
    category: str | None = None,
) -> NextExperiment:
    """The next smallest experiment for a mechanism and what it implicates.

    Args:
        mechanism: one of the verdict vocabulary.
        ranks: implicated ranks.
        hosts: implicated hosts.
        rails: implicated rails.
        groups: implicated process groups.
        category: where the implicated ranks' extra time goes (``unexplained_straggler``).

    Returns:
        The experiment.
    """
    r, h, g = _list(ranks), _list(hosts), _list(groups)
    rail = _list([f"rail {x}" for x in rails])
    if mechanism == "data_imbalance":
        return NextExperiment(
            scope="one-node",
            change="replay the same packed batches on one node, then pack balancing the "
            "attention cost (Σseq²) as well as tokens",
            metric="arrival_wait",
            direction="down",
            supports="one node reproduces the compute skew without inter-node traffic, and "
            "the attention-balanced packer lowers max-rank compute and entry spread while "
            "post-arrival transfer stays flat",
            rejects="entry spread stays with balanced attention cost, or the slow rank "
            "stays put when shards are swapped (then hardware, not data)",
        )
    if mechanism == "slow_device":
        return NextExperiment(
            scope="one-rank",
            change=f"run the same micro batch alone on the GPU of rank(s) {r} ({h}) and on "
            "a healthy GPU; then swap the data shard of that rank with a neighbour",
            metric="compute_max",
            direction="down",
            supports="the suspect GPU is slower on identical inputs (low SM clock or throttle "
            "reasons) and the slowness stays with the GPU when shards are swapped",
            rejects="identical speed at one-rank scope, or the slowness follows the shard",
        )
    if mechanism == "slow_host_input":
        return NextExperiment(
            scope="one-node",
            change=f"on {h}, feed synthetic or pre-cached batches instead of the data loader",
            metric="input",
            direction="down",
            supports="the input wait on that host disappears and step time returns to the "
            "other hosts' level",
            rejects="the input wait stays with synthetic input (then host CPU or scheduling, "
            "not the data path)",
        )
    if mechanism == "local_fabric":
        return NextExperiment(
            scope="one-node",
            change=f"run the intra-node collective at the job's message sizes on {h} and on "
            "a healthy host (nccl-tests all_reduce over its GPUs)",
            metric="exposed_comm",
            direction="down",
            supports=f"busbw on {h} is well below the healthy host's at the same sizes "
            "(NVLink/PCIe degraded); the job recovers without that host",
            rejects="both hosts reach the same busbw (then not the local fabric)",
        )
    if mechanism == "network_rail":
        return NextExperiment(
            scope="two-node",
            change=f"between two hosts, run the cross-node collective on {rail} and on a "
            f"healthy rail; then remap the affected group(s) {g} off that rail",
            metric="exposed_comm",
            direction="down",
            supports="the slow message-size curve follows the rail and disappears from the "
            "remapped group",
            rejects="the curve stays slow after remapping, or both rails measure the same",
        )
    if mechanism == "placement":
        return NextExperiment(
            scope="two-node",
            change=f"on {h}, place ranks so each group of {g} sits inside one host "
            "(same group shape, only the rank-to-GPU mapping changes)",
            metric="exposed_comm",
            direction="down",
            supports="those groups' transfer drops to their intra-host peers' level",
            rejects="transfer stays slow with every group inside one host",
        )
    if mechanism == "checkpoint":
        return NextExperiment(
            scope="full",
            change="skip checkpoints for one interval (or write them asynchronously / to "
            "local disk first)",
            metric="checkpoint",
            direction="down",
            supports="the periodic step spikes vanish for that interval",
            rejects="spikes recur at the same period without a checkpoint",
        )
    if mechanism == "allocator_growth":
        return NextExperiment(
            scope="one-rank",
            change="rerun one rank long enough to cover the growth with a fixed allocator "
            "configuration (expandable segments, or static shapes) and a memory snapshot",
            metric="memory",
            direction="down",
            supports="reserved memory and memory-management time stop growing with time "
            "since start, and step time stays flat",
            rejects="growth continues with the fixed allocator configuration",
        )
    if mechanism == "intermittent_congestion":
        return NextExperiment(
            scope="two-node",
            change="repeat the cross-node collective at the job's largest message size in a "
            "loop between two of the job's hosts over the recurrence interval, outside the "
            "application",
            metric="transfer_p99",
            direction="down",
            supports="the primitive shows the same bursty tail (fabric congestion, not the "
            "application)",
            rejects="the primitive is stable over the same interval",
        )
    if mechanism == "pipeline_imbalance":
        return NextExperiment(
            scope="one-node",
            change=f"move one layer from the heavy stage ({r}) to its lightest neighbour, same "
            "micro-batch schedule and shapes",
            metric="pipeline_idle",
            direction="down",
            supports="the other stages' pipeline bubbles shrink and the step with them; the "
            "heavy stage's local time falls by about one layer's share",
            rejects="the bubbles stay with the same stage, or the heavy stage stays slow on "
            "a healthy GPU with the lighter split (then its device, not its work)",
        )
    if mechanism == "expert_imbalance":
        return NextExperiment(
            scope="one-node",
            change="replay the same tokens with the router's capacity factor lowered (or an "
            f"auxiliary balancing loss) so the experts of ranks {r} get the median share",
            metric="arrival_wait",
            direction="down",
            supports="all-to-all arrival skew and the wait of the other ranks fall with the "
            "token spread, transfer unchanged",
            rejects="the same ranks stay late with balanced tokens (then their devices or "
            "hosts), or the skew does not follow the tokens",
        )
    if mechanism == "host_pause":
        return NextExperiment(
            scope="one-rank",
            change="run one rank with garbage collection moved out of the step "
            "(gc.freeze() after start-up, gc.disable() with gc.collect() between steps), "
            "same batches",
            metric="host_gap",
            direction="down",
            supports="the pauses leave the steps and the step time drops by their share; "
            "the step no longer waits for the pausing rank",
            rejects="the stalls stay with collection off: another stop-the-world pause "
            "(a synchronous log, a page fault storm), profile the host thread",
        )
    if mechanism == "cpu_contention":
        return NextExperiment(
            scope="one-rank",
            change=f"run the rank of {h} alone with its own cores (taskset/cgroup isolation, "
            "nothing else on them), same batches; then list what else ran on that host",
            metric="compute",
            direction="down",
            supports="its phases' wall time falls back to their CPU time and the step to "
            "the peers' pace",
            rejects="the phases stay slow with the cores to itself (then the device or the "
            "work, not the host)",
        )
    if mechanism == "unexplained_straggler":
        return _unexplained(r, h, category)
    if mechanism == "numerator_change":
        return NextExperiment(
            scope="one-rank",
            change="run the current build with the baseline's data configuration (packing, "
            "padding, sequence lengths, recomputation)",
            metric="compute",
            direction="down",
            supports="step time returns to the baseline with the baseline's work per step: "
            "more executed work, not a systems loss",
            rejects="step time stays high with the baseline's work per step",
        )
    return NextExperiment(
        scope="none",
        change="none needed; keep the window as the baseline for later comparisons",
        metric="step_time",
        direction="down",
        supports="later windows stay within this one's distribution",
        rejects="a later window's p50 or tail leaves this distribution",
    )


_WHERE = {
    "host_gap": (
        "profile the host thread of rank(s) {r} between its phases (py-spy record on its "
        "PID) for a few steps, then run it alone with the same batches",
        "host_gap",
        "the gap reproduces on one rank and the profile shows the code that fills it",
        "no gap on one rank with the same batches: it needs its peers or its host (rerun "
        "it at one-node scope, or swap its host)",
    ),
    "compute": (
        "run the same micro batch alone on the device of rank(s) {r} ({h}) and on a "
        "healthy one; then swap its data shard with a neighbour",
        "compute",
        "the suspect is slower on identical inputs, and stays slower with a swapped shard",
        "identical speed at one-rank scope, or the slowness follows the shard",
    ),
    "input": (
        "run rank(s) {r} alone with the same data pipeline and then with synthetic input",
        "input",
        "the input wait reproduces on one rank and disappears with synthetic input",
        "no input wait on one rank: the loader is fine, look at the host's other work",
    ),
}


def _unexplained(r: str, h: str, category: str | None) -> NextExperiment:
    """The next experiment for a straggler no catalogued mechanism explains: make the
    category its time goes to visible on the smallest scope that still has it. Named on
    no rank (a regression against the baseline that no rank, host or stage sets): find the
    smallest scope that still shows it, from one rank up."""
    if r == "-":
        return NextExperiment(
            scope="one-rank",
            change="run one rank of this configuration and one of the baseline's side by "
            "side on the same host, same batches and local shapes",
            metric=category or "step_time",
            direction="down",
            supports="one rank is slower than the baseline's by about as much: a local cause "
            "(build, data, device or host settings), bisect between the two configurations",
            rejects="one rank matches the baseline: the regression needs the job's scale "
            "(climb the ladder: one node, two nodes)",
        )
    change, metric, supports, rejects = _WHERE.get(
        category or "",
        (
            "run rank(s) {r} ({h}) alone with the same batches and a host profiler, and "
            "record every phase of its step",
            category or "step_time",
            "the extra time reproduces on one rank and its phases show where",
            "no extra time on one rank: it needs its peers (rerun at one-node scope)",
        ),
    )
    return NextExperiment(
        scope="one-rank",
        change=change.format(r=r, h=h),
        metric=metric,
        direction="down",
        supports=supports,
        rejects=rejects,
    )
