"""TUI benchmark: main-screen frame time by world size up to 65,536 ranks, and memory.

Frame time (target ≤ 50 ms at 16,384 and at 65,536 ranks). A frame is what the view does
for one new window, in two parts measured separately:

- *model*: on the sampling thread, ``build_main_model`` (heatmap metric, grouping into
  host rows that show their worst rank, colour scale, header statistics, the latest
  arrivals per process group and the ranking of last arrivers);
- *draw*: on the UI thread, the main screen's widgets take the model and Textual's
  compositor renders the whole 200 × 60 screen (``render_update(full=True)``, what a
  screenshot renders), with the app running headless.

Windows are synthetic, built directly as the arrays a `Window` holds, of as many steps
as the view asks the store for (``view.window_steps``, 120, within ``view.max_cells``:
64 steps at 16,384 ranks, 16 at 65,536): 8 ranks a host, 32 hosts a rack (so above
``view.group_rows_max`` hosts the rows are racks), one straggler, an all-reduce over
every rank and one collective per host each step (the instance table the arrivals panel
reads). The diagnosis runs on its own slower clock and is benchmarked in the diagnosis
section.

Memory (target ≤ 1 GiB for 16,384 and for 65,536 ranks × 1,000 steps; measured at
16,384: the store's rings share one cell budget, so a larger world keeps fewer steps in
the same cells). A hub store (the one ``watch`` runs, default budget) takes 1,000 steps
from 16,384 ranks of a baseline run as real wire messages through its intake, then, an
hour later on the steps' clock, 1,000 steps of the run under investigation, settling
between chunks as the hub does on its timer; its rings share the store's one cell
budget, so the finished baseline gives up its ring down to the floor when the new run
arrives. The view asks the store for the run's window, builds its model, and reads the
baseline's window as the app does once a baseline is chosen
(``sources.baseline_window``, bounded by ``view.baseline_max_cells``). Reported: the
store's rings (exact bytes), the store's memory (resident growth, and what it still
holds once the C heap returns the memory freed by ingest, ``malloc_trim``), and what the
view holds on top (window + model, baseline window), from tracemalloc. Absolute times
depend on this machine; compare ratios across sizes.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import statistics
import time
import tracemalloc

import numpy as np

SIZES = (512, 4096, 16384, 65536)
STEPS = 120
"""``view.window_steps``: the most steps the view asks for (`view_steps`)."""
SCREEN = (200, 60)


def synthetic_window(n_ranks: int, n_steps: int, seed: int = 0):
    """A window of ``n_ranks`` × ``n_steps`` with one slow rank (see module docstring)."""
    from rankscope.collector.schema import OP_INDEX
    from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout

    rng = np.random.default_rng(seed)
    ranks = rank_layout(n_ranks, ranks_per_host=8, hosts_per_rack=32)
    compute = 0.7e9 * (1 + 0.003 * rng.standard_normal((n_ranks, n_steps)))
    slow = n_ranks // 3
    compute[slow] *= 1.2
    top = compute.max(axis=0)
    wait = top - compute
    t_start = np.cumsum(np.full((n_ranks, n_steps), 1.3e9), axis=1)
    t_end = t_start + top + 0.05e9
    n_hosts = n_ranks // 8
    members = [list(range(n_ranks))] + [list(range(8 * h, 8 * h + 8)) for h in range(n_hosts)]
    groups = make_groups(ranks, members, ["dp"] + [f"tp{h}" for h in range(n_hosts)])
    g = np.tile(np.arange(n_hosts + 1), n_steps)
    step = np.repeat(np.arange(n_steps), n_hosts + 1)
    first = t_start[0][step] + 0.6e9
    late = np.where(g == 0, wait.max(axis=0)[step], 1e5)
    inst = instance_table(
        group=g,
        seq=step,
        step=step,
        op=np.where(g == 0, OP_INDEX["all_reduce"], OP_INDEX["all_gather"]),
        nbytes=np.full(g.size, 1 << 26),
        n_members=np.where(g == 0, n_ranks, 8),
        first=first,
        last=first + late,
        last_rank=np.where(g == 0, slow, 8 * np.maximum(g - 1, 0)),
        margin=late * 0.9,
        transfer=np.full(g.size, 5e6),
    )
    coll = {
        "n": np.full((n_ranks, n_steps), 2.0),
        "wait_ns": wait,
        "exposed_wait_ns": wait,
        "late_ns": top - wait - compute.min(axis=0),
        "transfer_ns": np.full((n_ranks, n_steps), 5e6),
        "exposed_transfer_ns": np.full((n_ranks, n_steps), 5e6),
        "times_last": np.where(np.arange(n_ranks)[:, None] == slow, 1.0, 0.0) * np.ones(n_steps),
    }
    return make_window(
        t_start,
        t_end,
        ranks=ranks,
        groups=groups,
        phase_ns={"forward": 0.4 * compute + wait, "backward": 0.6 * compute},
        coll=coll,
        instances=inst,
        device={"sm_clock_mhz": np.full((n_ranks, n_steps), 1980.0)},
        work={"valid_tokens": np.full((n_ranks, n_steps), 8192.0)},
    )


def view_steps(n_ranks: int) -> int:
    """Steps of the window the view asks for at ``n_ranks`` (``sources.steps_within``)."""
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import steps_within

    v = deterministic_settings().view
    return steps_within(v.window_steps, n_ranks, v.max_cells)


def _median_ms(fn, repeat: int) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(repeat):
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    return statistics.median(cpu), statistics.median(wall)


def frame_times(n_ranks: int, repeat: int) -> tuple[tuple[float, float], tuple[float, float], str]:
    """Median (CPU, wall) ms of the model build and of the draw for one window size, and
    what the heatmap's rows are ("64 hosts", "64 racks")."""
    from rankscope.tui.app import make_app
    from rankscope.tui.main_screen import MainScreen
    from rankscope.tui.mainmodel import ViewState, build_main_model
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import StaticSource, sample

    window = synthetic_window(n_ranks, view_steps(n_ranks))
    source = StaticSource([window], {"events_per_s": 0.0})
    smp = sample(source, None, STEPS)
    view = ViewState()
    model_ms = _median_ms(lambda: build_main_model(smp, view), repeat)
    model = build_main_model(smp, view)

    draw_cpu: list[float] = []
    draw_wall: list[float] = []

    async def session() -> None:
        app = make_app(deterministic_settings(), source)
        async with app.run_test(size=SCREEN) as pilot:
            for _ in range(600):
                await pilot.pause(0.05)
                if app.model is not None and app.analysis is not None and not app.diagnosing:
                    break
            app.paused = True  # only the frames timed here
            await pilot.pause(0.1)
            screen = app.screen
            assert isinstance(screen, MainScreen)
            for _ in range(repeat):
                c0, w0 = time.process_time(), time.perf_counter()
                screen.show_model(model)
                screen._compositor.render_update(full=True)
                draw_cpu.append((time.process_time() - c0) * 1e3)
                draw_wall.append((time.perf_counter() - w0) * 1e3)
                await pilot.pause(0.01)

    asyncio.run(session())
    grid = model.grid
    assert grid is not None
    rows = f"{len(grid):,} {grid.rolled_up or grid.dimension}s"
    return model_ms, (statistics.median(draw_cpu), statistics.median(draw_wall)), rows


def metric_models(n_ranks: int, repeat: int) -> dict[str, float]:
    """Median CPU ms of the model build for each heatmap metric (the frame above times
    the default one; the step time and the decomposition's metrics split every
    rank-step first)."""
    import dataclasses

    from rankscope.tui.mainmodel import ViewState, build_main_model
    from rankscope.tui.metrics import METRIC_SPECS
    from rankscope.tui.sources import StaticSource, sample

    window = synthetic_window(n_ranks, view_steps(n_ranks))
    smp = sample(StaticSource([window], {"events_per_s": 0.0}), None, STEPS)
    out = {}
    for name in METRIC_SPECS:
        view = dataclasses.replace(ViewState(), metric=name)
        out[name] = _median_ms(lambda v=view: build_main_model(smp, v), repeat)[0]
    return out


def key_latency(n_ranks: int, presses: int) -> tuple[float, float]:
    """Median wall ms, with the sampling clock running, from a key's action to: the cursor
    moved and the screen rendered (``down``, all on the UI thread), and the heatmap holding
    the next metric (``m``: the model is rebuilt on a worker thread and posted back)."""
    from rankscope.tui.app import make_app
    from rankscope.tui.heatmap import Heatmap
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import StaticSource

    window = synthetic_window(n_ranks, view_steps(n_ranks))
    source = StaticSource([window], {"events_per_s": 0.0})
    cursor_ms: list[float] = []
    metric_ms: list[float] = []

    async def session() -> None:
        app = make_app(deterministic_settings(), source)
        async with app.run_test(size=SCREEN) as pilot:
            for _ in range(600):
                await pilot.pause(0.05)
                if app.model is not None and app.analysis is not None and not app.diagnosing:
                    break
            heatmap = app.screen.query_one(Heatmap)
            for _ in range(presses):
                t0 = time.perf_counter()
                heatmap.action_cursor(1)
                app.screen._compositor.render_update(full=True)
                cursor_ms.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                app.cycle_metric()
                want = app.metric
                while heatmap.grid is None or heatmap.grid.spec.name != want:
                    await asyncio.sleep(0.001)
                metric_ms.append((time.perf_counter() - t0) * 1e3)
                await pilot.pause(0.05)

    asyncio.run(session())
    return statistics.median(cursor_ms), statistics.median(metric_ms)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _held_bytes() -> int:
    """Resident memory once the C heap has returned what was freed (glibc's
    ``malloc_trim``; elsewhere the plain resident size)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return _rss_bytes()


NODE_RANKS = 256
"""Ranks a node message carries when the memory run is fed through relays (a rack's)."""
TP_INSTANCES = 190
"""Tensor-parallel instances a host's group closes a step in the node-message feed (the
simulator's tp=8 job with 200 collectives a rank-step)."""


def _node_sums(ranks: np.ndarray, steps: np.ndarray, t0: int) -> dict[str, dict]:
    """The ``cells`` and ``instances`` a rack relay sends for its hosts' tensor-parallel
    groups (one group per host of 8, `TP_INSTANCES` a step, matched on the node)."""
    from rankscope.collector import schema

    k = TP_INSTANCES
    cells = {
        "rank": np.repeat(ranks, steps.size).astype(np.int32),
        "inc": np.zeros(ranks.size * steps.size, np.int32),
        "step": np.tile(steps, ranks.size),
        "n": np.full(ranks.size * steps.size, k, np.int32),
        "times_last": np.zeros(ranks.size * steps.size, np.int32),
    }
    cells["times_last"][(cells["rank"] % 8) == 0] = k  # each host's first rank, always
    for name in schema.CELL_SUMS:
        cells[name] = np.full(ranks.size * steps.size, 1e5 * k)
    hosts = np.unique(ranks // 8)
    h = np.repeat(hosts, steps.size * k)
    st = np.tile(np.repeat(steps, k), hosts.size)
    j = np.tile(np.arange(k), hosts.size * steps.size)
    first = t0 + st * 1_300_000_000 + j * 4_000_000
    inst = {
        "group": h.astype(np.int32),
        "seq": st * k + j,
        "step": st,
        "inc": np.zeros(h.size, np.int32),
        "op": np.full(h.size, schema.OP_INDEX["all_reduce"], np.int8),
        "nbytes": np.full(h.size, 1 << 20),
        "n_members": np.full(h.size, 8, np.int32),
        "first": first,
        "last": first + 20_000,
        "last_rank": (8 * h).astype(np.int32),
        "margin": np.full(h.size, 10_000.0),
        "transfer": np.full(h.size, 1e6),
        "device_transfer": np.full(h.size, np.nan),
        "first_exit": first + 1_020_000,
        "last_exit": first + 1_030_000,
    }
    return {"cells": cells, "instances": inst}


def _feed(
    intake, run: str, n_ranks: int, n_steps: int, chunk: int, t0: int, nodes: bool = False
) -> None:
    """Every rank's hello, then ``n_steps`` steps ``chunk`` at a time: one steps message
    per rank, or with ``nodes`` one node message per `NODE_RANKS` ranks (what a rack's
    reducing relay sends, `hub.reduce`); the node messages of the last chunk also carry
    their hosts' tensor-parallel instances and sums (`_node_sums`): the store keeps the
    newest instances up to its bound, so earlier ones would be dropped by the end."""
    from rankscope.collector import schema

    for r in range(n_ranks):
        header = {"job": "bench", "run": run, "rank": r, "inc": 0, "batch": 0}
        ident = {
            "rank": r,
            "world_size": n_ranks,
            "local_rank": r % 8,
            "host": f"node{r // 8:05d}",
            "node_rank": r // 8,
            "pid": 1000 + r,
        }
        intake.feed(schema.hello_message(header, ident, t_start_ns=t0), 0)
    if nodes:
        groups = [
            {"id": h, "name": f"tp{h}", "ranks": list(range(8 * h, 8 * h + 8)), "backend": "nccl"}
            for h in range(n_ranks // 8)
        ]
        header = {"job": "bench", "run": run, "rank": 0, "inc": 0, "batch": 0}
        intake.feed(schema.groups_message(header, groups), 0)
    for s0 in range(0, n_steps, chunk):
        steps = np.arange(s0, min(s0 + chunk, n_steps))
        if nodes:
            for r0 in range(0, n_ranks, NODE_RANKS):
                ranks = np.arange(r0, min(r0 + NODE_RANKS, n_ranks))
                cols = schema.empty_table("steps", steps.size * ranks.size)
                cols["step"] = np.tile(steps, ranks.size)
                rank = np.repeat(ranks, steps.size)
                cols["t_start"] = t0 + cols["step"] * 1_300_000_000 + rank
                cols["t_end"] = cols["t_start"] + 1_000_000_000
                table = {
                    **cols,
                    "rank": rank.astype(np.int32),
                    "inc": np.zeros(rank.size, np.int32),
                }
                header = {"job": "bench", "run": run, "rank": int(r0), "inc": 0, "batch": 1 + s0}
                tables = {"steps": table}
                if s0 + chunk >= n_steps:
                    tables.update(_node_sums(ranks, steps, t0))
                assert intake.feed(schema.reduced_message(header, tables), 0)
            intake.store.settle()
            continue
        for r in range(n_ranks):
            cols = schema.empty_table("steps", steps.size)
            cols["step"] = steps
            cols["t_start"] = t0 + steps * 1_300_000_000 + r
            cols["t_end"] = cols["t_start"] + 1_000_000_000
            header = {"job": "bench", "run": run, "rank": r, "inc": 0, "batch": 1 + s0}
            intake.feed(schema.steps_message(header, cols), 0)
        intake.store.settle()  # the hub settles on a timer


def _traced(fn):
    """``(result, MiB that fn's result holds)`` by tracemalloc."""
    gc.collect()
    tracemalloc.start()
    out = fn()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, current / 2**20


def feed_chunk(n_ranks: int, most: int) -> int:
    """Steps per message when feeding ``n_ranks``: at most ``most``, and at most half the
    ring the store keeps per rank at that world size. Collectors send a step or a few at a
    time, so every rank's step arrives while the ring still holds it; a message of more
    steps than the ring holds would have each rank evict the steps the next one is about
    to send (65,536 ranks keep 61 steps in the default budget)."""
    from rankscope.hub.store import Store

    ring = Store().max_cells // n_ranks
    return max(1, min(most, ring // 2))


def store_and_view_memory(
    n_ranks: int, n_steps: int, chunk: int, nodes: bool = False, max_instances: int | None = None
) -> dict[str, float]:
    """Feed ``n_steps`` steps of ``n_ranks`` ranks of a baseline run, then of the run under
    investigation an hour later, into a hub store (with ``nodes``, as rack relays' node
    messages; ``max_instances``: the store's bound on closed instances, default its own);
    build the view with the baseline chosen.

    Returns:
        ``store_mib`` (what the store holds for the run alone), ``stores_mib`` (for both
        runs), ``ring_mib`` / ``baseline_ring_mib`` (each run's ring grids, exact),
        ``store_rss_mib`` (resident growth while ingesting the run alone), ``view_mib``
        (window + model), ``baseline_mib`` (the baseline window as the app reads it),
        ``uncapped_baseline_mib`` (the same within ``view.max_cells``), ``kept_steps`` /
        ``baseline_kept_steps`` (ring steps per rank), ``view_steps``, ``baseline_steps``,
        ``ingest_s``; ``process_rss_mib`` / ``process_held_mib``: the process's resident
        growth with all of it alive (both runs in the store, the view, the baseline
        window), as is and once freed heap is returned.
    """
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store
    from rankscope.tui.mainmodel import ViewState, build_main_model
    from rankscope.tui.settings import Settings
    from rankscope.tui.sources import StoreSource, baseline_window, sample

    bound = {} if max_instances is None else {"max_instance_rows": max_instances}
    t_base = 10**18
    t_run = t_base + n_steps * 1_300_000_000 + 3_600 * 10**9
    held0 = _held_bytes()
    rss0 = _rss_bytes()
    store = Store(history_steps=n_steps, **bound)
    intake = Intake(store)
    t0 = time.perf_counter()
    _feed(intake, "mem", n_ranks, n_steps, chunk, t_run, nodes)
    ingest_s = time.perf_counter() - t0
    gc.collect()
    store_rss = _rss_bytes() - rss0
    store_held = _held_bytes() - held0
    # The baseline ran before; a fresh store takes it first, as a hub that saw it live did.
    del intake, store
    held0 = _held_bytes()
    rss0 = _rss_bytes()
    store = Store(history_steps=n_steps, **bound)
    intake = Intake(store)
    _feed(intake, "base", n_ranks, n_steps, chunk, t_base, nodes)
    _feed(intake, "mem", n_ranks, n_steps, chunk, t_run, nodes)
    held2 = _held_bytes()
    rings = store.ring_nbytes()

    v = Settings().view
    source = StoreSource(store, "bench")

    def build_view():
        smp = sample(source, "mem", v.window_steps, v.max_cells)
        return smp, build_main_model(smp, ViewState())

    (smp, model), view_mib = _traced(build_view)
    assert model.grid is not None and smp.window is not None

    def read_baseline(max_cells: int):
        return baseline_window(source, "base", smp.runs, v.window_steps, max_cells)

    uncapped, uncapped_mib = _traced(lambda: read_baseline(v.max_cells))
    del uncapped
    baseline, baseline_mib = _traced(lambda: read_baseline(v.baseline_max_cells))
    assert baseline is not None
    with_baseline = build_main_model(smp, ViewState(), baseline)
    assert with_baseline.header is not None and with_baseline.header.baseline is not None
    gc.collect()
    process_rss = _rss_bytes() - rss0
    process_held = _held_bytes() - held0
    return {
        "process_rss_mib": process_rss / 2**20,
        "process_held_mib": process_held / 2**20,
        "store_rss_mib": store_rss / 2**20,
        "store_mib": store_held / 2**20,
        "stores_mib": (held2 - held0) / 2**20,
        "ring_mib": rings["mem"] / 2**20,
        "baseline_ring_mib": rings["base"] / 2**20,
        "budget_cells": float(store.max_cells),
        "view_mib": view_mib,
        "baseline_mib": baseline_mib,
        "uncapped_baseline_mib": uncapped_mib,
        "kept_steps": float(store.run_state("mem").H),
        "baseline_kept_steps": float(store.run_state("base").H),
        "view_steps": float(smp.window.steps.size),
        "baseline_steps": float(baseline.steps.size),
        "ingest_s": ingest_s,
    }


def run(quick: bool) -> str:
    """Measure and return the Markdown section."""
    from rankscope.tui.mainmodel import ViewState

    sizes = SIZES[:2] if quick else SIZES
    repeat = 3 if quick else 7
    lines = [
        "### TUI",
        "",
        "Main-screen frame for one new window of N ranks (as many steps as the view asks "
        f"for: {STEPS} within `view.max_cells`) on a {SCREEN[0]}×{SCREEN[1]} terminal "
        f"(median of {repeat}); target ≤ 50 ms at 16,384 and 65,536. Rows: hosts, racks of "
        "32 hosts above `view.group_rows_max` (256) hosts. CPU time of the process, then "
        "wall time in parentheses: the machine is shared, so wall time includes waiting "
        "for a core.",
        "",
        "| ranks | steps | rows | model (sampling thread) ms | draw (UI thread) ms "
        "| frame ms | frame vs 512 |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    first = None
    for n in sizes:
        (m_cpu, m_wall), (d_cpu, d_wall), rows = frame_times(n, repeat)
        total = m_cpu + d_cpu
        first = first or total
        lines.append(
            f"| {n:,} | {view_steps(n)} | {rows} | {m_cpu:.1f} ({m_wall:.0f}) "
            f"| {d_cpu:.1f} ({d_wall:.0f}) | {total:.1f} ({m_wall + d_wall:.0f}) "
            f"| ×{total / first:.1f} |"
        )
    big = sizes[-1]
    models = metric_models(big, repeat)
    default = ViewState().metric
    lines += [
        "",
        f"The frame above shows the default metric ({default}). The model for each metric "
        f"at {big:,} ranks (CPU ms, median of {repeat}): "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in models.items())
        + ".",
    ]
    cursor_ms, metric_ms = key_latency(big, 5 if quick else 9)
    lines += [
        "",
        f"Keys at {big:,} ranks while the sampling clock keeps rebuilding the model (wall ms, "
        f"median): cursor move {cursor_ms:.0f}, next metric on screen {metric_ms:.0f}.",
    ]
    # Memory at 16,384 ranks fed a message per rank, and at 65,536 fed through rack relays'
    # node messages (a message per rank takes ~10 min a run here at 65,536).
    # The last: the same with a lower bound on closed instances (`--max-instances`).
    cases = (
        [(4096, 200, False, None)]
        if quick
        else [(16384, 1000, False, None), (65536, 1000, True, None), (65536, 1000, True, 250_000)]
    )
    mems = [
        store_and_view_memory(n, steps, feed_chunk(n, 50 if quick else 100), nodes, bound)
        for n, steps, nodes, bound in cases
    ]
    heads = [
        f"{n:,} × {steps:,}, {'node messages' if nodes else 'a message per rank'}"
        + (f", `--max-instances {bound:,}`" if bound else "")
        for n, steps, nodes, bound in cases
    ]

    def row(label: str, fmt) -> str:  # type: ignore[no-untyped-def]
        return f"| {label} | " + " | ".join(fmt(m) for m in mems) + " |"

    first = mems[0]
    lines += [
        "",
        "Memory with N ranks × 1,000 steps of a baseline run fed to a hub store through its "
        "intake, then, an hour later on the steps' clock, the same of the run under "
        "investigation: one steps message per rank and chunk of steps (step rows only), or "
        f"one node message per {NODE_RANKS} ranks, what a rack's reducing relay sends, whose "
        "last chunk also carries its hosts' tensor-parallel instances and their sums "
        f"({TP_INSTANCES} a host a step, 1.6 M a step at 65,536 ranks; the store keeps the "
        "newest `max_instance_rows`, 1 M over all runs, shared as the rings' cells are, so earlier ones would be gone by the end). The "
        "rings of all runs "
        f"share the store's budget of {first['budget_cells'] / 1e6:.0f} M rank × step "
        "cells, so a larger world keeps fewer steps per rank; the finished baseline gives "
        "up its ring down to its floor. *store* counts what the store holds once the C "
        "heap returns what ingest freed (the view's windows reuse that heap); the view's "
        "parts are from tracemalloc. Target ≤ 1 GiB.",
        "",
        "| part | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(mems),
        row("ingest of one run, s", lambda m: f"{m['ingest_s']:.0f}"),
        row(
            "steps per rank kept: run, baseline",
            lambda m: f"{m['kept_steps']:.0f}, {m['baseline_kept_steps']:.0f}",
        ),
        row(
            "store: resident growth while ingesting the run alone",
            lambda m: f"{m['store_rss_mib']:.0f}",
        ),
        row("store: the run alone in a hub", lambda m: f"{m['store_mib']:.0f}"),
        row(
            "store: the baseline run, then the run (rings: baseline + run)",
            lambda m: f"{m['stores_mib']:.0f} ({m['baseline_ring_mib']:.0f} + {m['ring_mib']:.0f})",
        ),
        row(
            "view: window (`view.max_cells`) + main model",
            lambda m: f"{m['view_mib']:.0f} ({m['view_steps']:.0f} steps)",
        ),
        row(
            "view: baseline window (`view.baseline_max_cells`)",
            lambda m: f"{m['baseline_mib']:.0f} ({m['baseline_steps']:.0f} steps)",
        ),
        row(
            "**total, baseline chosen**",
            lambda m: f"**{m['stores_mib'] + m['view_mib'] + m['baseline_mib']:.0f}**",
        ),
        row(
            "whole process, all of it alive: resident growth (once freed heap is returned)",
            lambda m: f"{m['process_rss_mib']:.0f} ({m['process_held_mib']:.0f})",
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
