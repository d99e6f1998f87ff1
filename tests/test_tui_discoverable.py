"""At 80x24 a new user can find every key and read every line: `?` stays in the footer,
the help scrolls to its last key with the keyboard, the header and verdict are shortened
at word boundaries, the ladder fits 80 columns with run names that stay distinct, and a
saved view says that it is applied and is reset by one key.

The screen is read as the terminal would show it (the compositor's lines), not from
widget state, so a line that is cut or pushed off screen fails the test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from rankscope.diagnosis.synthetic import make_window, rank_layout
from rankscope.launch.ladder import build_ladder
from rankscope.launch.report import ladder_text, short_names
from rankscope.tui.app import RankscopeApp, make_app
from rankscope.tui.dialogs import HelpScreen, key_rows
from rankscope.tui.ladder_screen import LadderScreen
from rankscope.tui.main_screen import MainScreen
from rankscope.tui.panels import HeaderBar, VerdictLine
from rankscope.tui.scenes import Fault, synthetic_run
from rankscope.tui.settings import deterministic_settings
from rankscope.tui.sources import StaticSource
from rankscope.tui.viewstate import SavedView, load_view, save_view

SMALL = (80, 24)


def run_async(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


@pytest.fixture(scope="module")
def slow13():
    return synthetic_run(64, 40, fault=Fault("slow_device", rank=13), run="run-b")


@pytest.fixture(scope="module")
def healthy():
    return synthetic_run(64, 40, run="run-a", seed=1)


def _app(windows, state: Path | str = "", **kw) -> RankscopeApp:
    source = StaticSource(windows, health={"events_per_s": 12000})
    return make_app(deterministic_settings(state), source, **kw)


async def settle(pilot, app: RankscopeApp, analysis: bool = True) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while loop.time() < deadline:
        await pilot.pause(0.02)
        busy = any(w.is_running for w in app.workers) or app._sampling
        busy = busy or (analysis and app.diagnosing)
        if app.model is not None and (not analysis or app.analysis is not None) and not busy:
            await pilot.pause(0.05)
            return
    raise AssertionError("the app did not settle")


def screen_lines(app) -> list[str]:
    """The terminal's lines as drawn now."""
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


def widget_lines(app, widget) -> list[str]:
    """The lines of the screen inside ``widget``'s region."""
    region = widget.content_region
    lines = screen_lines(app)[region.y : region.bottom]
    return [line[region.x : region.right].rstrip() for line in lines]


# ----------------------------------------------------------------- footer and help


@run_async
async def test_help_stays_in_the_footer_at_80x24(slow13, healthy) -> None:
    app = _app([healthy, slow13])
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot, app)
        assert isinstance(app.screen, MainScreen)
        footer = screen_lines(app)[-1]
        assert footer.lstrip().startswith("? Help"), footer
        # The keys used most are there too, and nothing is cut at the right edge.
        for key in ("space Pin", "/ Filter", "m Metric", "q Quit"):
            assert key in footer, footer
        await pilot.press("L")  # another screen: its footer also starts with `?`
        await pilot.pause(0.1)
        assert isinstance(app.screen, LadderScreen)
        assert screen_lines(app)[-1].lstrip().startswith("? Help")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)


# down and j walk one line a press (the longest walks, ~9 s in a busy suite): in the slow
# tier; end and pagedown reach the last key in the default one.
@pytest.mark.parametrize(
    "key",
    [
        "end",
        "pagedown",
        pytest.param("j", marks=pytest.mark.slow),
        pytest.param("down", marks=pytest.mark.slow),
    ],
)
@run_async
async def test_the_help_scrolls_to_its_last_key_with_the_keyboard(slow13, key) -> None:
    app = _app([slow13])
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot, app, analysis=False)
        await pilot.press("question_mark")
        help_screen = app.screen
        assert isinstance(help_screen, HelpScreen)
        rows = key_rows(app.help_sections())
        sections = {section for section, _, _ in rows}
        # Every screen's keys are listed.
        for name in ("Main screen", "Heatmap", "Rank detail", "Rerun menu", "Ladder", "Experi"):
            assert any(s.startswith(name) for s in sections), (name, sections)
        assert any(s.startswith("Snapshot") for s in sections)
        first, last = rows[0][2], rows[-1][2]
        await pilot.pause(0.05)
        shown = "\n".join(screen_lines(app))
        assert first in shown and last not in shown  # the list is longer than the screen
        # As many presses as the scroll needs, and two more (one line per j/down, one
        # screen per pagedown): the last key must be in view after them.
        lines = int(help_screen.scroller.max_scroll_y)
        page = max(1, int(help_screen.scroller.size.height) - 1)
        presses = {"end": 1, "pagedown": -(-lines // page) + 2}.get(key, lines + 2)
        for _ in range(presses):
            await pilot.press(key)
        await pilot.pause(0.05)
        shown = "\n".join(screen_lines(app))
        assert last in shown, shown
        assert help_screen.scroller.scroll_y == help_screen.scroller.max_scroll_y > 0
        await pilot.press("home")
        await pilot.pause(0.05)
        assert first in "\n".join(screen_lines(app))
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


# ----------------------------------------------------------------- header and verdict


def _words(lines: list[str]) -> list[str]:
    return [w for line in lines for w in line.split()]


LONG_RUN = "seed-example-s12-full-7a55b4"
"""Named as ``rankscope demo`` names runs: too long for the header at 80 columns."""


@run_async
async def test_header_and_verdict_are_shortened_at_word_boundaries() -> None:
    runs = [
        synthetic_run(64, 40, run=f"{LONG_RUN}-healthy", seed=1),
        synthetic_run(64, 40, fault=Fault("slow_device", rank=13), run=LONG_RUN),
    ]
    wide = _app(runs, baseline=f"{LONG_RUN}-healthy")
    async with wide.run_test(size=(400, 30)) as pilot:
        await settle(pilot, wide)
        full_header = _words(widget_lines(wide, wide.screen.query_one(HeaderBar)))
        full_verdict = _words(widget_lines(wide, wide.screen.query_one(VerdictLine)))
    narrow = _app(runs, baseline=f"{LONG_RUN}-healthy")
    async with narrow.run_test(size=SMALL) as pilot:
        await settle(pilot, narrow)
        for widget, full in (
            (narrow.screen.query_one(HeaderBar), full_header),
            (narrow.screen.query_one(VerdictLine), full_verdict),
        ):
            lines = widget_lines(narrow, widget)
            assert all(len(line) <= widget.content_region.width for line in lines)
            for word in _words(lines):
                # A word is whole, or whole before the ellipsis that ends a shortened line.
                assert word in full or word.rstrip("…") in full or word == "…", (word, lines)
        header = widget_lines(narrow, narrow.screen.query_one(HeaderBar))
        assert f"{LONG_RUN} · full" in header[0] and "base p50" in header[1]
        verdict = widget_lines(narrow, narrow.screen.query_one(VerdictLine))
        assert verdict[0].startswith("▶ ") and verdict[1].startswith("→ next: ")


# ----------------------------------------------------------------- ladder


def _window(world: int, run: str, scope: str, parent: str | None = None, slow: float = 0.0):
    t0 = np.tile(np.arange(6) * 1e8, (world, 1)).astype(float)
    dur = np.full((world, 6), 1e8)
    dur[0] *= 1 + slow
    win = make_window(t0, t0 + dur, ranks=rank_layout(world))
    return dataclasses.replace(win, job="llm", run=run, scope=scope, parent_run=parent)


PARENT = "seed-example-s7-full-3f9a2c"


def _ladder():
    kids = [
        _window(1, f"{PARENT}-one-rank", "one-rank", PARENT),
        _window(8, f"{PARENT}-one-node", "one-node", PARENT, slow=0.3),
        _window(16, f"{PARENT}-two-node", "two-node", PARENT, slow=0.3),
    ]
    return build_ladder(_window(16, PARENT, "full", slow=0.3), kids)


def test_ladder_text_fits_80_columns_and_tells_the_runs_apart() -> None:
    lines = ladder_text(_ladder())
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("scope "))
    rows = lines[header + 1 : header + 5]
    names = [row.split()[1] for row in rows]
    assert len(set(names)) == 4, rows
    assert names == ["…-one-rank", "…-one-node", "…-two-node", "…-3f9a2c"]
    assert [row.split()[-1] for row in rows] == ["no", "YES", "YES", "YES"]
    assert "every name starts with seed-example-s7-full" in " ".join(" ".join(lines).split())
    # Wide enough, the names are shown whole.
    wide = ladder_text(_ladder(), width=200)
    assert any(f" {PARENT}-one-node " in line for line in wide)


def test_short_names_keep_the_distinguishing_end() -> None:
    shown, _ = short_names(["run-0419-full", "run-0419-full-rerun-one-node"], 15)
    assert shown == {"run-0419-full": "…-full", "run-0419-full-rerun-one-node": "…-one-node"}
    # Names with nothing in common keep their ends, and stay distinct.
    a, b = "a" * 30 + "-x", "b" * 30 + "-x"
    shown, shared = short_names([a, b], 15)
    assert len(set(shown.values())) == 2 and shared == ""
    assert all(len(v) <= 15 for v in shown.values())
    # Short names are left alone.
    assert short_names(["r1", "r1-one-node"], 15) == (
        {"r1": "r1", "r1-one-node": "r1-one-node"},
        "",
    )


@run_async
async def test_the_ladder_screen_fits_80_columns(tmp_path) -> None:
    kids = [
        _window(1, f"{PARENT}-one-rank", "one-rank", PARENT),
        _window(8, f"{PARENT}-one-node", "one-node", PARENT, slow=0.3),
    ]
    app = _app([_window(16, PARENT, "full", slow=0.3), *kids])
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot, app)
        await pilot.press("L")
        screen = app.screen
        assert isinstance(screen, LadderScreen)
        for _ in range(400):
            await pilot.pause(0.05)
            if screen.ladder is not None and not screen.building:
                break
        await pilot.pause(0.1)
        table = screen.query_one("#table")
        width = table.content_region.width
        text = table.content.plain.splitlines()
        assert max(len(line) for line in text) <= width, text
        # Drawn line for line: a row that wrapped would take more lines than the text has.
        assert table.size.height == len(text)
        rows = [line for line in text if line.startswith(("one-rank", "one-node", "full "))]
        assert len({row.split()[1] for row in rows}) == 3, rows


# ----------------------------------------------------------------- saved views


def _note(app) -> str:
    widget = app.screen.query_one("#viewnote")
    return " ".join(widget_lines(app, widget)) if widget.display else ""


@run_async
async def test_a_saved_view_says_so_and_R_resets_it(slow13, tmp_path: Path) -> None:
    save_view(tmp_path, "demo-llm", SavedView("step", "rail", (13, 4), None, "run-b"))
    app = _app([slow13], tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot, app)
        assert app.pins == (13, 4) and app.metric == "step" and app.group_by == "rail"
        note = _note(app)
        assert note.startswith("view: saved for job demo-llm (pins 2, metric step, by rail")
        assert note.endswith("R resets"), note
        await pilot.press("R")
        await settle(pilot, app, analysis=False)
        defaults = deterministic_settings().view
        assert app.pins == () and app.metric == defaults.metric
        assert app.group_by == defaults.group_by
        assert not app.screen.query_one("#viewnote").display
    saved = load_view(tmp_path, "demo-llm")
    assert saved is not None and saved.pins == () and saved.metric == defaults.metric


@run_async
async def test_pins_saved_on_another_run_are_not_applied_and_the_note_says_so(
    slow13, tmp_path: Path
) -> None:
    save_view(tmp_path, "demo-llm", SavedView("step", "host", (7, 9, 11), None, "run-old"))
    app = _app([slow13], tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot, app)
        assert app.pins == () and app.metric == "step"
        note = _note(app)
        assert "(metric step)" in note and "3 pins of run-old not applied" in note, note
        await pilot.press("m")  # a change that saves the view keeps the other run's pins
        await settle(pilot, app, analysis=False)
        data = json.loads(next((tmp_path / "views").glob("*.json")).read_text())
        assert data["pins"] == [7, 9, 11] and data["pins_run"] == "run-old"
        await pilot.press("space")  # pinning on this run makes these its pins
        await settle(pilot, app, analysis=False)
        assert len(app.pins) == 1
        assert "not applied" not in _note(app)
    data = json.loads(next((tmp_path / "views").glob("*.json")).read_text())
    assert data["pins"] == list(app.pins) and data["pins_run"] == "run-b"


# ----------------------------------------------------------------- abbreviation (no app)


def test_fields_go_by_priority_and_what_stays_is_cut_at_a_word() -> None:
    from rich.text import Text

    from rankscope.tui.abbrev import Field, fit_fields, fit_words

    fields = [
        Field(Text("● LIVE"), sep=""),
        Field(Text("step 99")),
        Field(Text("llm-1b3-longctx"), priority=2),
        Field(Text("run-0419 · full")),
        Field(Text("64 ranks on 8 hosts"), priority=1),
        Field(Text("simulated"), priority=3),
    ]
    full = fit_fields(fields, 0).plain
    assert full.endswith("│ 64 ranks on 8 hosts │ simulated")
    # The largest priority goes first, then the next; the order of what stays is kept.
    assert fit_fields(fields, 78).plain == full.removesuffix(" │ simulated")
    assert fit_fields(fields, 50).plain == "● LIVE │ step 99 │ run-0419 · full"
    # Only must-stay fields left: the last is shortened at a word, with an ellipsis.
    assert fit_fields(fields, 28).plain == "● LIVE │ step 99 │ run-0419…"
    text = Text("the slowest rank's compute leads the median rank by 10.4% of the step")
    assert fit_words(text, 40).plain == "the slowest rank's compute leads the…"
    assert fit_words(text, 200) is text
    # Two lines of room: as much as wraps into them, at a word.
    two = fit_words(text, 30, lines=2).plain
    assert two.endswith("…") and text.plain.startswith(two[:-1])
    assert len(two) <= 60 and two[:-1].split()[-1] in text.plain.split()
