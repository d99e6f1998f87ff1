"""Wall-time decomposition of every rank's step (ARCHITECTURE §6).

Each ``t_end - t_start`` splits into ``CATEGORIES``, which sum to the step time exactly:

- ``exposed_comm`` = ``coll["exposed_transfer_ns"]``: post-arrival collective service the
  step could not hide;
- ``arrival_wait`` = ``coll["exposed_wait_ns"]``: time spent inside collectives waiting for
  the last rank to arrive;
- ``pipeline_idle``, ``input``, ``memory``, ``checkpoint``, ``recovery``: the ``pp_wait``,
  ``input``, ``memory``, ``checkpoint`` and ``recovery`` phases;
- ``compute``: when compute phases (forward, backward, optimizer, eval) were recorded, their
  sum minus the exposed collective time they also cover; when none was recorded, the whole
  residual. Collectives may be issued inside the compute spans (tensor-parallel all-reduce
  in forward, DDP's bucket wait inside backward) or between them; which, the window does
  not say. The covered part is therefore found as the amount by which compute phases,
  other phases and exposed collective time together overrun the step (at most the exposed
  collective time). This is exact whenever phases and collectives tile the step; otherwise
  compute may include up to the unlabelled gap;
- ``host_gap``: with compute phases recorded, the time inside the step that no phase and no
  exposed collective covers: the host between its recorded work (a synchronous log call,
  a Python pause, a launch-bound CPU, code the collector does not see). It is never
  folded into compute: a rank that spends 30 ms a step there is a straggler whose time
  goes nowhere the catalogue names, and localisation must show it. Without compute phases
  the residual is compute and the gap is not measured (0);
- ``other``: user-defined phases (up to what is left after the measured categories).

Pipeline send/recv: a ``pp_wait`` phase spans the blocking send/recv it waits in, which
the collective columns count as well. When the raw rows tell the two apart
(``exposed["p2p_ns"]``, from `exposure.exposed_union`), that time is left to
``pipeline_idle`` and taken out of the collective categories.

When measured categories add up to more than the step (overlapping spans, clock noise) they
are scaled down together so the decomposition still sums to the step time; the overflow is
kept in ``overlap_ns`` so nothing is hidden.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from rankscope.collector.schema import PHASES
from rankscope.diagnosis.robust import nanmax, nanmean
from rankscope.diagnosis.window import Window

CATEGORIES = (
    "compute",
    "exposed_comm",
    "arrival_wait",
    "pipeline_idle",
    "input",
    "memory",
    "checkpoint",
    "recovery",
    "host_gap",
    "other",
)
COMPUTE_PHASES = ("forward", "backward", "optimizer", "eval")
PHASE_CATEGORIES = {
    "pipeline_idle": "pp_wait",
    "input": "input",
    "memory": "memory",
    "checkpoint": "checkpoint",
    "recovery": "recovery",
}
"""Category -> the phase that measures it."""
_BUILTIN_PHASES = frozenset(PHASES)

COMPUTE_RULE = (
    "compute = forward+backward+optimizer+eval phases minus the exposed collective time "
    "they also cover (the overrun of phases + collectives past the step); without compute "
    "phases, the residual of the step; host_gap = what no phase or exposed collective covers"
)


@dataclass(frozen=True)
class Decomposition:
    """Per rank and step, the step time split into ``CATEGORIES``."""

    ns: np.ndarray
    """float64 (C, R, S), category index first; NaN where the rank did not report."""
    step_ns: np.ndarray
    """float64 (R, S) step wall time."""
    overlap_ns: np.ndarray
    """float64 (R, S) how far measured categories overran the step before scaling."""
    compute_from_phases: np.ndarray
    """bool (R, S): compute came from recorded phases (else the residual)."""
    computed: frozenset[str] = frozenset(CATEGORIES)
    """The categories split out (`decompose`'s ``only``); ``ns`` holds zeros for the rest."""

    def category(self, name: str) -> np.ndarray:
        """The (R, S) array of one category.

        Args:
            name: one of ``CATEGORIES``.

        Returns:
            float64 (R, S) ns.

        Raises:
            KeyError: for an unknown category, or one this decomposition did not compute.
        """
        if name not in CATEGORIES:
            raise KeyError(f"unknown category {name!r}; expected one of {CATEGORIES}")
        if name not in self.computed:
            raise KeyError(f"category {name!r} was not computed (only {sorted(self.computed)})")
        return self.ns[CATEGORIES.index(name)]

    def mean_per_step(self) -> dict[str, float]:
        """Mean over present rank-steps of each category computed (all of them sum to the
        mean step time)."""
        return {
            c: float(nanmean(self.ns[i])) for i, c in enumerate(CATEGORIES) if c in self.computed
        }

    def max_rank_per_step(self) -> dict[str, float]:
        """Per category computed, the largest rank's value averaged over steps (maxima set
        pace)."""
        return {
            c: float(nanmean(nanmax(self.ns[i], axis=0)))
            for i, c in enumerate(CATEGORIES)
            if c in self.computed
        }


def decompose(
    window: Window,
    exposed: dict[str, np.ndarray] | None = None,
    only: Collection[str] | None = None,
) -> Decomposition:
    """Split every rank's step time into ``CATEGORIES`` (rule in the module docstring).

    Args:
        window: the window.
        exposed: ``exposed_wait_ns`` / ``exposed_transfer_ns`` (R, S) to use instead of the
            window's per-row sums (`exposure.exposed_union`, which counts overlapping
            asynchronous collectives once).
        only: the categories to write out (default all): each is the same as in the full
            split (the scaling of overlapping categories needs every measured one anyway),
            the others are left out (a heatmap of one category at 65,536 ranks then writes
            one (R, S) array, not ten).

    Returns:
        The decomposition; categories sum to ``t_end - t_start`` on every present rank-step.

    Raises:
        KeyError: ``only`` names an unknown category.
    """
    computed = frozenset(CATEGORIES if only is None else only)
    if not computed <= set(CATEGORIES):
        bad = sorted(computed - set(CATEGORIES))
        raise KeyError(f"unknown categories {bad}; expected some of {CATEGORIES}")
    shape = window.present.shape
    step = np.empty(shape)
    # Zeros on demand: a category no rank measured is never written (at 65k ranks most of
    # the array's pages are then never touched).
    out = np.zeros((len(CATEGORIES), *shape))
    overlap = np.empty(shape)
    has_phases = np.empty(shape, bool)
    # Every rank-step splits on its own: blocks of ranks keep each step's temporaries in
    # the cache (the whole (R, S) arrays at a time cost several times more at 65k ranks).
    rows = max(1, _BLOCK_CELLS // max(shape[1], 1))
    for r0 in range(0, shape[0], rows):
        at = slice(r0, r0 + rows)
        _split(window, exposed, at, step[at], out[:, at], overlap[at], has_phases[at], computed)
    return Decomposition(
        ns=out, step_ns=step, overlap_ns=overlap, compute_from_phases=has_phases, computed=computed
    )


_BLOCK_CELLS = 65_536
"""Rank-steps `decompose` splits at a time."""


def _split(
    window: Window,
    exposed: dict[str, np.ndarray] | None,
    at: slice,
    step: np.ndarray,
    out: np.ndarray,
    overlap: np.ndarray,
    has_phases: np.ndarray,
    computed: frozenset[str],
) -> None:
    """`decompose` for the ranks ``at``: fills ``step`` (r, S), ``out`` (C, r, S) for the
    ``computed`` categories, ``overlap`` and ``has_phases`` (r, S).

    The arrays `_known` returns may be the window's own: nothing here writes into them.
    """
    np.subtract(window.t_end[at], window.t_start[at], out=step)
    absent = None
    if not (window.present[at].all() and _positive(step)):
        present = np.isfinite(step)
        present &= window.present[at]
        absent = None if present.all() else ~present
        if absent is not None:
            step[absent] = np.nan
        np.maximum(step, 0.0, out=step)
    shape = step.shape

    def phase(name: str) -> np.ndarray | None:
        arr = window.phase_ns.get(name)
        return None if arr is None else _known(arr[at])

    src = window.coll if exposed is None else exposed
    wait = _known(src["exposed_wait_ns"][at])
    transfer = _known(src["exposed_transfer_ns"][at])
    # Time inside calls whose instance did not complete (a member's rows missing) is
    # known to be collective time, not how much was waiting: counted as exposed comm, not
    # left to read as compute (from raw rows, the union counts it already).
    unsplit = _unsplit(window, at, wait, transfer) if exposed is None else None
    if unsplit is not None:
        transfer = transfer + unsplit
    pp_wait = phase("pp_wait")
    if exposed is not None and "p2p_ns" in exposed and pp_wait is not None:
        # Take the send/recv time out of wait first, then transfer: pp_wait holds it.
        p2p = np.minimum(np.nan_to_num(exposed["p2p_ns"][at], nan=0.0), pp_wait)
        from_wait = np.minimum(p2p, wait)
        wait = wait - from_wait
        transfer = np.maximum(transfer - (p2p - from_wait), 0.0)
    measured: dict[str, np.ndarray | None] = {
        "exposed_comm": transfer,
        "arrival_wait": wait,
        **{cat: pp_wait if ph == "pp_wait" else phase(ph) for cat, ph in PHASE_CATEGORIES.items()},
    }
    # A phase no rank recorded is zero everywhere: left out of the sums, written as zeros.
    compute_phases = _total([phase(p) for p in COMPUTE_PHASES], shape)
    np.greater(compute_phases, 0.0, out=has_phases)
    all_phases = bool(has_phases.all())
    no_phases = ~has_phases if not all_phases else None
    coll = np.add(wait, transfer)
    known = [v for v in measured.values() if v is not None]
    # transfer + wait is the collective time: the sum of these two alone is not made twice.
    measured_sum = coll if len(known) == 2 else _total(known, shape)
    # Without compute phases compute is the residual (`room`), and what the phases would
    # cover does not count.
    compute = None
    if all_phases or has_phases.any():
        covered = np.add(compute_phases, measured_sum)
        covered -= step
        bound = np.minimum(coll, compute_phases)
        # ``np.clip(covered, 0, bound)`` as two passes of simpler loops (2/3 of its time).
        # They differ from it only in the sign of a zero, which no result keeps: compute
        # is ``compute_phases - covered`` only where compute phases are above 0, and
        # ``x - ±0.0 == x`` there.
        np.maximum(covered, 0.0, out=covered)
        np.minimum(covered, bound, out=covered)
        compute = np.subtract(compute_phases, covered, out=covered)
        if no_phases is not None:
            compute[no_phases] = 0.0
    total = np.add(measured_sum, 0.0) if compute is None else np.add(compute, measured_sum)
    np.subtract(total, step, out=overlap)
    # ``total - step > 0`` exactly where ``total > step``: both are non-negative.
    over = overlap > 0.0
    np.maximum(overlap, 0.0, out=overlap)
    # Where nothing overran, the scale is 1 and every category is its measured value.
    scale = None
    if over.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.divide(step, total, out=total)
        scale[~over] = 1.0
        if compute is not None:
            compute *= scale
    room = None
    if "other" in computed or "host_gap" in computed or ("compute" in computed and not all_phases):
        # Without compute phases, everything not measured is compute.
        room = step.copy() if compute is None else np.subtract(step, compute)
        room -= measured_sum if scale is None else np.multiply(measured_sum, scale)
        np.maximum(room, 0.0, out=room)
    other = None
    if "other" in computed or "host_gap" in computed:
        assert room is not None
        user = _total(
            [
                _known(arr[at])
                for name, arr in window.phase_ns.items()
                if name not in _BUILTIN_PHASES
            ],
            shape,
        )
        other = np.where(has_phases, np.minimum(room, user), 0.0)
    for i, cat in enumerate(CATEGORIES):
        if cat not in computed:
            continue
        if cat == "compute":
            if compute is None:
                out[i] = room
            else:
                out[i] = compute
                if no_phases is not None:
                    assert room is not None
                    out[i][no_phases] = room[no_phases]
        elif cat == "other":
            assert other is not None
            out[i] = other
        elif cat == "host_gap":
            assert room is not None and other is not None
            np.subtract(room, other, out=out[i])
            if no_phases is not None:
                out[i][no_phases] = 0.0
        else:
            value = measured[cat]
            if value is None:
                pass  # zero, as ``out`` came
            elif scale is None:
                out[i] = value
            else:
                np.multiply(value, scale, out=out[i])
        if absent is not None:
            out[i][absent] = np.nan
    if absent is not None:
        overlap[absent] = np.nan


def _unsplit(
    window: Window, at: slice, wait: np.ndarray, transfer: np.ndarray
) -> np.ndarray | None:
    """Per rank-step of ``at``, the exposed part (``wait`` + ``transfer``) of the time
    inside collectives whose instance did not complete (``coll_ns`` less the wait and
    transfer of the complete calls, which split each one's time exactly), at the share of
    the complete calls' time that was exposed (all of it where none completed: a blocking
    call's time is all exposed); None when every call completed."""
    coll = window.coll.get("coll_ns")
    all_wait, all_transfer = window.coll.get("wait_ns"), window.coll.get("transfer_ns")
    if coll is None or all_wait is None or all_transfer is None:
        return None
    inside = np.add(_known(all_wait[at]), _known(all_transfer[at]))
    out = np.subtract(_known(coll[at]), inside)
    # Sums of the same calls' shares: what stays below a nanosecond is rounding. (No NaN:
    # known times are finite, so the difference is at worst an infinity.)
    if out.size == 0 or not out.max() >= 1.0:
        return None
    out[out < 1.0] = 0.0
    exposed = wait + transfer
    with np.errstate(all="ignore"):
        share = np.where(inside > 0, exposed / inside, 1.0)
    return out * np.clip(share, 0.0, 1.0)


def _known(arr: np.ndarray) -> np.ndarray:
    """A measured time as `decompose` counts it: NaN (unknown) and negative as 0, and an
    infinity as the largest float (as ``np.nan_to_num``).

    An array that is already all ``+0.0`` or positive and finite (the usual case, told by
    `_positive`) comes back as it is, not copied: the caller must not write into the
    result. Otherwise a new array, in two passes.
    """
    if _positive(arr):
        return arr
    out = np.fmax(arr, 0.0)
    return np.minimum(out, _FLOAT_MAX, out=out)


def _positive(arr: np.ndarray) -> bool:
    """Whether every element of a float64 array is ``+0.0`` or positive and finite: one
    reduction over its bits, which reads the array once and writes nothing. As unsigned
    integers these floats are exactly ``[0, _FINITE_BITS]``; a set sign bit (negatives,
    and ``-0.0``, which ``np.fmax(x, 0.0)`` may turn into ``+0.0``), an infinity or a NaN
    is above it."""
    return bool(arr.dtype == np.float64 and arr.size and arr.view(np.uint64).max() <= _FINITE_BITS)


_FLOAT_MAX = float(np.finfo(np.float64).max)
_FINITE_BITS = int(np.array(_FLOAT_MAX).view(np.uint64))


def _total(parts: Sequence[np.ndarray | None], shape: tuple[int, ...]) -> np.ndarray:
    """Sum of the known ``parts`` (None: zero everywhere), in their order. With one known
    part, that part itself: the caller must not write into the result."""
    known = [p for p in parts if p is not None]
    if not known:
        return np.zeros(shape)
    if len(known) == 1:
        return known[0]
    out = np.add(known[0], known[1])
    for p in known[2:]:
        out += p
    return out


@dataclass(frozen=True)
class CategoryDelta:
    """One category against the baseline, as mean ns per rank-step."""

    category: str
    baseline_ns: float
    current_ns: float
    delta_ns: float
    max_rank_baseline_ns: float
    """Largest rank's value, averaged over steps (the critical path's view)."""
    max_rank_current_ns: float


@dataclass(frozen=True)
class DecompositionDelta:
    """Current decomposition against a baseline run."""

    rows: tuple[CategoryDelta, ...]
    step_baseline_ns: float
    step_current_ns: float
    first_appears: str | None
    """Category that grew most — where the missing time first appears (None: nothing grew)."""


def compare(current: Decomposition, baseline: Decomposition) -> DecompositionDelta:
    """Per category: baseline, current and delta of the mean and of the max rank.

    Args:
        current: decomposition of the run under study.
        baseline: decomposition of the healthy run.

    Returns:
        The table and the category where the missing time first appears.
    """
    cur_mean = current.mean_per_step()
    base_mean = baseline.mean_per_step()
    cur_max = current.max_rank_per_step()
    base_max = baseline.max_rank_per_step()
    rows = tuple(
        CategoryDelta(
            category=c,
            baseline_ns=base_mean[c],
            current_ns=cur_mean[c],
            delta_ns=cur_mean[c] - base_mean[c],
            max_rank_baseline_ns=base_max[c],
            max_rank_current_ns=cur_max[c],
        )
        for c in CATEGORIES
    )
    step_cur = float(nanmean(current.step_ns))
    step_base = float(nanmean(baseline.step_ns))
    grown = [r for r in rows if r.delta_ns > 0]
    first = max(grown, key=lambda r: r.delta_ns).category if grown else None
    return DecompositionDelta(
        rows=rows, step_baseline_ns=step_base, step_current_ns=step_cur, first_appears=first
    )
