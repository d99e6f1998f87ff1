"""Pure renderables and the numpy view model behind the heatmap, rendered with no app."""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.diagnosis.synthetic import make_window, rank_layout
from rankscope.tui.charts import TICKS, sparkline, stacked_bar
from rankscope.tui.heatgrid import GROUP, PIN, RANK, _group_reduce, build_grid
from rankscope.tui.heatmap_render import PALETTES, HeatmapPainter, legend, palette_for
from rankscope.tui.mainmodel import _top
from rankscope.tui.metrics import (
    METRIC_SPECS,
    Dimension,
    dimension,
    filter_mask,
    finite_mean,
    finite_sum,
    metric_values,
    slowest_ranks,
)

MS = 1e6


def _window(world: int = 32, steps: int = 20, slow: dict[int, float] | None = None, **kw):
    """Steps of 100 ms (+ rank/10 µs so every rank differs), plus ``slow`` extra ms."""
    base = 100 * MS + np.arange(world)[:, None] * 1e4 + np.zeros((world, steps))
    for r, extra in (slow or {}).items():
        base[r] += extra * MS
    t_start = np.cumsum(np.full((world, steps), 200 * MS), axis=1)
    return make_window(t_start, t_start + base, **kw)


def test_metric_values_units_and_missing() -> None:
    present = np.ones((16, 5), bool)
    present[3, 2] = False
    w = _window(16, 5, slow={3: 50}, present=present)
    step = metric_values(w, "step")
    assert step[0, 0] == pytest.approx(100.0)
    assert step[3, 0] == pytest.approx(150.03)
    assert np.isnan(step[3, 2])
    assert np.isnan(metric_values(w, "input")).all()  # no input phase recorded
    with pytest.raises(KeyError, match="unknown metric 'speed'"):
        metric_values(w, "speed")


def test_compute_metric_matches_the_decomposition() -> None:
    from rankscope.diagnosis.decomposition import decompose

    world, steps = 8, 4
    phases = {
        "forward": np.full((world, steps), 40 * MS),
        "backward": np.full((world, steps), 50 * MS),
    }
    w = _window(world, steps, phase_ns=phases)
    got = metric_values(w, "compute")
    assert np.allclose(got, decompose(w).category("compute") / MS)
    assert got[0, 0] == pytest.approx(90.0)


def test_collective_metrics_stay_within_the_step() -> None:
    from rankscope.diagnosis.decomposition import decompose

    world, steps = 8, 4
    # Twenty overlapping gradient buckets a step, each waiting 30 ms: their raw sums
    # (600 ms) exceed the 100 ms step; the exposed parts the decomposition counts do not.
    n = np.full((world, steps), 20.0)
    late = np.zeros((world, steps))
    late[6] = 20 * 4 * MS  # rank 6 enters each bucket 4 ms after the first rank
    coll = {
        "n": n,
        "wait_ns": np.full((world, steps), 20 * 30 * MS),
        "exposed_wait_ns": np.full((world, steps), 30 * MS),
        "transfer_ns": np.full((world, steps), 20 * 5 * MS),
        "exposed_transfer_ns": np.full((world, steps), 5 * MS),
        "late_ns": late,
    }
    w = _window(world, steps, coll=coll)
    d = decompose(w)
    wait = metric_values(w, "wait")
    assert np.allclose(wait, d.category("arrival_wait") / MS)
    assert np.allclose(metric_values(w, "transfer"), d.category("exposed_comm") / MS)
    assert (wait <= metric_values(w, "step")).all()
    lateness = metric_values(w, "lateness")
    assert lateness[6].tolist() == [4.0] * steps and lateness[0].tolist() == [0.0] * steps
    assert METRIC_SPECS["lateness"].unit == "ms/call"
    # The rank detail gives the same collectives per call.
    from rankscope.tui.detailmodel import rank_detail

    per = {c.label: c for c in rank_detail(w, 6).collectives}
    assert per["calls"].rank == 20
    assert per["wait / call"].rank == pytest.approx(30.0)
    assert per["transfer / call"].median == pytest.approx(5.0)
    assert per["lateness / call"].rank == pytest.approx(4.0)
    assert per["lateness / call"].median == pytest.approx(0.0)
    none = _window(world, steps, coll={"n": np.zeros((world, steps))})
    assert np.isnan(metric_values(none, "lateness")).all()  # no collective, no lateness


def test_dimensions_and_filter() -> None:
    w = _window(32, 3, ranks=rank_layout(32, ranks_per_host=8, tp=2))
    host = dimension(w, "host")
    assert host.codes.tolist()[:9] == [0] * 8 + [1]
    assert host.name_of(1) == "node0001" and host.name_of(-1) == "host ?"
    assert host.reported
    assert not Dimension("ep", np.full(32, -1), ()).reported
    tp = dimension(w, "tp")
    assert tp.codes.tolist()[:4] == [0, 1, 0, 1] and tp.names == ("tp 0", "tp 1")
    assert (dimension(w, "cp").codes == 0).all()
    with pytest.raises(KeyError, match="unknown dimension"):
        dimension(w, "planet")
    assert np.flatnonzero(filter_mask(w, "r5, 9-10")).tolist() == [5, 9, 10]
    assert np.flatnonzero(filter_mask(w, "NODE0002")).tolist() == list(range(16, 24))
    assert np.flatnonzero(filter_mask(w, "rack000")).tolist() == list(range(32))
    assert filter_mask(w, " ").all()
    assert not filter_mask(w, "nothing-like-this").any()


def test_slowest_ranks() -> None:
    w = _window(16, 4, slow={7: 30, 2: 10, 11: 20})
    assert slowest_ranks(w, 3) == [7, 11, 2]
    keep = np.ones(16, bool)
    keep[7] = False
    assert slowest_ranks(w, 2, keep) == [11, 2]


def test_slowest_ranks_look_past_the_wait() -> None:
    # Synchronous steps: every rank's step is 150 ms, but all except rank 5 spent 50 ms of
    # it waiting for rank 5 in a collective.
    world, steps = 16, 4
    wait = np.full((world, steps), 50 * MS)
    wait[5] = 0.0
    coll = {"exposed_wait_ns": wait, "wait_ns": wait}
    t_start = np.zeros((world, steps))
    w = make_window(t_start, t_start + 150 * MS, coll=coll)
    assert slowest_ranks(w, 1) == [5]


def test_small_world_one_row_per_rank_pins_first() -> None:
    w = _window(16, 6, slow={9: 40})
    spec = METRIC_SPECS["step"]
    grid = build_grid(
        metric_values(w, "step"), w.steps, spec, dimension(w, "host"), pins=(9, 9, 99)
    )
    assert len(grid) == 16
    assert grid.kinds[0] == PIN and (grid.kinds[1:] == RANK).all()
    assert grid.rank.tolist() == [9, *[r for r in range(16) if r != 9]]
    assert grid.labels[0] == "● r9 node0001"
    assert grid.hi == pytest.approx(140.09) and grid.lo < 100.2
    levels = grid.levels(8)
    assert (levels[0] == 7).all() and (levels[1:] <= 1).all()


def test_large_world_groups_show_their_worst_rank() -> None:
    w = _window(128, 10, slow={21: 25, 100: 60})
    spec = METRIC_SPECS["step"]
    vals = metric_values(w, "step")
    grid = build_grid(vals, w.steps, spec, dimension(w, "host"), rank_rows_max=64)
    assert len(grid) == 16 and (grid.kinds == GROUP).all()
    assert grid.members.tolist() == [8] * 16
    assert grid.rank[2] == 21 and grid.labels[2] == "node0002 ×8 r21"
    assert np.allclose(grid.values[2], vals[16:24].max(axis=0))
    assert grid.rank[12] == 100
    # The SM clock is bad when low: a group row shows its minimum and names that rank.
    sm = np.full((128, 10), 1980.0)
    sm[45] = 1400.0
    w2 = _window(128, 10, device={"sm_clock_mhz": sm})
    g2 = build_grid(
        metric_values(w2, "sm_clock"), w2.steps, METRIC_SPECS["sm_clock"], dimension(w2, "host")
    )
    assert g2.rank[5] == 45 and np.allclose(g2.values[5], 1400.0)
    assert (g2.levels(8)[5] == 7).all() and (g2.levels(8)[0] == 0).all()


def test_zoom_and_filter() -> None:
    w = _window(128, 4)
    spec = METRIC_SPECS["step"]
    vals = metric_values(w, "step")
    dim = dimension(w, "host")
    zoomed = build_grid(vals, w.steps, spec, dim, zoom=3, pins=(0,))
    assert zoomed.rank.tolist() == [0, *range(24, 32)] and zoomed.zoom_name == "node0003"
    kept = build_grid(vals, w.steps, spec, dim, keep=filter_mask(w, "8-11"))
    assert kept.rank.tolist() == [8, 9, 10, 11] and kept.hidden == 124


def test_host_rows_roll_up_into_racks_above_the_group_budget_and_zoom_back_down() -> None:
    # 128 ranks: 16 hosts of 8, 4 racks of 4 hosts (rack_layout's defaults); rank 100 slow.
    w = _window(128, 6, slow={100: 60, 21: 25})
    spec = METRIC_SPECS["step"]
    vals = metric_values(w, "step")
    host, rack = dimension(w, "host"), dimension(w, "rack")
    kw = {"up": rack, "group_rows_max": 8, "rank_rows_max": 16, "pins": (21,)}
    top = build_grid(vals, w.steps, spec, host, **kw)
    # 16 host rows exceed the budget of 8: four rack rows, each its worst rank; the pin
    # keeps its own row, labelled by its host.
    assert top.rolled_up == "rack" and top.dimension == "host"
    assert top.labels[0].startswith("● r21 node0002")
    groups = top.kinds == GROUP
    assert groups.sum() == 4 and top.members[groups].tolist() == [31, 32, 32, 32]
    assert top.rank[groups].tolist()[3] == 100 and top.labels[4] == "rack003 ×32 r100"
    assert np.allclose(top.values[4], vals[96:128].max(axis=0))
    # Zoomed into rack 3: its four hosts as rows again, then host 12's ranks.
    rack3 = build_grid(vals, w.steps, spec, host, zoom_up=3, **kw)
    assert rack3.rolled_up == "" and rack3.zoom_up_name == "rack003"
    assert (rack3.group[rack3.kinds == GROUP]).tolist() == [12, 13, 14, 15]
    host12 = build_grid(vals, w.steps, spec, host, zoom_up=3, zoom=12, **kw)
    assert host12.rank.tolist() == [21, *range(96, 104)]
    # Within the budget, or without a level above, hosts stay rows.
    assert build_grid(vals, w.steps, spec, host, up=rack, group_rows_max=16).rolled_up == ""
    assert build_grid(vals, w.steps, spec, host, group_rows_max=8).rolled_up == ""


@pytest.mark.parametrize("seed", range(4))
def test_the_top_few_are_a_full_sort_s_first_few(seed: int) -> None:
    # Ties on the first key (times last, mostly 0) and on the second, in large worlds.
    rng = np.random.default_rng(seed)
    for n, k in ((1, 5), (7, 5), (300, 5), (5000, 3), (5000, 0)):
        first = rng.integers(0, 3, n).astype(float)
        if n > 7 and seed >= 2:
            # A large world where fewer than k ranks were ever last (the bar is the lowest).
            first = np.where(rng.random(n) < 0.0005, 1.0, 0.0)
            first[: seed - 1] = 2.0
        second = rng.integers(0, 4, n).astype(float) if seed % 2 else rng.random(n)
        want = np.lexsort((np.arange(n), -second, -first))[:k]
        assert np.array_equal(_top(first, second, k), want), (n, k)


def test_healthy_jitter_stays_cool() -> None:
    rng = np.random.default_rng(1)
    world, steps = 64, 30
    dur = 100 * MS + rng.normal(0, 0.2 * MS, (world, steps))
    t_start = np.cumsum(np.full((world, steps), 200 * MS), axis=1)
    w = make_window(t_start, t_start + dur)
    grid = build_grid(metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"))
    # 0.2 ms of noise on 100 ms is far below the 5 % minimum span of the scale.
    assert grid.levels(8).max() <= 3


def test_painter_plain_rows_and_dense_rows() -> None:
    w = _window(8, 12, slow={5: 50})
    grid = build_grid(metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"))
    plain = HeatmapPainter(grid, PALETTES["truecolor"], label_width=14, cursor=5)
    assert plain.line_count == 8
    line = plain.render_line(5, 30)
    assert line.cell_length == 30
    assert line.text.startswith("▸r5 node0000")
    hot = [s for s in line if s.text.strip() == "" and s.style and s.style.bgcolor]
    assert hot and all(s.style.bgcolor.name == PALETTES["truecolor"][7] for s in hot)
    # 12 steps in 16 cells: steps fill from the left, the rest is blank.
    assert line.text[14:26] == " " * 12 and line.text[26:] == " " * 4
    dense = HeatmapPainter(grid, PALETTES["truecolor"], dense=True, label_width=14)
    assert dense.line_count == 4
    d2 = dense.render_line(2, 30)
    assert d2.text[14:26] == "▀" * 12
    assert d2.text.startswith(" ▀r4 ▄r5")
    cell = next(s for s in list(d2)[1:] if "▀" in s.text)
    assert cell.style.color.name == PALETTES["truecolor"][0]  # rank 4 on top, healthy
    assert cell.style.bgcolor.name == PALETTES["truecolor"][7]  # rank 5 below, slow
    assert dense.render_line(99, 30).text == " " * 30


def test_dense_lines_keep_pins_whole_and_columns_stretch() -> None:
    w = _window(8, 10, slow={5: 50})
    grid = build_grid(
        metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"), pins=(5,)
    )
    p = HeatmapPainter(grid, PALETTES["truecolor"], dense=True, label_width=16, cursor=4)
    # The pin has a line of its own; the seven other ranks share four lines.
    assert p.line_count == 5
    assert p.rows_of_line(0) == (0, None) and p.rows_of_line(1) == (1, 2)
    assert p.rows_of_line(4) == (7, None)
    assert [p.line_of_row(r) for r in range(8)] == [0, 1, 1, 2, 2, 3, 3, 4]
    pin_line = p.render_line(0, 46)
    assert pin_line.text.startswith(" ● r5 node0000")
    assert pin_line.text[16:46] == " " * 30  # plain cells, not half blocks
    # Row 4 (rank 3) is the selected lower half of line 2: the label says so, and names
    # the rank drawn above it on the same line (its host is cut to make room).
    selected = p.render_line(2, 46).text
    assert selected.startswith("▸▄r3 node0") and selected[:16].endswith(" ▀r2 ")
    wider = HeatmapPainter(grid, PALETTES["truecolor"], dense=True, label_width=20, cursor=3)
    # Rank 2, the upper half of that line, selected: rank 3 is named below it.
    assert wider.render_line(2, 50).text.startswith("▸▀r2 node0000 ▄r3 ")
    assert wider.render_line(2, 50).text[20:] == "▀" * 30
    # 10 steps in 30 cells: each step three cells wide.
    assert p.cell_width(46) == 3 and p.cell_width(26) == 1
    assert p.render_line(1, 46).text[16:46] == "▀" * 30


def test_a_dense_line_across_two_hosts_names_both() -> None:
    w = _window(16, 4)
    grid = build_grid(
        metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"), pins=(0,)
    )
    p = HeatmapPainter(grid, PALETTES["truecolor"], dense=True, label_width=20)
    # With rank 0 pinned, ranks 7 (node0000) and 8 (node0001) share a line.
    assert p.rows_of_line(4) == (7, 8)
    assert p.render_line(4, 40).text.startswith(" ▀r7 ▄r8 node0000/1")
    assert p.render_line(3, 40).text.startswith(" ▀r5 ▄r6 node0000 ")


def test_painter_shows_newest_steps_when_narrow_and_marks_missing() -> None:
    present = np.ones((2, 40), bool)
    present[0, 39] = False
    w = _window(2, 40, present=present, ranks=rank_layout(2))
    grid = build_grid(metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"))
    p = HeatmapPainter(grid, PALETTES["16"], missing="white", label_width=10)
    line = p.render_line(0, 20)
    assert line.cell_length == 20
    last = list(line)[-1]
    assert last.style.bgcolor.name == "white"  # step 39 is the last column


def test_legend_names_metric_unit_and_ends() -> None:
    w = _window(128, 4, slow={3: 20})
    grid = build_grid(metric_values(w, "step"), w.steps, METRIC_SPECS["step"], dimension(w, "host"))
    text = legend(grid, PALETTES["truecolor"], width=200).plain
    assert text.startswith("step time (ms) ")
    assert "120" in text and "none" in text and "worst rank of each host" in text
    assert palette_for("standard")[0] == PALETTES["16"]
    assert palette_for("truecolor")[0] == PALETTES["truecolor"]


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == TICKS
    assert sparkline([1, float("nan"), 3], 5) == "  ▁ █"
    assert sparkline([5, 5, 5], 3) == "▁▁▁"
    assert sparkline([], 4) == "    "
    assert sparkline(list(range(100)), 3) == "▁▅█"
    assert sparkline([1, 2], 2, lo=0, hi=4) == "▃▅"


def test_stacked_bar_sums_and_scales() -> None:
    colours = {"a": "red", "b": "blue"}
    bar = stacked_bar([("a", 30), ("b", 10)], colours, 20, 40)
    assert bar.plain == "█" * 20
    spans = [(s.end - s.start, str(s.style.color.name)) for s in bar.spans]
    assert spans == [(15, "red"), (5, "blue")]
    half = stacked_bar([("a", 10), ("b", 10)], colours, 20, 40)
    assert half.plain == "█" * 10 + " " * 10
    tiny = stacked_bar([("a", 39.5), ("b", 0.5)], colours, 40, 40)
    assert [(s.end - s.start) for s in tiny.spans] == [39, 1]
    assert stacked_bar([("a", float("nan"))], colours, 5, 0).plain == " " * 5


def test_hub_health_words() -> None:
    from rankscope.tui.panels import fmt_ms, fmt_rate, hub_health

    words = hub_health(
        {"events_per_s": 1.25e6, "drops": {"batches": 2, "events": 300}, "rejects": {"bad": 4}}
    )
    assert words == ["1.2M ev/s", "drops 300", "rejects 4"]
    assert hub_health({"rejects": {}}) == []
    assert fmt_ms(1234.5) == "1,234" and fmt_ms(12.345) == "12.3" and fmt_ms(None) == "–"
    assert fmt_rate(950) == "950" and fmt_rate(float("nan")) == "–"


def test_finite_sums_and_means_skip_exactly_the_unknown_values() -> None:
    rng = np.random.default_rng(3)
    x = rng.random((500, 16)) * 1e6
    x[rng.random(x.shape) < 0.01] = np.nan
    x[3, 4], x[9, 0], x[9, 1], x[11] = np.inf, np.inf, -np.inf, np.nan
    finite = np.isfinite(x)
    for axis in (0, 1):
        want = np.sum(x, axis=axis, where=finite)
        assert np.allclose(finite_sum(x, axis), want, rtol=1e-12, atol=0)
    counts = finite.sum(axis=1)
    with np.errstate(all="ignore"):
        want_mean = np.where(counts > 0, np.sum(x, axis=1, where=finite) / counts, np.nan)
    got = finite_mean(x)
    assert np.isnan(got[11]) and np.allclose(got, want_mean, rtol=1e-12, equal_nan=True)
    # Every value finite: the plain row sums.
    y = rng.random((64, 7))
    assert np.allclose(finite_sum(y, 1), y.sum(axis=1)) and np.allclose(finite_mean(y), y.mean(1))


@pytest.mark.parametrize("sizes", [(8, 8, 8), (3, 5, 1, 7), (256, 256), (1,)])
def test_group_rows_reduce_as_one_reduction_over_their_members(sizes) -> None:
    rng = np.random.default_rng(len(sizes))
    n = sum(sizes)
    values = rng.random((n, 5))
    values[rng.random(values.shape) < 0.2] = np.nan
    starts = np.cumsum([0, *sizes[:-1]])
    for ufunc in (np.fmax, np.fmin):
        got = _group_reduce(values, starts, ufunc)
        for g, (a, k) in enumerate(zip(starts.tolist(), sizes, strict=True)):
            with np.errstate(invalid="ignore"):
                want = ufunc.reduce(values[a : a + k], axis=0)
            assert np.array_equal(got[g], want, equal_nan=True), (ufunc, g)
