"""Data or hardware? Which rank is slowest each step, and whether its work explains it.

The seed's discriminator: a slow rank that stays the same from step to step while its work
is ordinary is hardware-like (a throttled GPU); one that moves with the batch and whose
compute follows the work it was given — tokens and above all Σseq², the attention cost of
its packed sequences — is data-like. Compute is compared within each step (relative to
the step's median rank), so a step that is slow for everyone says nothing about a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.diagnosis.decomposition import Decomposition
from rankscope.diagnosis.robust import (
    binomial_tail,
    majority_level,
    nanmean,
    nanmedian,
    pearson,
    peer_median,
    robust_z,
    spearman,
)
from rankscope.diagnosis.window import Window


@dataclass(frozen=True)
class SlowRankPattern:
    """Is the slowest rank the same every step?"""

    slowest: np.ndarray
    """int64 (S,) per step, the rank with the highest relative compute (-1: none)."""
    modal_rank: int
    modal_share: float
    """Share of steps in which ``modal_rank`` was the slowest."""
    distinct: int
    """Distinct ranks that were slowest in some step."""
    split_half_r: float
    """Pearson r across ranks between mean relative compute in the first and second half
    of the steps: near 1 a persistent per-rank offset, near 0 it moves with the batch."""
    persistent: np.ndarray
    """float64 (R,) relative compute (1.0 = the step's median rank) that a majority of the
    rank's steps reach (`robust.majority_level`: the median, the lower one for an even
    count of steps)."""
    persistent_z: np.ndarray
    """float64 (R,) robust z of ``persistent`` across ranks."""
    residual: np.ndarray
    """float64 (R,) (compute − work-predicted compute) / the step's median compute, at the
    level a majority of the rank's steps reach (as ``persistent``): the slowness the rank's
    own work does not explain. One spike in a two-step window is not a slow rank."""
    residual_z: np.ndarray
    """float64 (R,) robust z of ``residual`` across ranks."""

    @property
    def stable(self) -> bool:
        """Hardware-like: the same rank is slowest in most steps."""
        return self.modal_share >= 0.5


@dataclass(frozen=True)
class WorkCorrelation:
    """Does compute follow the work each rank was given?"""

    tokens_rho: float
    """Spearman ρ of compute with tokens, pooled over steps after removing step medians."""
    attn_rho: float
    """Spearman ρ of compute with Σseq² (``attn_cost``), same pooling."""
    r2: float
    """R² of compute on tokens and Σseq² within steps (least squares, step means removed)."""
    slowest_is_heaviest: float
    """Share of steps whose slowest rank also had the largest Σseq² (or tokens; ties with
    the largest count)."""
    attn_max_ratio: float
    """Median over steps of max/median Σseq² across ranks (1 = balanced)."""
    tokens_max_ratio: float
    """Median over steps of max/median tokens across ranks."""
    compute_max_ratio: float
    """Median over steps of max/median compute across ranks."""
    work_excess: float
    """Median over steps of (largest − median) work-predicted compute, over the step time:
    how far behind the slowest rank would be if compute followed the work exactly."""
    compute_excess: float
    """Median over steps of (largest − median) measured compute over the step time."""

    def rho_text(self, name: str) -> str:
        """``"ρ 0.93"`` for ``"tokens"`` or ``"attn_cost"``; where ρ is undefined, why.

        A work column equal on every rank (the token-balanced packer's tokens) has no rank
        order to correlate with, which says more than a NaN.
        """
        rho, ratio = (
            (self.tokens_rho, self.tokens_max_ratio)
            if name == "tokens"
            else (self.attn_rho, self.attn_max_ratio)
        )
        if np.isfinite(rho):
            return f"ρ {rho:.2f}"
        if ratio == 1.0:
            return "equal on every rank"
        return "ρ undefined (not recorded or constant)"


def relative_to_step(x: np.ndarray) -> np.ndarray:
    """Divide each step's values by that step's median rank (NaN where the median is ≤ 0).

    Args:
        x: float (R, S).

    Returns:
        float64 (R, S).
    """
    med = nanmedian(x, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(med > 0, x / np.where(med > 0, med, 1.0), np.nan)


DATA_WORK = ("tokens", "attn_cost")
"""Work columns the data gives each rank (what a packer balances)."""
ALL_WORK = (*DATA_WORK, "expert_tokens")
"""...and the tokens a mixture-of-experts router sends to each rank's experts."""


def work_model(
    window: Window, decomp: Decomposition, columns: tuple[str, ...] = ALL_WORK
) -> tuple[np.ndarray, float]:
    """Compute predicted from the work each rank was given, within each step.

    Least squares of compute on the ``columns`` that were recorded (tokens, Σseq², expert
    tokens) after removing each step's median rank
    (a slow step for everyone is not a rank effect). Where work was not recorded the
    prediction is the step's median compute, so the residual is the plain deviation.

    Args:
        window: the window.
        decomp: its decomposition.
        columns: the work columns to fit on.

    Returns:
        ``(pred, r2)``: float64 (R, S) predicted compute (ns) and the fit's R² (NaN when
        no work column was recorded or compute does not vary).
    """
    compute = decomp.category("compute")
    base = nanmedian(compute, axis=0)
    pred = np.broadcast_to(base, compute.shape).copy()
    regs = []
    # Tokens routed to a rank's experts are work too (mixture of experts): a rank whose
    # experts got more tokens is not a slow device.
    for name in columns:
        if name not in window.work:
            continue
        x = np.where(window.present & (window.work[name] >= 0), window.work[name], np.nan)
        if np.isfinite(x).sum() > 2:
            regs.append(x - nanmedian(x, axis=0))
    if not regs:
        return pred, float("nan")
    y = (compute - base).ravel()
    x = np.stack([r.ravel() for r in regs], axis=1)
    ok = np.isfinite(y) & np.isfinite(x).all(axis=1)
    if ok.sum() <= x.shape[1] + 2:
        return pred, float("nan")
    xo = x[ok]
    scale = xo.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    beta, *_ = np.linalg.lstsq(xo / scale, y[ok], rcond=None)
    fit = np.full(y.shape, np.nan)
    fit[ok] = (xo / scale) @ beta
    yo = y[ok] - y[ok].mean()
    ss = float((yo * yo).sum())
    resid = y[ok] - fit[ok]
    resid = resid - resid.mean()
    r2 = 1.0 - float((resid * resid).sum()) / ss if ss > 0 else float("nan")
    pred = pred + np.where(np.isfinite(fit), fit, 0.0).reshape(compute.shape)
    pred[~np.isfinite(compute)] = np.nan
    return pred, r2


def slow_rank_pattern(
    window: Window,
    decomp: Decomposition,
    pred: np.ndarray | None = None,
    rel_compute: np.ndarray | None = None,
) -> SlowRankPattern:
    """Which rank is slowest each step, and whether that is a persistent offset.

    Args:
        window: the window.
        decomp: its decomposition.
        pred: `work_model` prediction (computed when None).
        rel_compute: ``relative_to_step`` of compute if already computed.

    Returns:
        The pattern (see `SlowRankPattern`).
    """
    if pred is None:
        pred, _ = work_model(window, decomp)
    compute = decomp.category("compute")
    rel = relative_to_step(compute) if rel_compute is None else rel_compute
    n_ranks, n_steps = rel.shape
    has = np.isfinite(rel).any(axis=0)
    slowest = np.where(has, np.argmax(np.where(np.isfinite(rel), rel, -np.inf), axis=0), -1)
    counts = np.bincount(slowest[slowest >= 0], minlength=n_ranks)
    valid_steps = int(has.sum())
    modal = int(np.argmax(counts)) if valid_steps else -1
    half = n_steps // 2
    if half >= 1:
        a = nanmean(rel[:, :half], axis=1)
        b = nanmean(rel[:, half:], axis=1)
        ok = np.isfinite(a) & np.isfinite(b)
        split = pearson(a[ok], b[ok]) if ok.sum() >= 3 else float("nan")
    else:
        split = float("nan")
    persistent = majority_level(rel, axis=1)
    med = nanmedian(compute, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        resid = np.where(med > 0, (compute - pred) / np.where(med > 0, med, 1.0), np.nan)
    residual = majority_level(resid, axis=1)
    return SlowRankPattern(
        slowest=slowest.astype(np.int64),
        modal_rank=modal,
        modal_share=float(counts[modal] / valid_steps) if valid_steps else float("nan"),
        distinct=int((counts > 0).sum()),
        split_half_r=split,
        persistent=persistent,
        persistent_z=robust_z(persistent),
        residual=residual,
        residual_z=robust_z(residual),
    )


def work_correlation(
    window: Window, decomp: Decomposition, pred: np.ndarray | None = None, r2: float = np.nan
) -> WorkCorrelation:
    """Compute against tokens and Σseq², within steps.

    Args:
        window: the window.
        decomp: its decomposition.
        pred: `work_model` prediction (computed when None).
        r2: its R² (when ``pred`` is given).

    Returns:
        The correlations, imbalance ratios and the work-implied excess of the slowest rank.
    """
    if pred is None:
        pred, r2 = work_model(window, decomp)
    compute = decomp.category("compute")
    tokens = np.where(window.work["tokens"] >= 0, window.work["tokens"], np.nan)
    attn = np.where(window.work["attn_cost"] >= 0, window.work["attn_cost"], np.nan)

    medians: dict[int, np.ndarray] = {}

    def med0(x: np.ndarray) -> np.ndarray:
        # Each array's per-step median is needed several times.
        if id(x) not in medians:
            medians[id(x)] = nanmedian(x, axis=0)
        return medians[id(x)]

    def centered(x: np.ndarray) -> np.ndarray:
        return x - med0(x)

    def spread(x: np.ndarray) -> np.ndarray:
        # Per step: the largest rank over the median rank.
        top = np.max(np.where(np.isfinite(x), x, -np.inf), axis=0)
        return np.where(np.isfinite(x).any(axis=0), top, np.nan) - med0(x)

    def max_ratio(x: np.ndarray) -> float:
        med = med0(x)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.where(med > 0, (spread(x) + med) / np.where(med > 0, med, 1.0), np.nan)
        return float(nanmedian(r))

    c = centered(compute).ravel()
    step = nanmedian(decomp.step_ns, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        work_excess = float(nanmedian(spread(pred) / step))
        compute_excess = float(nanmedian(spread(compute) / step))
    heavy_src = attn if np.isfinite(attn).any() else tokens
    has = np.isfinite(compute).any(axis=0) & np.isfinite(heavy_src).any(axis=0)
    if has.any():
        slow = np.argmax(np.where(np.isfinite(compute), compute, -np.inf), axis=0)
        filled = np.where(np.isfinite(heavy_src), heavy_src, -np.inf)
        top = filled.max(axis=0)
        # Ties count: tensor-parallel peers share their work exactly.
        at_top = filled[slow, np.arange(filled.shape[1])] >= top
        same = float(np.mean(at_top[has]))
    else:
        same = float("nan")
    return WorkCorrelation(
        tokens_rho=spearman(c, centered(tokens).ravel()),
        attn_rho=spearman(c, centered(attn).ravel()),
        r2=r2,
        slowest_is_heaviest=same,
        attn_max_ratio=max_ratio(attn),
        tokens_max_ratio=max_ratio(tokens),
        compute_max_ratio=max_ratio(compute),
        work_excess=work_excess,
        compute_excess=compute_excess,
    )


MIN_WORK_LEAD = 0.1
"""A rank whose work a majority of its steps exceed its peers' by this share is a heavy
rank (token counts of one batch vary by less between healthy ranks of a packed job)."""
HEAVY_STEPS = 0.8
"""Share of its steps in which a heavy rank leads the median rank's work by
`MIN_WORK_LEAD`: the same rank step after step, not a heavy batch it drew now and then."""
HEAVY_CHANCE = 0.01
"""Odds below which so many heavy steps on one rank are not a moving imbalance's chance."""


def heavy_ranks(window: Window) -> tuple[np.ndarray, np.ndarray]:
    """The ranks given more work than their peers step after step.

    Work is Σseq² where recorded, else tokens, each step's over its median rank's. A rank
    is heavy when at least `HEAVY_STEPS` of its steps lead the median rank by
    `MIN_WORK_LEAD` or more, and the level a majority of its steps reach
    (`robust.majority_level`), read against its peers' (`robust.peer_median`: with two
    ranks, the other one), leads by at least half as much as the heaviest rank's. A
    batch-to-batch imbalance that moves between ranks makes a rank heavy in some steps,
    and a long-tailed mix of documents in many, but not four in five for any one of them.
    More than a quarter of the ranks heavy is a distribution, not a place: none named.

    Returns:
        ``(ranks, ratio)``: the heavy ranks, heaviest first, and every rank's persistent
        work over its peers' (float64 (R,), NaN where unknown).
    """
    n = window.world_size
    none = np.zeros(0, dtype=np.int64)
    for name in ("attn_cost", "tokens"):
        x = window.work.get(name)
        if x is None:
            continue
        x = np.where(window.present & (x >= 0), x, np.nan)
        if np.count_nonzero(np.isfinite(x).any(axis=1)) < 2:
            continue
        rel = relative_to_step(x)
        seen = np.isfinite(rel)
        k, m = np.sum(seen & (rel >= 1.0 + MIN_WORK_LEAD), axis=1), seen.sum(axis=1)
        level = majority_level(rel, axis=1)
        peers = peer_median(level)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(peers > 0, level / peers, np.nan)
        lead = np.nan_to_num(ratio - 1.0, nan=-np.inf)
        cands = np.flatnonzero((k >= HEAVY_STEPS * np.maximum(m, 1)) & (lead >= MIN_WORK_LEAD))
        # Not by chance: with q the share of all rank-steps that lead by as much, a rank
        # heavy in k of its m steps is named only when so many would come up among n ranks
        # of a moving imbalance with odds below `HEAVY_CHANCE` (five heavy steps of five
        # at q = 0.3 among 32 ranks: 0.08, not named). One tail per distinct (k, m).
        q = float(k.sum() / max(int(m.sum()), 1))
        pairs, inv = np.unique(np.c_[k[cands], m[cands]], axis=0, return_inverse=True)
        odds = np.array([n * binomial_tail(int(a), int(b), q) for a, b in pairs])
        cands = cands[odds[inv.ravel()] < HEAVY_CHANCE] if cands.size else cands
        if cands.size == 0:
            return none, ratio
        heavy = cands[lead[cands] >= 0.5 * lead[cands].max()]
        if heavy.size > max(1, n // 4):
            return none, ratio
        return heavy[np.argsort(-lead[heavy], kind="stable")], ratio
    return none, np.full(n, np.nan)
