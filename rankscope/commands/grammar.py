"""The options every command spells the same way, and reading what they name.

One grammar across ``rankscope`` commands:

======================  ==============================================================
``PATH``                a recording directory (``rankscope hub --record DIR``), or where
                        a command says so, a snapshot folder (its ``window/``)
``--run ID``            a run id
``--baseline PATH``     a recording (or snapshot) of a healthy run
``--baseline-run ID``   the healthy run's id: in ``--baseline`` when given, else in PATH
``--steps N``           how many of the most recent steps of each run are read
======================  ==============================================================

Old spellings stay as hidden aliases that warn (``--last N`` for ``--steps N``; a run id
given to ``--baseline`` of ``ladder`` and ``rerun`` is read as ``--baseline-run``), so
scripts keep working. Everything here fails with `CommandError`, naming what was wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rankscope.errors import CommandError

__all__ = [
    "METAVARS",
    "add_baseline",
    "add_run",
    "add_steps",
    "baseline_window",
    "load_run",
    "read_store",
    "recording_of",
    "steps_count",
    "window_of",
]

METAVARS: dict[str, str] = {
    "--run": "ID",
    "--baseline": "PATH",
    "--baseline-run": "ID",
    "--steps": "N",
}
"""The metavar of each shared option: what kind of value it takes, the same everywhere."""


def rank_ranges(spec: str, world: int = 1 << 31) -> list[int]:
    """The ranks of a ``--ranks A-B,C,...`` spec (inclusive ranges), sorted.

    Args:
        spec: the option's value.
        world: ranks are below it (the run's world size, where known).

    Raises:
        ValueError: naming the bad part of the spec.
    """
    out: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--ranks {spec!r}: {part!r} is not a rank or a range A-B") from None
        if not 0 <= a <= b < world:
            raise ValueError(f"--ranks {spec!r}: {part!r} is outside the run's ranks 0-{world - 1}")
        if b - a >= 1 << 20:
            raise ValueError(f"--ranks {spec!r}: {part!r} names more than {1 << 20} ranks")
        out.update(range(a, b + 1))
    return sorted(out)


def warn(text: str) -> None:
    """One line on stderr that does not stop the command."""
    print(f"rankscope: warning: {text}", file=sys.stderr)


def steps_count(text: str) -> int:
    """``--steps`` value: a whole number of steps, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


class _Deprecated(argparse.Action):
    """A hidden old spelling: stores into the new option's ``dest`` and says so once."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kw: Any):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        warn(f"{option_string} is deprecated; use {self.new}")
        setattr(namespace, self.dest, values)


def add_run(p: argparse.ArgumentParser, help: str) -> None:
    """``--run ID``."""
    p.add_argument("--run", metavar=METAVARS["--run"], default=None, help=help)


def add_steps(
    p: argparse.ArgumentParser,
    default: int | None,
    help: str,
    *,
    old: Sequence[str] = (),
) -> None:
    """``--steps N`` (the most recent steps read), with hidden deprecated spellings.

    Args:
        p: the command's parser.
        default: steps read when the option is not given.
        help: help text (the default is appended).
        old: earlier spellings of the same option (e.g. ``--last``), kept hidden.
    """
    p.add_argument(
        "--steps",
        metavar=METAVARS["--steps"],
        type=steps_count,
        default=default,
        help=f"{help} (default {default})" if default is not None else help,
    )
    for spelling in old:
        p.add_argument(
            spelling,
            dest="steps",
            metavar=METAVARS["--steps"],
            type=steps_count,
            action=_Deprecated,
            new="--steps",
            help=argparse.SUPPRESS,
        )


def add_baseline(p: argparse.ArgumentParser) -> None:
    """``--baseline PATH`` and ``--baseline-run ID``."""
    p.add_argument(
        "--baseline",
        metavar=METAVARS["--baseline"],
        default=None,
        help="recording (or snapshot) of a healthy run to compare with, or an imported "
        "nccl-tests recording: the fabric's expected busbw per op and size",
    )
    p.add_argument(
        "--baseline-run",
        metavar=METAVARS["--baseline-run"],
        default=None,
        help="the healthy run's id: in --baseline when given (default: its most recent "
        "run), else in PATH",
    )


def recording_of(path: str | Path) -> str:
    """A snapshot folder's ``window/`` recording, or ``path`` itself."""
    p = Path(path)
    if (p / "snapshot.json").is_file() and (p / "window").is_dir():
        return str(p / "window")
    return str(path)


def read_store(path: str | Path, steps: int) -> Any:
    """Replay a recording, keeping the raw collective rows of the last ``steps`` steps of
    every run (so the decomposition counts overlapping asynchronous collectives once).

    Args:
        path: recording directory.
        steps: steps per run to keep.

    Returns:
        The store, holding at least one run.

    Raises:
        CommandError: no recording at ``path``, an unreadable one, or one with no run.
    """
    from rankscope.hub import replay
    from rankscope.hub.recording import RecordingError

    if not Path(path).exists():
        raise CommandError(f"no recording at {str(path)!r}")
    steps = max(int(steps), 1)
    try:
        store = replay.load(path, history_steps=steps, raw_steps=steps)
    except RecordingError as exc:
        raise CommandError(f"{path}: {exc}") from None
    if not store.run_ids():
        raise CommandError(f"{path}: the recording holds no run")
    return store


def window_of(store: Any, path: str | Path, run: str | None, steps: int) -> Any:
    """The window of one run of a replayed recording.

    Args:
        store: the store (`read_store`).
        path: its recording, for the message.
        run: run id, or None for the most recent.
        steps: steps in the window.

    Raises:
        CommandError: no such run (the message lists the runs).
    """
    known = store.run_ids()
    if run is not None and run not in known:
        raise CommandError(f"{path}: unknown run {run!r}; runs: {', '.join(known)}")
    return store.window(run, last=steps)


def load_run(path: str | Path, run: str | None, steps: int) -> tuple[Any, Any]:
    """Replay a recording and take the window of one run, keeping the raw collective rows
    of every step in it (what ``diagnose``, ``export`` and ``snapshot`` read).

    Returns:
        ``(store, window)``.

    Raises:
        CommandError: naming what is wrong (no recording, unreadable recording, no run,
            unknown run).
    """
    store = read_store(path, steps)
    return store, window_of(store, path, run, steps)


def baseline_window(
    args: argparse.Namespace, store: Any, path: str | Path, *, legacy_run: bool = False
) -> Any:
    """The baseline window ``--baseline`` / ``--baseline-run`` name, or None.

    Args:
        args: parsed arguments (``baseline``, ``baseline_run``, ``steps``).
        store: the replayed recording PATH (where ``--baseline-run`` alone is looked up).
        path: PATH.
        legacy_run: the command once took a run id in ``--baseline``: one that is not a
            path but a run of PATH is read as ``--baseline-run``, with a warning.

    Returns:
        The healthy run's window, or None when neither option was given.

    Raises:
        CommandError: no recording at ``--baseline``, or no such run.
    """
    where, run, steps = args.baseline, args.baseline_run, args.steps
    if where is None and run is None:
        return None
    if where is not None and not Path(where).exists():
        if legacy_run and run is None and where in store.run_ids():
            warn(f"--baseline {where}: a run id goes in --baseline-run (read as that)")
            where, run = None, args.baseline
        else:
            raise CommandError(
                f"--baseline {where!r}: no recording there (a run id goes in --baseline-run)"
            )
    if where is None or Path(where).resolve() == Path(path).resolve():
        return window_of(store, path, run, steps)
    return load_run(recording_of(where), run, steps)[1]
