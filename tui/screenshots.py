"""Regenerate the PNG/SVG pictures of every TUI screen from seeded simulated runs.

    python -m rankscope.tui.screenshots            # all pictures into ./screenshots
    python -m rankscope.tui.screenshots --out DIR --only main detail
    python -m rankscope.tui.screenshots --record DIR --run RUN --baseline RUN --name NAME

The runs come from the simulator's shipped scenarios (fixed seeds), fed through the hub's
own intake into a store, so the pictures show exactly what ``rankscope demo`` shows; the
stall view uses a synthetic hung run (``tui.scenes``), as the simulator models slow ranks,
not hung ones. Each
picture is an SVG from Textual's ``export_screenshot`` and a PNG from ``rsvg-convert``
(``apt-get install librsvg2-bin``); the settings hide the clock and the machine name.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rankscope.tui.settings import DisplaySettings, Settings, deterministic_settings

T0_NS = 1_700_000_000 * 1_000_000_000
"""Hub-clock origin of the simulated runs (fixed, so pictures do not change)."""


def simulated_store(runs: Sequence[tuple[str, str, int, int]], seed: int | None = None) -> Any:
    """A hub store holding seeded simulated runs.

    Args:
        runs: ``(scenario, run_id, ranks, steps)``, oldest first.
        seed: scenario seed override (default: each scenario's own).

    Returns:
        A settled ``rankscope.hub.store.Store``.
    """
    from rankscope.hub.intake import Intake
    from rankscope.hub.store import Store
    from rankscope.sim import iter_messages, load_scenario

    store = Store()
    intake = Intake(store)
    for i, (name, run_id, ranks, steps) in enumerate(runs):
        scenario = load_scenario(name, ranks=ranks, seed=seed)
        t0 = T0_NS + i * 10**12
        for msg in iter_messages(scenario, steps, run_id=run_id, t0_ns=t0):
            intake.feed(msg, t0)
    store.settle()
    return store


LADDER_PARENT = "seed-example-s7-full-3f9a2c"
"""The ladder picture's full run, named as ``rankscope demo`` names runs; its reruns add
the scope, as the rerun menu names them."""


def ladder_source() -> Any:
    """A full run of the seeded example and its one-rank, one-node and two-node reruns.

    Returns:
        A ``StaticSource`` holding the four runs (reruns carry ``parent_run``).
    """
    from rankscope.tui.sources import StaticSource

    rungs = [("full", 64), ("one-rank", 1), ("one-node", 8), ("two-node", 16)]
    names = [LADDER_PARENT if s == "full" else f"{LADDER_PARENT}-{s}" for s, _ in rungs]
    store = simulated_store([("seed-example", n, ranks, 40) for n, (_, ranks) in zip(names, rungs)])
    windows = []
    for name, (scope, _) in zip(names, rungs):
        w = store.window(name, 120)
        parent = None if scope == "full" else LADDER_PARENT
        windows.append(replace(w, scope=scope, parent_run=parent))
    health = {"events_per_s": 0.0, "drops": {"batches": 0, "events": 0}, "rejects": {}}
    return StaticSource(windows, health, label="simulated")


async def wait_ready(pilot: Any, timeout: float = 120.0) -> None:
    """Let the app run until its model and diagnosis are drawn and no worker is busy.

    Args:
        pilot: the Textual pilot.
        timeout: seconds before giving up.

    Raises:
        TimeoutError: the app did not settle.
    """
    app = pilot.app
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        await pilot.pause(0.05)
        busy = any(w.is_running for w in app.workers) or app._sampling or app.diagnosing
        ready = app.model is not None and app.analysis is not None and not busy
        # The analysis may still belong to the baseline chosen before.
        if ready and app.analysis.baseline_run == app.baseline_run:
            await pilot.pause(0.2)
            return
    raise TimeoutError("the app did not settle")


@dataclass(frozen=True)
class Shot:
    """One picture: which data, which terminal, which keys."""

    name: str
    store: str
    """Key into the stores built by `main`."""
    size: tuple[int, int]
    keys: tuple[str, ...] = ()
    baseline: str | None = None
    color: str = "truecolor"
    before: Callable[[Any], Awaitable[None]] | None = None
    """Extra steps after the keys (e.g. select the straggler)."""
    run: str | None = None
    """The run to show (default: the newest full run)."""


async def select_top_rank(pilot: Any) -> None:
    """Move the heatmap cursor to the first rank the verdict names."""
    from rankscope.tui.heatmap import Heatmap

    app = pilot.app
    ranks = [r for h in app.analysis.hypotheses[:1] for r in h.ranks]
    rank = ranks[0] if ranks else (app.model.ranking[0].rank if app.model.ranking else 0)
    heatmap = app.screen.query_one(Heatmap)
    for i in range(len(heatmap.grid)):
        if heatmap.grid.rank[i] == rank:
            heatmap.cursor = i
            break
    await pilot.pause(0.1)


async def stall_for_a_minute(pilot: Any) -> None:
    """Open the stall view as if no step had ended for the last minute."""
    from rankscope.tui.report_screens import StallScreen

    app = pilot.app
    app._last_progress = app.clock() - 60.0
    app.push_screen(StallScreen())
    await pilot.pause(0.1)
    app.diagnosis_tick(force=True)
    await wait_ready(pilot)


SHOTS = (
    Shot("main", "example", (160, 46), baseline="run-0412"),
    Shot("main-80x24", "example", (80, 24), baseline="run-0412"),
    Shot("main-16-colour", "example", (100, 30), baseline="run-0412", color="16"),
    Shot("main-512-ranks", "large", (140, 44), keys=("P",), baseline="run-0412"),
    Shot("zoom", "large", (140, 44), keys=("enter",), baseline="run-0412"),
    Shot("detail", "example", (140, 46), baseline="run-0412", before=select_top_rank, keys=()),
    Shot("structure", "example", (120, 36), keys=("s",)),
    Shot("curves", "example", (120, 36), keys=("c",), baseline="run-0412"),
    Shot("manifest", "example", (120, 30), keys=("d",), baseline="run-0412"),
    Shot("baseline-picker", "example", (120, 30), keys=("b",)),
    Shot("help", "example", (120, 46), keys=("question_mark",)),
    Shot("help-80x24", "example", (80, 24), keys=("question_mark", "end")),
    Shot("ladder", "ladder", (80, 40), keys=("L",)),
    Shot("stall", "hang", (120, 30), before=stall_for_a_minute),
)


async def take(shot: Shot, store: Any, settings: Settings, out: Path) -> Path:
    """Run the app on ``store`` and save one SVG.

    Args:
        shot: what to capture.
        store: the data.
        settings: base settings (the shot's palette is applied on top).
        out: folder to write into.

    Returns:
        The SVG path.
    """
    from rankscope.tui.app import make_app
    from rankscope.tui.sources import StaticSource, StoreSource

    display = replace(settings.display, color=shot.color)
    ready = isinstance(store, (StaticSource, StoreSource))
    source = store if ready else StoreSource(store, "simulated")
    app = make_app(replace(settings, display=display), source, run=shot.run)
    async with app.run_test(size=shot.size) as pilot:
        await wait_ready(pilot)
        if shot.baseline is not None:
            app.baseline_run = shot.baseline
            await wait_ready(pilot)
        if shot.before is not None:
            await shot.before(pilot)
            if shot.name == "detail":
                await pilot.press("enter")
                await wait_ready(pilot)
                await _wait_detail(pilot)
        for key in shot.keys:
            await pilot.press(key)
            await wait_ready(pilot)
        await pilot.pause(0.3)
        path = out / f"{shot.name}.svg"
        path.write_text(app.export_screenshot(title=f"rankscope · {shot.name}"), "utf-8")
    return path


async def _wait_detail(pilot: Any) -> None:
    app = pilot.app
    for _ in range(400):
        if app.detail is not None:
            await pilot.pause(0.2)
            return
        await pilot.pause(0.05)
    raise TimeoutError("rank detail did not arrive")


def to_png(svg: Path) -> Path | None:
    """Convert an SVG screenshot to PNG with ``rsvg-convert``.

    The SVG names the Fira Code web font; the conversion substitutes a local monospace
    font (DejaVu Sans Mono) so every cell keeps its width.

    Args:
        svg: the SVG file.

    Returns:
        The PNG path, or None when ``rsvg-convert`` is missing.
    """
    exe = shutil.which("rsvg-convert")
    if exe is None:
        return None
    text = svg.read_text("utf-8").replace("Fira Code, monospace", "DejaVu Sans Mono, monospace")
    # Cells that start with a (non-breaking) space lose it in rsvg unless told to keep it.
    text = text.replace("<svg ", '<svg xml:space="preserve" ', 1)
    png = svg.with_suffix(".png")
    subprocess.run([exe, "-o", str(png)], input=text.encode("utf-8"), check=True)
    return png


def main(argv: list[str] | None = None) -> int:
    """Regenerate the pictures (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m rankscope.tui.screenshots", description=__doc__)
    ap.add_argument("--out", default="screenshots", help="folder for the SVG and PNG files")
    ap.add_argument("--only", nargs="*", default=None, help="names of the pictures to make")
    rec = ap.add_argument_group("one picture of a recording (instead of the simulated runs)")
    rec.add_argument("--record", default=None, help="recording folder (rankscope hub --record)")
    rec.add_argument("--run", default=None, help="run to show (default: the newest full run)")
    rec.add_argument("--baseline", default=None, help="baseline run to compare with")
    rec.add_argument("--name", default="recording", help="picture name (file stem)")
    rec.add_argument("--size", default="120x32", help="terminal COLSxROWS (default 120x32)")
    rec.add_argument("--keys", nargs="*", default=(), help="keys to press before the shot")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.record is not None:
        return _shoot_recording(args, out)
    shots = [s for s in SHOTS if not args.only or s.name in args.only]
    unknown = set(args.only or ()) - {s.name for s in SHOTS}
    if unknown:
        ap.error(f"unknown pictures {sorted(unknown)}; known: {[s.name for s in SHOTS]}")
    needed = {s.store for s in shots}
    stores = {}
    if "example" in needed:
        stores["example"] = simulated_store(
            [
                ("seed-example-baseline", "run-0412", 64, 100),
                ("seed-example", "run-0419", 64, 100),
            ]
        )
    if "hang" in needed:
        from rankscope.tui.scenes import Fault, synthetic_run
        from rankscope.tui.sources import StaticSource

        # The simulator models slow ranks, not hung ones: this run is synthetic.
        hung = synthetic_run(64, 40, fault=Fault("hang", rank=19), run="run-0422")
        stores["hang"] = StaticSource([hung], {"events_per_s": 0.0}, label="synthetic")
    if "large" in needed:
        # The worked example's own scale: 512 GPUs on 64 hosts.
        stores["large"] = simulated_store(
            [("seed-example-baseline", "run-0412", 512, 30), ("seed-example", "run-0419", 512, 30)]
        )
    if "ladder" in needed:
        stores["ladder"] = ladder_source()
    settings = deterministic_settings()
    settings = replace(settings, display=DisplaySettings(**{**vars(settings.display)}))
    for shot in shots:
        svg = asyncio.run(take(shot, stores[shot.store], settings, out))
        png = to_png(svg)
        print(f"{svg}" + (f"  {png}" if png else "  (no rsvg-convert: SVG only)"))
    return 0


def _shoot_recording(args: argparse.Namespace, out: Path) -> int:
    from rankscope.tui.sources import RecordingSource

    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--size must be COLSxROWS (e.g. 120x32), got {args.size!r}") from None
    source = RecordingSource(args.record, follow=False)
    shot = Shot(
        args.name,
        "record",
        (cols, rows),
        keys=tuple(args.keys),
        baseline=args.baseline,
        run=args.run,
    )
    svg = asyncio.run(take(shot, source, deterministic_settings(), out))
    png = to_png(svg)
    print(f"{svg}" + (f"  {png}" if png else "  (no rsvg-convert: SVG only)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
