"""``snapshot.md``: a snapshot's content as a comment to paste into a ticket.

Rendered from the ``snapshot.json`` content only, so the Markdown and the JSON never
disagree. Times are shown in milliseconds.

Most of the content comes from telemetry (run ids, host names, manifest fields and values,
evidence that quotes them): every value is written through `rankscope.sanitize`, as text
(`_md`) or inside a code span (`_code`), so a hostile name shows as its characters and
never as HTML, an image, a link or a broken table.
"""

from __future__ import annotations

import re
from typing import Any

from rankscope.sanitize import for_markdown, for_markdown_code


class _Md(str):
    """Markdown already made safe (a code span): written as it is."""


def _md(v: Any) -> str:
    return v if isinstance(v, _Md) else for_markdown("–" if v is None else v)


def _code(v: Any, *, table: bool = False) -> _Md:
    # In a GFM table an unescaped pipe ends the cell even inside a code span.
    text = for_markdown_code(v)
    return _Md(f"`{text.replace('|', chr(92) + '|') if table else text}`")


def _ms(ns: Any, digits: int = 1) -> str:
    return "–" if ns is None else f"{ns / 1e6:,.{digits}f}"


def _cell(v: Any) -> str:
    return _md(v)


def _found(sweep: dict[str, Any]) -> str:
    # "rail (pair [0, 1], rail 1)": what the sweep concluded and what it named.
    found = sweep.get("found") or {}
    named = [f"{k} {v}" for k, v in found.items() if k != "slow_pairs" and v not in (None, [], "")]
    head = str(sweep.get("finding") or "–")
    return f"{head} ({', '.join(named)})" if named else head


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def _verdict_md(diag: dict[str, Any]) -> list[str]:
    hyps = diag.get("verdict", {}).get("hypotheses", [])
    if not hyps:
        note = diag.get("note")
        return [f"No verdict: {_md(note)}." if note else "No verdict.", ""]
    top = hyps[0]
    where = ", ".join(
        f"{k} {', '.join(_md(x) for x in top[k][:8])}"
        for k in ("ranks", "hosts", "rails", "groups")
        if top.get(k)
    )
    out = [
        f"**{_md(top['mechanism'])}** — score {top['score']:.2f}"
        + (f", {top['impact']:.0%} of the step" if top.get("impact") is not None else "")
        + (f" ({where})" if where else ""),
        "",
    ]
    out += [f"- {_md(e)}" for e in top.get("evidence", [])]
    out += [f"- caveat: {_md(c)}" for c in top.get("caveats", [])]
    nxt = top.get("next_experiment")
    if nxt:
        out += [
            "",
            f"### Next experiment ({_md(nxt.get('scope'))})",
            "",
            f"- **Change:** {_md(nxt.get('change'))}",
            f"- **Predicted:** {_md(nxt.get('metric'))} goes {_md(nxt.get('direction'))}",
            f"- **Supports it:** {_md(nxt.get('supports'))}",
            f"- **Rejected if:** {_md(nxt.get('rejects'))}",
        ]
    if len(hyps) > 1:
        out += ["", "Other hypotheses:", ""]
        out += _table(
            ["mechanism", "score", "impact"],
            [
                [
                    h["mechanism"],
                    f"{h['score']:.2f}",
                    "–" if h.get("impact") is None else f"{h['impact']:.0%}",
                ]
                for h in hyps[1:5]
            ],
        )
    return [*out, ""]


def _what_if_md(diag: dict[str, Any]) -> list[str]:
    """The localisation headline and its suspects: who sets the step and what fixing them
    would save, before any mechanism is named."""
    loc = diag.get("localisation") or {}
    found = loc.get("finding") or {}
    suspect = found.get("suspect")
    if suspect:
        cat = (
            f"; its extra time goes to {_md(suspect['category'])}"
            if suspect.get("category")
            else ""
        )
        out = [f"**What-if:** {_md(suspect['what_if'])}{cat}.", ""]
    elif found.get("moving"):
        out = [
            f"**What-if:** step −{found['gain']:.1%} if each step's slowest rank behaved like "
            "the median rank (the slow rank moves).",
            "",
        ]
    elif found:
        out = [
            f"**What-if:** no rank, host or stage would save more than 2% of the step beyond "
            f"chance (best {found.get('gain') or 0:.1%}).",
            "",
        ]
    else:
        return []
    rows = [
        [
            s["label"],
            f"{s['gain']:.1%}",
            f"{max(s['net_gain'], 0.0):.1%}",
            "–" if s.get("sets") is None else f"{s['sets']:.0%}",
            s.get("category") or "–",
        ]
        for s in (loc.get("suspects") or [])[:5]
    ]
    if rows:
        out += _table(
            ["suspect", "what-if gain", "beyond chance", "sets the step", "goes to"], rows
        )
    return out


_PART_PATH = re.compile(r"hang/[A-Za-z0-9_.\-/]+")


def _link(rel: Any) -> _Md:
    """A link to a file of the bundle's ``hang/`` part; any other path is shown as code."""
    text = str(rel)
    if _PART_PATH.fullmatch(text) and ".." not in text.split("/"):
        return _Md(f"[{text.split('/')[-1]}]({text})")
    return _code(text, table=True)


def stall_md(hang: dict[str, Any]) -> list[str]:
    """The stall a hang bundle was written for: the culprit and the case first, what every
    other rank waits in, and links to the evidence in ``hang/``.

    Args:
        hang: the ``hang`` section of ``snapshot.json``.

    Returns:
        Markdown lines (a ``## Stall`` section).
    """
    v = hang.get("verdict") or {}
    files = hang.get("files") or {}
    culprits = v.get("culprits") or []
    idle = v.get("idle_s")
    out = ["## Stall", ""]
    head = "**STALLED**" if v.get("stalled") else "**stall over**"
    if idle is not None:
        head += f" — no rank progressed for {idle:.1f} s (threshold {v.get('threshold_s')} s)"
    if culprits:
        c = culprits[0]
        head += (
            f"; culprit **rank {_md(c.get('rank'))}** on {_md(c.get('host') or '?')}, "
            f"case **{_md(c.get('case'))}**"
        )
        if c.get("op") and int(c.get("seq", -1)) >= 0:
            head += f", in {_md(c.get('group_name'))}:{_md(c.get('op'))}#{_md(c.get('seq'))}"
    out += [head + ".", ""]

    def stacks(rank: Any) -> Any:
        rel = files.get(f"stacks:r{rank}")
        return _link(rel) if rel else "–"

    if culprits:
        out += _table(
            ["culprit", "host", "case", "group", "op", "seq", "detail", "stacks"],
            [
                [
                    c.get("rank"),
                    c.get("host"),
                    c.get("case"),
                    c.get("group_name"),
                    c.get("op"),
                    c.get("seq"),
                    c.get("detail"),
                    stacks(c.get("rank")),
                ]
                for c in culprits[:8]
            ],
        )
    held = {c.get("rank") for c in culprits}
    waiting = [w for w in v.get("waiting") or [] if w.get("rank") not in held]
    if waiting:
        out += ["What the other ranks wait in:", ""]
        out += _table(
            ["rank", "where", "stacks"],
            [[w.get("rank"), w.get("where"), stacks(w.get("rank"))] for w in waiting[:16]],
        )
        if len(waiting) > 16:
            out += [f"... and {len(waiting) - 16} more ranks (`hang/verdict.json`).", ""]
    fr = hang.get("flight_recorder") or {}
    dumps = fr.get("dumps") or {}
    if dumps:
        listed = ", ".join(f"rank {_md(r)}: {_link(rel)}" for r, rel in dumps.items())
        out += [
            f"- **Flight Recorder:** {listed} (`rankscope import flight-recorder "
            "DIR/hang/flight_recorder --record REC`)"
        ]
    if fr.get("note"):
        out += [f"- **Flight Recorder:** {_md(fr['note'])}"]
    evidence = [_link(rel) for key, rel in files.items() if not key.startswith("fr:")]
    if evidence:
        out += ["- **Evidence:** " + ", ".join(evidence)]
    if hang.get("diagnosis_note"):
        out += [f"- **Diagnosis:** {_md(hang['diagnosis_note'])}"]
    return [*out, ""]


def render_markdown(content: dict[str, Any]) -> str:
    """``snapshot.md``: the snapshot as a ticket comment.

    Args:
        content: ``snapshot.json`` content.

    Returns:
        Markdown text.
    """
    c = content
    diag = c.get("diagnosis") or {}
    win = c["window"]
    base = c.get("baseline")
    lines = [f"# rankscope snapshot — {_md(c['job'])} / {_md(c['run'])}", ""]
    lines += [
        f"- **When:** {_md(c['created'])}",
        f"- **Job / run / scope:** {_md(c['job'])} / {_md(c['run'])} / {_md(c['scope'])}"
        + (f" (rerun of {_md(c['parent_run'])})" if c.get("parent_run") else ""),
        f"- **Ranks:** {c['world_size']} on {c['hosts']} hosts",
        f"- **Window:** steps {'–'.join(map(str, win['steps'])) or 'none'}"
        f" ({win['n_steps']} steps)",
        f"- **Baseline:** {_md(base['run']) + ' (' + _md(base['scope']) + ')' if base else 'none'}",
        "",
    ]
    if c.get("hang"):
        lines += stall_md(c["hang"])
    lines += ["## Verdict", "", *_what_if_md(diag), *_verdict_md(diag)]
    dist = diag.get("distributions", {})
    cur, ref = dist.get("current") or {}, dist.get("baseline") or {}
    lines += ["## Step time (job step: median over ranks, per step; ms)", ""]
    rows: list[list[Any]] = []
    for k in ("p50", "p90", "p99", "max", "mean"):
        a, b = cur.get(k), ref.get(k)
        ratio = f"{a / b:.2f}x" if a is not None and b else "–"
        rows.append([k, _ms(a), _ms(b), ratio])
    rows.append(["tail stalls", cur.get("tail_stalls"), ref.get("tail_stalls"), ""])
    lines += _table(["", "current", "baseline", "ratio"], rows)
    dec = diag.get("decomposition", {})
    lines += ["## Where the step time goes (mean per rank-step; ms)", ""]
    lines += _table(
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
    if dec.get("first_appears"):
        lines += [f"The missing time first appears in **{_md(dec['first_appears'])}**.", ""]
    lines += ["## Last-arriving ranks", ""]
    crit = diag.get("critical_path", {})
    if c["last_arrivers"]:
        lines += _table(
            ["rank", "host", "times last", "decisive"],
            [[a["rank"], a["host"], a["count"], a["decisive"]] for a in c["last_arrivers"][:10]],
        )
        lines += [
            f"Out of {crit.get('complete')} complete collectives; clock error "
            f"{_ms(crit.get('clock_error_ns'), 3)} ms.",
            "",
        ]
    else:
        lines += ["No complete collective in the window.", ""]
    corr = diag.get("correlations", {})
    lines += ["## Correlation with structure", ""]
    effects = sorted(corr.get("effects", []), key=lambda e: -(e.get("epsilon2") or 0))[:8]
    if effects:
        lines += _table(
            ["metric", "dimension", "ε²", "stands out"],
            [
                [
                    e["metric"],
                    e["dimension"],
                    f"{e['epsilon2']:.2f}" if e.get("epsilon2") is not None else "–",
                    e["standout"],
                ]
                for e in effects
            ],
        )
    sr = corr.get("slow_rank") or {}
    if sr:
        kind = "stays on the same rank" if sr.get("stable") else "moves between ranks"
        lines += [
            f"The slowest rank {kind}: {sr.get('distinct')} distinct, most frequent "
            f"rank {_md(sr.get('modal_rank'))}.",
            "",
        ]
    lines += ["## Pinned ranks", ""]
    lines += (
        _table(
            ["rank", "host", "step p50 ms", "times last", "mean lateness ms"],
            [
                [
                    p["rank"],
                    p["host"],
                    _ms(None if p["step_p50_ms"] is None else p["step_p50_ms"] * 1e6),
                    p["times_last"],
                    "–" if p["late_mean_ms"] is None else f"{p['late_mean_ms']:.3f}",
                ]
                for p in c["pins"]
            ],
        )
        if c["pins"]
        else ["None.", ""]
    )
    man = c["manifest"]
    lines += ["## Manifest", ""]
    lines += [f"- {_code(k)}: {_md(v)}" for k, v in man["highlights"].items()] + [""]
    if base:
        lines += [f"Differences from the baseline ({len(man['diff'])}):", ""]
        lines += (
            _table(
                ["field", "baseline", "current"],
                [
                    [_code(d["field"], table=True), d["baseline"], d["current"]]
                    for d in man["diff"][:40]
                ],
            )
            if man["diff"]
            else ["None.", ""]
        )
    lad = c.get("ladder")
    lines += ["## Ladder", ""]
    if lad:
        lines += _table(
            ["scope", "run", "ranks", "step p50 ms", "regression", "why"],
            [
                [
                    r["scope"],
                    r["run"],
                    r["world_size"],
                    _ms(r["step"]["p50"]),
                    "yes" if r["regression"] else "no",
                    r["why"],
                ]
                for r in lad["rungs"]
            ],
        )
        first = _md(lad.get("first_scope") or "none")
        lines += [f"First scope: **{first}** — {_md(lad.get('meaning'))}", ""]
    else:
        lines += ["No reduced-scope rerun yet.", ""]
    lines += ["## Sweeps", ""]
    sweeps = c.get("sweeps") or []
    lines += (
        _table(
            ["run", "scope", "backend", "found", "conclusion"],
            [
                [
                    s.get("run"),
                    s.get("scope"),
                    s.get("backend"),
                    _found(s),
                    s.get("conclusion"),
                ]
                for s in sweeps
            ],
        )
        if sweeps
        else ["No sweep of this run.", ""]
    )
    lines += ["## Experiments", ""]
    lines += (
        _table(
            ["id", "hypothesis", "change", "predicted", "rejected if", "status"],
            [
                [
                    e.get("id"),
                    e.get("hypothesis"),
                    e.get("change"),
                    f"{e.get('metric')} {e.get('direction')}",
                    e.get("rejection"),
                    (e.get("evaluation") or {}).get("verdict", "recorded"),
                ]
                for e in c["experiments"]
            ],
        )
        if c["experiments"]
        else ["None recorded.", ""]
    )
    lines += [
        "## Reopen",
        "",
        "```",
        for_markdown_code(c.get("reopen") or "rankscope open DIR"),
        "rankscope report " + for_markdown_code((c.get("reopen") or "DIR").split()[-1]),
        "```",
        "",
    ]
    files = c.get("files") or {}
    if files:
        listed = ", ".join(_code(v) for k, v in files.items() if k != "png_note")
        lines += ["Files: " + listed, ""]
    return "\n".join(lines)
