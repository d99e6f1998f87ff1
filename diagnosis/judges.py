"""The catalogue: every judge in one table, and how related judges share their evidence.

A judge reads the evidence of one window and says how much of the step its mechanism
costs (impact) and how specifically the data shows its signature (strength); `verdict`
turns the two into a score. Each entry also names the wall-time categories where the
mechanism's loss lands, so the open-world stage (`openworld`) can tell whether a
catalogued mechanism accounts for what localisation found.

One fault gets one name: where two judges read the same observation, `reconcile` lets
the more specific one keep it and shows the other what contradicts it, instead of scoring
the fault twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from rankscope.diagnosis.candidate import NONE, Candidate, pct
from rankscope.diagnosis.evidence import Evidence
from rankscope.diagnosis.hostside import (
    MIN_CPU_LOSS,
    SATURATED_PCT,
    contention_of,
    judge_cpu_contention,
    judge_host_pause,
)
from rankscope.diagnosis.mechanisms import (
    judge_allocator_growth,
    judge_checkpoint,
    judge_data_imbalance,
    judge_intermittent_congestion,
    judge_local_fabric,
    judge_network_rail,
    judge_numerator_change,
    judge_placement,
    judge_slow_device,
    judge_slow_host_input,
)
from rankscope.diagnosis.parallelism import judge_expert_imbalance, judge_pipeline_imbalance
from rankscope.diagnosis.robust import nanmedian, robust_z


@dataclass(frozen=True)
class Judge:
    """One catalogued mechanism."""

    judge: Callable[[Evidence], Candidate]
    categories: frozenset[str]
    """Wall-time categories its loss lands in."""
    moving: bool = False
    """It may move from rank to rank between steps (it explains a moving straggler)."""
    local: bool = False
    """Its loss is the named ranks' own time: its impact is at most their what-if."""


_COMM = frozenset({"exposed_comm", "arrival_wait"})
JUDGES: dict[str, Judge] = {
    "data_imbalance": Judge(judge_data_imbalance, frozenset({"compute"}), moving=True),
    "slow_device": Judge(judge_slow_device, frozenset({"compute"}), local=True),
    "slow_host_input": Judge(judge_slow_host_input, frozenset({"input"}), local=True),
    "local_fabric": Judge(judge_local_fabric, _COMM),
    "network_rail": Judge(judge_network_rail, _COMM),
    "placement": Judge(judge_placement, _COMM),
    "checkpoint": Judge(judge_checkpoint, frozenset({"checkpoint", "host_gap", "other"}), True),
    "allocator_growth": Judge(judge_allocator_growth, frozenset({"memory"}), moving=True),
    "intermittent_congestion": Judge(judge_intermittent_congestion, _COMM, moving=True),
    "numerator_change": Judge(judge_numerator_change, frozenset({"compute"}), moving=True),
    "pipeline_imbalance": Judge(
        judge_pipeline_imbalance, frozenset({"compute", "pipeline_idle"}), local=True
    ),
    "host_pause": Judge(judge_host_pause, frozenset({"host_gap", "compute", "other"}), True),
    # Its lost time is read from the compute phases' CPU share and lands there: a starved
    # thread is slow between its phases too, but nothing measures that part.
    "cpu_contention": Judge(judge_cpu_contention, frozenset({"compute"}), local=True),
    "expert_imbalance": Judge(judge_expert_imbalance, frozenset({"compute"}), moving=True),
}
"""Every catalogued mechanism (``healthy`` and ``unexplained_straggler`` are not judged
here: `verdict` and `openworld` derive them)."""


def candidates(ev: Evidence) -> dict[str, Candidate]:
    """Impact and strength of every catalogued mechanism on one window, reconciled.

    Args:
        ev: the window's evidence.

    Returns:
        Mechanism -> candidate (no baseline netting).
    """
    if not np.isfinite(ev.step_ns) or ev.step_ns <= 0:
        return {m: NONE for m in JUDGES}
    return reconcile(ev, {m: j.judge(ev) for m, j in JUDGES.items()})


def _at_most_what_if(ev: Evidence, out: dict[str, Candidate]) -> None:
    """A mechanism whose loss is its ranks' own time costs at most what those ranks would
    save by behaving like the median rank: the what-if is every such hypothesis's impact
    bound (a rank that computes 4 % longer than its work predicts but sets no step costs
    nothing)."""
    for mech, c in out.items():
        judge = JUDGES.get(mech)
        if judge is None or not judge.local or not c.ranks or c.impact <= 0:
            continue
        gain = ev.what_if(c.ranks)
        if np.isfinite(gain) and gain < c.impact:
            out[mech] = replace(
                c,
                impact=float(gain),
                evidence=(
                    *c.evidence,
                    f"what-if: the step would be {pct(gain)} shorter if rank(s) "
                    f"{', '.join(map(str, c.ranks[:4]))} behaved like the median rank",
                ),
            )


def reconcile(ev: Evidence, cands: dict[str, Candidate]) -> dict[str, Candidate]:
    """Let related judges share their evidence (see the module docstring).

    - A slow rank whose thread did not run (its compute phases got far less CPU per wall
      second than its peers') is not a slow device: ``slow_device`` fades by
      ``cpu_contention``'s strength and says why.
    - A device whose clocks are normal and whose utilisation is below its peers' is idle,
      not slow: ``slow_device`` halves and says so.
    - A whole pipeline stage that works longer is the stage's work, not one device, unless
      its clocks or throttle flags say otherwise.
    - Tokens routed to experts are data too: ``data_imbalance`` keeps only the compute
      lead that ``expert_imbalance`` does not account for.
    - Step spikes that the GC callbacks saw as pauses are ``host_pause``'s: ``checkpoint``
      (with no checkpoint phase recorded) fades by the share of their time the pauses
      account for.
    - Persistent extra transfer on one rail also raises every step's cross-host transfer
      above the quietest steps: bursts that a slow rail accounts for are not
      intermittent congestion, which keeps only what the rail does not cost.
    """
    out = dict(cands)
    _at_most_what_if(ev, out)
    sd = out.get("slow_device", NONE)
    if sd.strength > 0 and sd.ranks:
        notes, factor = [], 1.0
        cc = out.get("cpu_contention", NONE)
        c = contention_of(ev)
        if c is not None:
            starved = [r for r in sd.ranks if np.isfinite(c.loss[r]) and c.loss[r] >= MIN_CPU_LOSS]
            if starved:
                r = starved[0]
                factor *= 1.0 - max(cc.strength, 0.5)
                notes.append(
                    f"rank {r}'s {c.phase[r]} ran on the CPU only {pct(c.share[r])} of its "
                    f"wall time (its peers {pct(float(c.ref[r]))}): the thread "
                    "waited for the host, which a slow device does not explain"
                )
        idle = _idle_device(ev, sd.ranks)
        if idle:
            factor *= 0.5
            notes.append(idle)
        busy = _saturated_host(ev, sd.ranks)
        if busy:
            factor *= 0.7
            notes.append(busy)
        stage = out.get("pipeline_imbalance", NONE)
        if stage.strength > 0 and set(stage.ranks) <= set(sd.ranks) and not _device_flags(sd):
            factor *= 0.5
            notes.append(
                "the slow ranks are a whole pipeline stage: its work, not one device, is "
                "the first suspect"
            )
        if notes:
            out["slow_device"] = replace(
                sd, strength=sd.strength * factor, caveats=(*sd.caveats, *notes)
            )
    ei, di = out.get("expert_imbalance", NONE), out.get("data_imbalance", NONE)
    if ei.strength >= 0.5 and di.impact > 0:
        # Routed tokens are the data's imbalance too; what the experts' tokens account for
        # is expert_imbalance's, the rest (sequence lengths, Σseq²) stays data_imbalance's.
        out["data_imbalance"] = replace(
            di,
            impact=max(0.0, di.impact - ei.impact),
            caveats=(
                *di.caveats,
                f"tokens routed to the experts account for {pct(ei.impact)} of the step "
                "(expert_imbalance)",
            ),
        )
    ck, hp = out.get("checkpoint", NONE), out.get("host_pause", NONE)
    if ck.strength > 0 and hp.strength > 0:
        paused = _spikes_paused(ev)
        if paused > 0:
            out["checkpoint"] = replace(
                ck,
                strength=ck.strength * (1.0 - paused),
                caveats=(
                    *ck.caveats,
                    f"garbage-collection pauses account for {pct(paused)} of the step spikes' "
                    "extra time: host_pause's, not a checkpoint's",
                ),
            )
    nr, ic = out.get("network_rail", NONE), out.get("intermittent_congestion", NONE)
    if nr.strength >= 0.5 and ic.impact > 0:
        left = max(0.0, ic.impact - nr.impact)
        if left < ic.impact:
            out["intermittent_congestion"] = replace(
                ic,
                impact=left,
                caveats=(
                    *ic.caveats,
                    f"the slow rail ({', '.join(map(str, nr.rails))}) costs {pct(nr.impact)} of "
                    "the step on its own; the bursts beyond it are what is left",
                ),
            )
    return out


def _spikes_paused(ev: Evidence) -> float:
    """Share of the step spikes' extra time that the collector's GC callbacks saw as
    pauses (the longest pause of any rank in each spike step, at most its excess); 0 when
    a checkpoint phase was recorded (its spikes are then the checkpoint's own evidence) or
    nothing says."""
    sp = ev.trends.spikes
    gc = ev.window.host.get("gc_ns")
    if sp.steps.size == 0 or gc is None:
        return 0.0
    if np.nan_to_num(ev.decomp.category("checkpoint"), nan=0.0).any():
        return 0.0
    col = np.searchsorted(ev.window.steps, sp.steps)
    ok = (col < ev.window.steps.size) & (
        ev.window.steps[np.minimum(col, ev.window.steps.size - 1)] == sp.steps
    )
    if not ok.any():
        return 0.0
    pauses = np.where(ev.window.present & np.isfinite(gc), np.maximum(gc, 0.0), 0.0)
    longest = pauses[:, col[ok]].max(axis=0)
    excess = np.maximum(sp.excess_ns[ok], 0.0)
    total = float(excess.sum())
    return float(np.minimum(longest, excess).sum() / total) if total > 0 else 0.0


def _device_flags(c: Candidate) -> bool:
    """The candidate's evidence cites low clocks or throttle reasons."""
    return any(("SM clock" in e) or ("throttle" in e) for e in c.evidence)


def _idle_device(ev: Evidence, ranks: tuple[int, ...]) -> str | None:
    """Why the suspect devices look idle rather than slow (normal clocks, lower
    utilisation than their peers'), or None when the samples do not say."""
    dev = ev.window.device
    clock = nanmedian(dev["sm_clock_mhz"], axis=1)
    util = nanmedian(dev["gpu_util"], axis=1)
    if np.isfinite(clock).sum() < 3 or np.isfinite(util).sum() < 3:
        return None
    r = ranks[0]
    cz, uz = robust_z(clock), robust_z(util)
    throttled = np.nanmax(np.nan_to_num(dev["throttle"][r], nan=0.0)) > 0
    if not (np.isfinite(cz[r]) and np.isfinite(uz[r])) or throttled:
        return None
    if abs(cz[r]) < 2 and uz[r] < -3:
        return (
            f"rank {r}'s GPU runs at a normal SM clock ({clock[r]:.0f} MHz) but is busy only "
            f"{util[r]:.0f} % of the time (median {nanmedian(util):.0f} %): the device waits "
            "for its host"
        )
    return None


def _saturated_host(ev: Evidence, ranks: tuple[int, ...]) -> str | None:
    """Why the suspect's host may be the cause (its CPU saturated while most hosts' are
    not), or None when the samples do not say."""
    pct_by_rank = nanmedian(ev.window.device["cpu_pct"], axis=1)
    if np.isfinite(pct_by_rank).sum() < 2:
        return None
    r = ranks[0]
    if not (np.isfinite(pct_by_rank[r]) and pct_by_rank[r] >= SATURATED_PCT):
        return None
    if float(nanmedian(pct_by_rank)) >= SATURATED_PCT:
        return None
    return (
        f"the host of rank {r} runs its CPU {pct_by_rank[r]:.0f} % busy (median host "
        f"{nanmedian(pct_by_rank):.0f} %): a starved host slows its ranks as a slow device would"
    )
