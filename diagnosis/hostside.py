"""Judges of the host side: stop-the-world pauses and a host that cannot run its work.

- **host_pause**: the interpreter stops every thread for a garbage collection (or another
  stop-the-world pause) and the rank falls behind while its peers wait. The collector
  records the pauses that fall in each step (``gc_ns``, ``gc_count``, from
  ``gc.callbacks``). The what-if is exact on the step level: re-time each step with every
  rank paused only as long as the step's median rank, and see how much the step loses.
  Pauses on varying ranks cost as much as on one: whichever rank pauses sets the step.
- **cpu_contention**: the training thread is runnable but not running (another process
  takes the cores, a CPU quota throttles it, the launch thread of a GPU job is starved), so
  its phases take longer in wall time while its CPU time does not grow. The collector
  records the thread's CPU time per phase (``phase_cpu_ns``); a rank whose phases get a
  markedly smaller share of CPU than its peers' lost the difference to the host. A thread
  that blocks (a lock, a wait on its device, a sleep) runs less too; where the collector
  also read the kernel's run-queue delay (``runq_ns``), only the time the thread waited
  for a core beyond its peers counts. Host CPU saturation and, on GPUs, low utilisation at
  normal clocks support it.

Both also say what contradicts the alternatives: a rank that is slow because its thread
did not run is not a slow device (`contention_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.candidate import NONE, Candidate, hosts_of, ms, pct
from rankscope.diagnosis.decomposition import COMPUTE_PHASES
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.localise import trimmed_mean
from rankscope.diagnosis.robust import logistic, nanmedian, peer_median, peer_median_cols

MIN_CPU_LOSS = 0.15
"""A rank whose compute phases get this much less CPU per wall second than its peers'
median lost that share of its time to the host (a busy peer thread, a quota). Healthy
ranks of one job run their phases at nearly the same CPU share."""
SATURATED_PCT = 90.0
"""Host CPU busy above this (all cores, from the host samples) is saturated."""


def _trimmed(gain: np.ndarray) -> float:
    ok = gain[np.isfinite(gain)]
    return trimmed_mean(ok, ok.size) if ok.size else 0.0


def _retimed_gain(local: np.ndarray, less: np.ndarray) -> np.ndarray:
    """Per step, what the step loses when every rank's local time shrinks by ``less``:
    the largest local time now minus the largest after (ns, NaN where no rank reported)."""
    now = np.where(np.isfinite(local), local, -np.inf)
    after = np.where(np.isfinite(local), local - np.nan_to_num(less, nan=0.0), -np.inf)
    top_now, top_after = now.max(axis=0), after.max(axis=0)
    ok = np.isfinite(top_now)
    return np.where(ok, np.maximum(top_now - top_after, 0.0), np.nan)


def judge_host_pause(ev: Evidence) -> Candidate:
    gc = ev.window.host.get("gc_ns")
    if gc is None or not np.isfinite(gc).any():
        return NONE
    # An impossible pause (negative, infinite) reads as unknown, as the hub reads it.
    gc = np.where(ev.window.present & np.isfinite(gc), np.maximum(gc, 0.0), np.nan)
    local = ev.local
    med = nanmedian(gc, axis=0)
    excess = np.maximum(gc - med, 0.0)
    # Pauses beyond the step's median rank's delay that rank; pauses every rank takes in
    # the same step lengthen the step for all of them.
    uneven = _trimmed(_retimed_gain(local, excess)) / ev.step_ns
    shared = float(nanmedian(med)) / ev.step_ns if np.isfinite(med).any() else 0.0
    impact = max(uneven, shared)
    if not impact > 0:
        return NONE
    # The pausing ranks that set steps: those whose excess pause is most of their lead.
    seen = np.isfinite(local).any(axis=0)
    setter = np.where(seen, np.argmax(np.where(np.isfinite(local), local, -np.inf), axis=0), -1)
    cols = np.flatnonzero(setter >= 0)
    rows = setter[cols]
    lead = local[rows, cols] - nanmedian(local, axis=0)[cols]
    paused = excess[rows, cols]
    explained = float(np.nansum(np.minimum(paused, np.maximum(lead, 0.0))))
    total_lead = float(np.nansum(np.maximum(lead, 0.0)))
    share = explained / total_lead if total_lead > 0 else 0.0
    by_rank = np.bincount(rows, weights=np.nan_to_num(np.minimum(paused, lead), nan=0.0))
    ranks = tuple(int(r) for r in np.argsort(-by_rank)[:8] if by_rank[r] > 0)
    count = ev.window.host.get("gc_count")
    n_pause = (
        float(np.nansum(np.where(ev.window.present, count, np.nan))) if count is not None else 0
    )
    distinct = len({int(r) for r, p in zip(rows, paused) if p > 0})
    # A straggler whose lead the pauses explain is a host pause; pauses the step absorbs
    # (taken while the rank would have waited anyway) are not.
    strength = max(logistic(share, 0.3, 0.08), logistic(shared / max(impact, 1e-12), 0.5, 0.1))
    evidence = [
        f"garbage-collection pauses: {n_pause:.0f} in the window, "
        f"{ms(float(np.nanmax(gc)))} the longest",
        f"re-timed with every rank paused like the median rank, the step is {pct(uneven)} shorter",
        f"pauses account for {pct(share)} of the lead of the ranks that set the steps "
        f"({distinct} distinct rank(s) paused while setting a step)",
    ]
    if shared > 0.005:
        evidence.append(f"every rank pauses {pct(shared)} of the step in the same steps")
    return Candidate(
        float(impact), float(strength), ranks, hosts_of(ev, ranks), evidence=tuple(evidence)
    )


MIN_PHASE_SHARE = 0.1
"""A compute phase read for the CPU share holds at least this much of the peers' compute
wall time: a phase of a few hundred microseconds gives a share that is mostly noise."""


@dataclass(frozen=True)
class Contention:
    """How much CPU each rank's compute phases got per wall second, against its peers'."""

    share: np.ndarray
    """float64 (R,) median over steps of CPU / wall, in the phase the loss is read from
    (NaN: unknown)."""
    ref: np.ndarray
    """float64 (R,) the median share of each rank's peers (the other ranks), same phase."""
    loss: np.ndarray
    """float64 (R,) ``1 − share / ref``: the share of wall time the host took."""
    phase: tuple[str, ...]
    """(R,) the compute phase each rank's loss is read from ('' where none)."""
    lost_ns: np.ndarray
    """float64 (R, S) wall ns of compute phases the thread did not run: beyond its peers'
    median share in each phase, or in the phase where the peers ran most freely where
    that is higher."""
    saturated: np.ndarray
    """bool (R,) the rank's host reported CPU busy above `SATURATED_PCT`."""
    queued: np.ndarray | None = None
    """float64 (R,) where the collector measured the run-queue delay (``runq_ns``): the
    median over steps of the time the rank's thread waited for a core beyond its peers'
    (ns); None where it was not measured."""


def contention_of(ev: Evidence) -> Contention | None:
    """The CPU share of every rank's compute phases (None without CPU times).

    Phase by phase, not summed: a phase in which the peers block on a collective (DDP's
    gradient buckets in backward) runs at a low CPU share on every waiting rank, and summed
    with the others it hides the contrast of a starved rank. A starved thread is short of
    CPU in every phase, so each rank's loss is read from the phase where it is largest,
    among those holding at least `MIN_PHASE_SHARE` of the peers' compute time. A rank that
    merely waits inside a phase loses CPU share there too; it does not set the steps, so
    giving that time back shortens nothing and the judge's what-if is zero for it.
    """
    cpu_by_phase = ev.window.phase_cpu_ns
    phases = [p for p in COMPUTE_PHASES if p in cpu_by_phase and p in ev.window.phase_ns]
    if not phases:
        return None
    present = ev.window.present
    R = ev.window.world_size
    walls, shares, refs, ratios, cpus = [], [], [], [], []
    for p in phases:
        cpu = np.asarray(cpu_by_phase[p], dtype=np.float64)
        wall = np.nan_to_num(np.asarray(ev.window.phase_ns[p], dtype=np.float64), nan=0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where((wall > 0) & present, cpu / wall, np.nan)
        ratio = np.clip(ratio, 0.0, 1.5)  # CPU time of one thread cannot much exceed wall
        share = nanmedian(ratio, axis=1)
        walls.append(wall)
        cpus.append(cpu)
        ratios.append(ratio)
        shares.append(share)
        # Against its peers, not a median it is part of: with two ranks that is their
        # mean, and a rank at half its peer's CPU share would read only a third below it.
        refs.append(peer_median(share))
    share_pr, ref_pr = np.vstack(shares), np.vstack(refs)  # (P, R)
    if np.count_nonzero(np.isfinite(share_pr).any(axis=0)) < 2:
        return None
    held = np.vstack([nanmedian(np.where(present, w, np.nan), axis=1) for w in walls])
    held = np.nan_to_num(held, nan=0.0)
    weight = np.vstack([peer_median(h) for h in held])  # (P, R) the peers' wall per phase
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = weight / np.nansum(weight, axis=0, keepdims=True)
        loss_pr = np.clip(1.0 - share_pr / ref_pr, 0.0, 1.0)
    usable = np.isfinite(loss_pr) & (ref_pr > 0) & (np.nan_to_num(weight) >= MIN_PHASE_SHARE)
    if not usable.any():
        return None
    best = np.argmax(np.where(usable, loss_pr, -1.0), axis=0)  # (R,)
    cols = np.arange(R)
    found = usable[best, cols]
    loss = np.where(found, loss_pr[best, cols], np.nan)
    share = np.where(found, share_pr[best, cols], np.nan)
    ref = np.where(found, ref_pr[best, cols], np.nan)
    # What a thread that ran freely gets, per rank: its peers' share in the phase where it
    # is highest. A phase in which the peers block (waiting for this very rank in DDP's
    # buckets) reads low, and against it the starved rank's loss there would vanish.
    free = np.fmax.reduce(np.where(usable, ref_pr, np.nan), axis=0)
    lost = np.zeros_like(walls[0])
    for wall, cpu, ratio, rp in zip(walls, cpus, ratios, refs):
        with np.errstate(invalid="ignore", divide="ignore"):
            due = np.fmax(rp, free)[:, None]
            more = np.maximum(wall - np.nan_to_num(cpu, nan=0.0) / due, 0.0)
        lost += np.where(np.isfinite(ratio) & np.isfinite(more), more, 0.0)
    busy_pct = nanmedian(ev.window.device.get("cpu_pct", np.full(lost.shape, np.nan)), axis=1)
    saturated = np.isfinite(busy_pct) & (busy_pct >= SATURATED_PCT)
    # Host gaps are left out: a thread asleep between its phases (a synchronous wait, a
    # sleep) uses no CPU either, and the CPU clock cannot tell it from one kept off a core.
    # Where the collector read the run-queue delay, it can: only the time the thread waited
    # for a core beyond its peers counts, and the loss shrinks by the share of the lost
    # time that was not such a wait (a thread asleep inside its forward pass, blocked on
    # a device or a lock, waits on no run queue).
    queued = None
    runq = ev.window.host.get("runq_ns")
    if runq is not None:
        q = np.where(present & np.isfinite(runq), np.maximum(runq, 0.0), np.nan)
        measured: np.ndarray = np.asarray(np.isfinite(q).any(axis=1))
        if np.count_nonzero(measured) >= 2:
            # Against its peers' wait in the same step, not a median it is part of (with
            # two ranks that is their mean, and half a starved rank's wait would count).
            excess = np.maximum(q - peer_median_cols(q), 0.0)
            capped = np.where(np.isfinite(excess), np.minimum(lost, excess), lost)
            before = lost.sum(axis=1)
            after = capped.sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                kept = np.where(before > 0, after / before, 1.0)
            loss = np.where(measured, loss * kept, loss)
            lost = np.where(measured[:, None], capped, lost)
            queued = np.where(measured, nanmedian(excess, axis=1), np.nan)
    named = tuple(phases[int(b)] if f else "" for b, f in zip(best, found))
    return Contention(
        share=share,
        ref=ref,
        loss=loss,
        phase=named,
        lost_ns=lost,
        saturated=saturated,
        queued=queued,
    )


def judge_cpu_contention(ev: Evidence) -> Candidate:
    c = contention_of(ev)
    if c is None:
        return NONE
    starved = np.flatnonzero(np.nan_to_num(c.loss, nan=0.0) >= MIN_CPU_LOSS)
    if starved.size == 0 or starved.size > max(1, (3 * ev.window.world_size) // 4):
        return NONE
    less = np.zeros_like(c.lost_ns)
    less[starved] = c.lost_ns[starved]
    impact = _trimmed(_retimed_gain(ev.local, less)) / ev.step_ns
    if not impact > 0:
        return NONE
    starved = starved[np.argsort(-c.loss[starved])]
    top = int(starved[0])
    strength = logistic(float(c.loss[top]), MIN_CPU_LOSS + 0.05, 0.03)
    evidence = [
        f"rank {top}'s {c.phase[top]} ran on the CPU {pct(c.share[top])} of its wall time "
        f"vs {pct(float(c.ref[top]))} for its peers (median): the thread waited for a core",
        f"re-timed with that lost time given back, the step is {pct(impact)} shorter",
    ]
    if c.queued is not None and np.isfinite(c.queued[top]):
        evidence.append(
            f"its thread waited on the run queue for a core {ms(float(c.queued[top]))} a step "
            "longer than its peers' (the kernel's run-queue delay)"
        )
    if c.saturated[starved].any():
        evidence.append(
            f"host CPU busy above {SATURATED_PCT:.0f} % on {', '.join(hosts_of(ev, starved[c.saturated[starved]])[:3])}"
        )
    dev = ev.window.device
    util = nanmedian(
        dev.get("gpu_util", np.full(1, np.nan)).reshape(ev.window.world_size, -1), axis=1
    )
    if np.isfinite(util[top]) and np.isfinite(util).sum() >= 2:
        evidence.append(
            f"GPU utilisation of rank {top} {util[top]:.0f} % vs median {nanmedian(util):.0f} %: "
            "the device waits for the host"
        )
    ranks = tuple(int(r) for r in starved[:16])
    return Candidate(
        float(impact), float(strength), ranks, hosts_of(ev, ranks), evidence=tuple(evidence)
    )
