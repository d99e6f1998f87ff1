"""Rank detail: one rank against the median rank over time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from rankscope.tui.abbrev import Field, fit_fields
from rankscope.tui.charts import sparkline
from rankscope.tui.detailmodel import Compare, RankDetail
from rankscope.tui.dialogs import HELP_BINDING
from rankscope.tui.panels import fmt_ms, sync_table


def _fmt(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return "–"
    if unit in ("ms", "MHz", "W", "°C", "%", "GiB"):
        return fmt_ms(value)
    if abs(value) >= 1e6:
        return f"{value:.3g}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def fmt_bytes(value: float) -> str:
    """A byte count with a binary unit (``437 MiB``); "–" when unknown."""
    if not math.isfinite(value):
        return "–"
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.3g} {unit}"


def _ratio(c: Compare) -> str:
    r = c.ratio
    return "–" if not math.isfinite(r) else f"×{r:.2f}"


def compare_table(title: str, table_id: str) -> DataTable:
    """A keyed table for `Compare` rows."""
    table: DataTable = DataTable(id=table_id, cursor_type="none")
    for i, label in enumerate((title, "rank", "median", "rank/median")):
        table.add_column(label, key=f"c{i}")
    return table


def compare_rows(rows: Sequence[Compare]) -> list[tuple[str, tuple[str, ...]]]:
    """Rows for `sync_table` from comparisons."""
    return [
        (
            c.label,
            (
                f"{c.label} ({c.unit})" if c.unit else c.label,
                _fmt(c.rank, c.unit),
                _fmt(c.median, c.unit),
                _ratio(c),
            ),
        )
        for c in rows
    ]


def series_text(detail: RankDetail, width: int) -> Text:
    """Per series: the rank's and the median rank's sparklines on one shared scale."""
    text = Text()
    spark_w = max(width - 38, 8)
    for s in detail.series:
        both = np.concatenate([s.rank, s.median])
        finite = both[np.isfinite(both)]
        if finite.size == 0:
            continue
        lo, hi = float(finite.min()), float(finite.max())
        r_mean = s.rank[np.isfinite(s.rank)].mean() if np.isfinite(s.rank).any() else math.nan
        m_mean = s.median[np.isfinite(s.median)].mean() if np.isfinite(s.median).any() else math.nan
        if text:
            text.append("\n")
        text.append(f"{s.label:<14}", style="bold")
        text.append(f"rank   {sparkline(s.rank, spark_w, lo, hi)} ", style="yellow")
        text.append(f"{fmt_ms(r_mean)} {s.unit}\n")
        text.append(" " * 14)
        text.append(f"median {sparkline(s.median, spark_w, lo, hi)} ", style="cyan")
        text.append(f"{fmt_ms(m_mean)} {s.unit}")
    return text


def reduced_note(detail: RankDetail) -> Text:
    """What a reducing relay left on the node, and how to get it."""
    return Text.assemble(
        (f"{detail.reduced_calls:.3g} calls a step", "bold"),
        " matched on the rank's node by its relay: counted above, their rows kept there. "
        "Raw rows: ",
        (f"rankscope fetch tcp://HUB:PORT+2 --ranks {detail.rank} --steps 16 --record DIR", "bold"),
        " (hub --drill, relay --raw-ring MIB --drill)",
    )


class RankDetailScreen(Screen):
    """One rank against the median rank: over time, phases, collectives, device and host
    samples, work per step."""

    BINDINGS: ClassVar[list[BindingType]] = [
        HELP_BINDING,
        Binding("escape", "app.pop_screen", "Back", tooltip="Back to the main screen"),
        Binding("space", "pin", "Pin", tooltip="Pin or unpin this rank"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | ? | Every key of every screen. |
    | escape | Back to the main screen. |
    | space | Pin or unpin this rank. |
    """

    DEFAULT_CSS = """
    RankDetailScreen #title { height: 1; background: $panel; padding: 0 1; }
    RankDetailScreen #series { height: auto; padding: 0 1; }
    RankDetailScreen #reduced { height: auto; padding: 0 1 1 1; }
    RankDetailScreen DataTable { height: auto; margin: 0 1 1 0; }
    RankDetailScreen Horizontal { height: auto; }
    RankDetailScreen Horizontal > DataTable { width: 1fr; }
    RankDetailScreen.-narrow Horizontal { layout: vertical; }
    """

    # Under 120 columns the paired tables stack, so no column is cut off at the right.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # noqa: RUF012

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def compose(self) -> ComposeResult:
        yield Static(id="title")
        with VerticalScroll():
            yield Static(id="series")
            with Horizontal():
                yield compare_table("phase", "phases")
                yield compare_table("collectives", "collectives")
            with Horizontal():
                yield compare_table("device / host", "samples")
                yield compare_table("work per step", "work")
            table: DataTable = DataTable(id="calls", cursor_type="none")
            labels = (
                "group",
                "op",
                "calls / step",
                "size / call",
                "wait ms/call",
                "transfer ms/call",
            )
            for i, label in enumerate(labels):
                table.add_column(label, key=f"c{i}")
            yield table
            yield Static(id="reduced")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Static).update(Text(f"rank {self.rank}: waiting for data", style="italic"))
        detail = getattr(self.app, "detail", None)
        if detail is not None and detail.rank == self.rank:
            self.show_detail(detail)

    def action_pin(self) -> None:
        """Pin or unpin this rank."""
        self.app.toggle_pin(self.rank)  # type: ignore[attr-defined]

    def show_detail(self, detail: RankDetail) -> None:
        """Draw a new detail of this screen's rank."""
        if detail.rank != self.rank:
            return
        fields = [Field(Text(f"rank {detail.rank}", style="bold"), sep="")]
        if self.rank in getattr(self.app, "pins", ()):
            fields.append(Field(Text("● pinned", style="bold yellow"), sep="  "))
        # On a narrow terminal the identity is cut from its end, one whole field at a time.
        items = [f"{k} {v}" for k, v in detail.identity.items() if v]
        fields += [Field(Text(item), priority=i + 1, sep=" · ") for i, item in enumerate(items)]
        title = self.query_one("#title", Static)
        title.update(fit_fields(fields, title.content_size.width or self.size.width - 2))
        self.query_one("#series", Static).update(series_text(detail, self.size.width or 80))
        # Phases the run never records (0 on this rank and on the median) are left out.
        phases = [c for c in detail.phases if c.rank or c.median]
        sync_table(self.query_one("#phases", DataTable), compare_rows(phases))
        sync_table(self.query_one("#collectives", DataTable), compare_rows(detail.collectives))
        sync_table(self.query_one("#samples", DataTable), compare_rows(detail.samples))
        sync_table(self.query_one("#work", DataTable), compare_rows(detail.work))
        reduced = self.query_one("#reduced", Static)
        reduced.display = detail.reduced_calls > 0
        if detail.reduced_calls > 0:
            reduced.update(reduced_note(detail))
        calls = self.query_one("#calls", DataTable)
        calls.display = bool(detail.coll_rows)
        sync_table(
            calls,
            [
                (
                    f"{r.group}/{r.op}",
                    (
                        r.group,
                        r.op,
                        f"{r.calls / max(r.steps, 1):.3g}",
                        fmt_bytes(r.bytes_per_call),
                        fmt_ms(r.wait_ms),
                        fmt_ms(r.transfer_ms),
                    ),
                )
                for r in detail.coll_rows
            ],
        )
