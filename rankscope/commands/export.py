"""``rankscope export PATH``: a recording into the tools teams already run.

``--perfetto OUT.json`` writes a Chrome / Perfetto trace (open it at ui.perfetto.dev);
``--csv DIR`` writes per-rank-step and per-collective tables. Both read the last ``--steps``
steps of one run of the recording. ``--parquet DIR`` streams the whole recording (every
step; one run with ``--run``) into Parquet tables (`hub.export_parquet`; needs pyarrow).
"""

from __future__ import annotations

import argparse

import numpy as np

from rankscope.collector import schema
from rankscope.commands.grammar import add_run, add_steps, load_run, rank_ranges, recording_of
from rankscope.diagnosis.window import Window
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = (
    "Export a recording as a Perfetto trace (--perfetto), CSV tables (--csv) or Parquet "
    "tables of the whole recording (--parquet)"
)
DEFAULT_STEPS = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", metavar="PATH", help="recording directory, or a snapshot folder (its window/)"
    )
    p.add_argument("--perfetto", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--csv", metavar="DIR", help="write CSV tables into DIR")
    p.add_argument(
        "--parquet",
        metavar="DIR",
        help=(
            "write steps, phases, collectives and instances of the whole recording (every "
            "step; --steps does not apply) as Parquet into DIR, streaming (needs pyarrow)"
        ),
    )
    add_run(p, "run id (default: the most recent run)")
    add_steps(p, DEFAULT_STEPS, "most recent steps to export")
    p.add_argument(
        "--ranks",
        metavar="SPEC",
        default=None,
        help=(
            "Perfetto: only these ranks, e.g. 0-7,49, or last:N for the N ranks that arrived "
            "last most often (default: every rank; a large job's full trace is too big to open)"
        ),
    )


def parse_ranks(spec: str, window: Window) -> list[int]:
    """The ranks a ``--ranks`` spec names.

    Args:
        spec: ``A-B,C,...`` (inclusive ranges), or ``last:N``.
        window: the exported window (its world size and last-arrival counts).

    Returns:
        Sorted rank numbers.

    Raises:
        ValueError: naming the bad part of the spec.
    """
    world = window.world_size
    if spec.startswith("last:"):
        try:
            n = int(spec[5:])
        except ValueError:
            raise ValueError(f"--ranks {spec!r}: expected last:N with N a number") from None
        if n < 1:
            raise ValueError(f"--ranks {spec!r}: N must be at least 1")
        times = np.nansum(window.coll["times_last"], axis=1)
        late = np.nansum(window.coll["late_ns"], axis=1)
        order = np.lexsort((np.arange(world), -late, -times))
        return sorted(int(r) for r in order[:n])
    return rank_ranges(spec, world)


def recorded_phases(path: str, window: Window) -> tuple[dict[str, np.ndarray], list[str]]:
    """The raw phase spans of a window's run, read from the recording's ``steps`` messages
    (and relays' ``reduced`` ones).

    The store keeps only per-step phase totals, so the spans come from the frames. Phase
    codes are per message (``PHASES`` + that sender's ``phase_names``); they are mapped to
    one shared list of user names here.

    Args:
        path: recording directory.
        window: the window (its run and steps select the spans).

    Returns:
        ``(table, user_phase_names)``: a phases table with a ``rank`` column.
    """
    from rankscope.hub.recording import read_frames
    from rankscope.hub.reduce import unpack_node

    names: list[str] = []
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("rank", "step", "phase", "t0", "t1")}
    wanted = set(window.steps.tolist())
    for frame in read_frames(path):
        try:
            msg = schema.decode(frame.payload)
        except schema.SchemaError:
            continue  # the hub recorded only accepted messages; a damaged one adds nothing
        if msg.kind not in ("steps", "reduced") or msg.header.get("run") != window.run:
            continue
        for part in unpack_node(msg) if msg.kind == "reduced" else [msg]:
            _phase_part(part, wanted, names, parts)
    table = {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in parts.items()}
    return table, names


def _phase_part(
    msg: schema.Message, wanted: set[int], names: list[str], parts: dict[str, list[np.ndarray]]
) -> None:
    """Add the phase spans of one rank's steps message of the wanted steps to ``parts``
    (user phase names mapped into ``names``)."""
    ph = msg.tables.get("phases")
    if ph is None or not ph["step"].shape[0]:
        return
    keep = np.isin(ph["step"], list(wanted))
    if not keep.any():
        return
    own = [str(n) for n in msg.header.get("phase_names") or []]
    codes = ph["phase"].astype(np.int64)[keep]
    mapped = codes.copy()
    for i, name in enumerate(own):
        if name not in names:
            names.append(name)
        mapped[codes == len(schema.PHASES) + i] = len(schema.PHASES) + names.index(name)
    n = int(keep.sum())
    parts["rank"].append(np.full(n, int(msg.header["rank"]), dtype=np.int64))
    parts["step"].append(ph["step"][keep].astype(np.int64))
    parts["phase"].append(mapped)
    parts["t0"].append(ph["t0"][keep].astype(np.int64))
    parts["t1"].append(ph["t1"][keep].astype(np.int64))


def _parquet(args: argparse.Namespace) -> None:
    from rankscope.hub.export_parquet import ParquetUnavailable, write_parquet
    from rankscope.hub.recording import RecordingError

    try:
        s = write_parquet(args.parquet, args.path, run=args.run)
    except ParquetUnavailable as exc:
        raise CommandError(f"export --parquet: {exc}") from None
    except (ValueError, RecordingError) as exc:
        raise CommandError(f"export --parquet: {exc}") from None
    if args.run is not None and args.run not in s.runs:
        known = ", ".join(s.runs) or "none"
        raise CommandError(
            f"export --parquet: run {args.run!r} is not in {args.path} (runs: {known})"
        )
    tables = ", ".join(f"{name} ({n} rows)" for name, n in s.rows.items())
    left = f"; {s.undecodable} undecodable messages left out" if s.undecodable else ""
    print(terminal_text(f"parquet: {s.folder}: {tables}{left}"))


def run(args: argparse.Namespace) -> int:
    if not args.perfetto and not args.csv and not args.parquet:
        raise CommandError("export: give --perfetto OUT.json, --csv DIR and/or --parquet DIR")
    args.path = recording_of(args.path)
    if args.parquet:
        from pathlib import Path

        if not Path(args.path).exists():
            raise CommandError(f"no recording at {args.path!r}")
        _parquet(args)
        if not args.perfetto and not args.csv:
            return 0
    _, window = load_run(args.path, args.run, args.steps)
    try:
        # Checked before anything is written, even when only CSV is asked for.
        ranks = parse_ranks(args.ranks, window) if args.ranks else None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    span = (
        f"steps {int(window.steps[0])}-{int(window.steps[-1])}" if window.steps.size else "no step"
    )
    print(terminal_text(f"run {window.run} ({window.scope}, {window.world_size} ranks), {span}"))
    try:
        if args.perfetto:
            from rankscope.hub.export_perfetto import phase_spans, write_trace

            table, names = recorded_phases(args.path, window)
            spans = phase_spans(window, table, names) if table["step"].shape[0] else None
            s = write_trace(args.perfetto, window, spans, ranks)
            print(
                terminal_text(
                    f"perfetto: {s.path}: {s.slices} slices ({s.collectives} collectives, "
                    f"{s.last_arrivals} last arrivals marked) on {s.ranks} ranks, {s.hosts} hosts"
                    + f" ({s.threads} threads)"
                    + " — open it at ui.perfetto.dev"
                )
            )
        if args.csv:
            from rankscope.hub.export_csv import write_csv

            c = write_csv(args.csv, window)
            tables = ", ".join(f"{name} ({n} rows)" for name, n in c.rows.items())
            print(terminal_text(f"csv: {c.folder}: {tables}"))
    except ValueError as exc:  # an output the writers refuse (e.g. a folder in the way)
        raise CommandError(str(exc)) from None
    return 0
