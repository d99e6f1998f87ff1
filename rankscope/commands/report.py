"""``rankscope report SNAPSHOT``: a snapshot rendered richly in the terminal.

The same renderables draw the text screen (``screen.svg``) of a snapshot taken without the
TUI, so the picture in a ticket is what ``report`` shows.

A snapshot's strings come from telemetry (and the file may come from anyone): the content
is cleaned with `rankscope.sanitize.clean_data` before it is drawn, and every value enters
a table or a title as plain `Text` or escaped markup, never as console markup.
"""

from __future__ import annotations

import argparse
import io
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rankscope.sanitize import clean_data

HELP = "Render a snapshot bundle (folder or .tar.gz) in the terminal"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", metavar="SNAPSHOT", help="snapshot folder, snapshot.json or .tar.gz")
    p.add_argument("--width", type=int, default=None, help="render at this many columns")


def _ms(ns: Any, digits: int = 1) -> str:
    return "–" if ns is None else f"{ns / 1e6:,.{digits}f}"


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    # A str cell or title would be read as console markup: a host named "[link=...]" must
    # stay a name, so cells are Text and the title is escaped.
    t = Table(title=escape(title), title_justify="left", title_style="bold", expand=False)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        t.add_row(*(Text("–" if v is None else str(v)) for v in row))
    return t


def _header(c: dict[str, Any]) -> Panel:
    win = c["window"]
    base = c.get("baseline")
    lines = Text()
    lines.append(f"{c['job']} / {c['run']}", style="bold")
    lines.append(f"  scope {c['scope']}")
    if c.get("parent_run"):
        lines.append(f" (rerun of {c['parent_run']})")
    lines.append(f"\n{c['world_size']} ranks on {c['hosts']} hosts · steps ")
    lines.append("–".join(map(str, win["steps"])) or "none")
    lines.append(f" ({win['n_steps']}) · taken {c['created']}")
    lines.append("\nbaseline: " + (f"{base['run']} ({base['scope']})" if base else "none"))
    return Panel(lines, title="rankscope snapshot", title_align="left")


def _stall(hang: dict[str, Any]) -> Panel:
    """A hang bundle's stall: the culprit and the case first, then what the others wait in."""
    v = hang.get("verdict") or {}
    body = Text()
    idle = v.get("idle_s")
    body.append("STALLED" if v.get("stalled") else "stall over", style="bold red")
    if idle is not None:
        body.append(f"  no rank progressed for {idle:.1f} s (threshold {v.get('threshold_s')} s)")
    culprits = v.get("culprits") or []
    for c in culprits[:8]:
        where = f" in {c.get('group_name')}:{c.get('op')}#{c.get('seq')}" if c.get("op") else ""
        body.append(f"\nculprit rank {c.get('rank')} on {c.get('host') or '?'}: ", style="bold")
        body.append(f"{c.get('case')}{where} — {c.get('detail')}")
    held = {c.get("rank") for c in culprits}
    waiting = [w for w in v.get("waiting") or [] if w.get("rank") not in held]
    for w in waiting[:8]:
        body.append(f"\nrank {w.get('rank')}: {w.get('where')}")
    if len(waiting) > 8:
        body.append(f"\n... and {len(waiting) - 8} more ranks")
    files = hang.get("files") or {}
    stacks = [rel for key, rel in files.items() if key.startswith("stacks:")]
    if stacks:
        body.append("\nstacks: " + ", ".join(map(str, stacks)), style="dim")
    fr = hang.get("flight_recorder") or {}
    dumps = fr.get("dumps") or {}
    body.append(
        "\nflight recorder: "
        + (", ".join(map(str, dumps.values())) if dumps else str(fr.get("note") or "none")),
        style="dim",
    )
    if hang.get("diagnosis_note"):
        body.append(f"\ndiagnosis: {hang['diagnosis_note']}", style="italic")
    return Panel(body, title="stall", title_align="left")


def _verdict(diag: dict[str, Any]) -> Panel:
    hyps = diag.get("verdict", {}).get("hypotheses", [])
    if not hyps:
        return Panel("no verdict", title="verdict", title_align="left")
    top = hyps[0]
    body = Text()
    body.append(
        top["mechanism"], style="bold red" if top["mechanism"] != "healthy" else "bold green"
    )
    body.append(f"  score {top['score']:.2f}")
    if top.get("impact") is not None:
        body.append(f" · {top['impact']:.0%} of the step")
    for k in ("ranks", "hosts", "rails", "groups"):
        if top.get(k):
            body.append(f"\n{k}: {', '.join(map(str, top[k][:12]))}")
    for e in top.get("evidence", []):
        body.append(f"\n• {e}")
    nxt = top.get("next_experiment")
    if nxt:
        body.append(f"\n\nnext experiment ({nxt.get('scope')}): ", style="bold")
        body.append(str(nxt.get("change")))
        body.append(f"\npredicted: {nxt.get('metric')} goes {nxt.get('direction')}")
        body.append(f"\nsupports it: {nxt.get('supports')}")
        body.append("\nrejected if: ", style="bold")
        body.append(str(nxt.get("rejects")))
    others = ", ".join(f"{h['mechanism']} {h['score']:.2f}" for h in hyps[1:5])
    if others:
        body.append(f"\n\nother hypotheses: {others}", style="dim")
    return Panel(body, title="verdict", title_align="left")


def renderables(c: dict[str, Any]) -> list[RenderableType]:
    """The snapshot as rich renderables, in reading order.

    Args:
        c: ``snapshot.json`` content.

    Returns:
        Panels and tables.
    """
    c = clean_data(c)
    diag = c.get("diagnosis") or {}
    out: list[RenderableType] = [_header(c)]
    if c.get("hang"):
        out.append(_stall(c["hang"]))
    out.append(_verdict(diag))
    dist = diag.get("distributions", {})
    cur, ref = dist.get("current") or {}, dist.get("baseline") or {}
    rows: list[list[Any]] = []
    for k in ("p50", "p90", "p99", "max", "mean"):
        a, b = cur.get(k), ref.get(k)
        rows.append([k, _ms(a), _ms(b), f"{a / b:.2f}x" if a is not None and b else "–"])
    rows.append(["tail stalls", cur.get("tail_stalls"), ref.get("tail_stalls"), ""])
    out.append(_table("step time (ms)", ["", "current", "baseline", "ratio"], rows))
    dec = diag.get("decomposition", {})
    title = "where the step goes (ms per rank-step)"
    if dec.get("first_appears"):
        title += f" — missing time first appears in {dec['first_appears']}"
    out.append(
        _table(
            title,
            ["category", "current", "baseline", "delta", "slowest rank"],
            [
                [
                    r["category"],
                    _ms(r["current_ns"]),
                    _ms(r["baseline_ns"]),
                    _ms(r["delta_ns"]),
                    _ms(r["max_rank_current_ns"]),
                ]
                for r in dec.get("categories", [])
            ],
        )
    )
    out.append(
        _table(
            "last-arriving ranks",
            ["rank", "host", "times last", "decisive"],
            [[a["rank"], a["host"], a["count"], a["decisive"]] for a in c["last_arrivers"][:10]],
        )
    )
    effects = sorted(
        diag.get("correlations", {}).get("effects", []), key=lambda e: -(e.get("epsilon2") or 0)
    )[:8]
    out.append(
        _table(
            "correlation with structure",
            ["metric", "dimension", "ε²", "stands out"],
            [
                [
                    e["metric"],
                    e["dimension"],
                    "–" if e.get("epsilon2") is None else f"{e['epsilon2']:.2f}",
                    e["standout"],
                ]
                for e in effects
            ],
        )
    )
    if c["pins"]:
        out.append(
            _table(
                "pinned ranks",
                ["rank", "host", "step p50 ms", "times last", "mean lateness ms"],
                [
                    [
                        p["rank"],
                        p["host"],
                        "–" if p["step_p50_ms"] is None else f"{p['step_p50_ms']:.1f}",
                        p["times_last"],
                        "–" if p["late_mean_ms"] is None else f"{p['late_mean_ms']:.3f}",
                    ]
                    for p in c["pins"]
                ],
            )
        )
    man = c["manifest"]
    out.append(
        _table("manifest", ["field", "value"], [[k, v] for k, v in man["highlights"].items()])
    )
    if c.get("baseline"):
        out.append(
            _table(
                f"manifest diff against the baseline ({len(man['diff'])})",
                ["field", "baseline", "current"],
                [[d["field"], d["baseline"], d["current"]] for d in man["diff"][:40]],
            )
        )
    lad = c.get("ladder")
    if lad:
        out.append(
            _table(
                f"ladder — first scope: {lad.get('first_scope') or 'none'}",
                ["scope", "run", "ranks", "step p50 ms", "regression"],
                [
                    [
                        r["scope"],
                        r["run"],
                        r["world_size"],
                        _ms(r["step"]["p50"]),
                        "yes" if r["regression"] else "no",
                    ]
                    for r in lad["rungs"]
                ],
            )
        )
        out.append(Text(str(lad.get("meaning")), style="italic"))
    if c["experiments"]:
        out.append(
            _table(
                "experiments",
                ["id", "hypothesis", "predicted", "rejected if", "status"],
                [
                    [
                        e.get("id"),
                        e.get("hypothesis"),
                        f"{e.get('metric')} {e.get('direction')}",
                        e.get("rejection"),
                        (e.get("evaluation") or {}).get("verdict", "recorded"),
                    ]
                    for e in c["experiments"]
                ],
            )
        )
    view = c.get("view") or {}
    out.append(
        Text(
            f"view: metric {view.get('metric')}, grouped by {view.get('group_by')}, "
            f"pins {view.get('pins') or 'none'} · reopen: {c.get('reopen') or 'rankscope open DIR'}",
            style="dim",
        )
    )
    return out


def render_svg(content: dict[str, Any], width: int = 120) -> str:
    """The report as an SVG screen (for snapshots taken without the TUI).

    Args:
        content: ``snapshot.json`` content.
        width: columns.

    Returns:
        SVG text.
    """
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(Group(*renderables(content)))
    return console.export_svg(title=f"rankscope snapshot — {clean_data(content['run'])}")


def run(args: argparse.Namespace) -> int:
    from rankscope.snapshot import load_snapshot

    content, _ = load_snapshot(args.snapshot)  # a SnapshotError names what is wrong
    console = Console(width=args.width) if args.width else Console()
    for r in renderables(content):
        console.print(r)
    return 0
