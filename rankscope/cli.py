"""The ``rankscope`` command line.

Each subcommand lives in its own module under ``rankscope.commands`` exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported
only when their command runs, so ``rankscope hub`` never pays for Textual or torch.

Errors in what the user gave (a missing recording, an unknown run, a bad option value, an
unreadable file) end the command with one line on stderr, ``rankscope: error: ...``, and
exit status 2: commands raise `rankscope.errors.CommandError` and `main` prints it. The
options that name the same thing are spelled the same in every command
(`rankscope.commands.grammar`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import NoReturn

from rankscope.errors import CommandError
from rankscope.version import __version__

COMMANDS: dict[str, str] = {
    # name -> module under rankscope.commands
    "demo": "demo",
    "watch": "watch",
    "open": "open_",
    "hub": "hub",
    "relay": "relay",
    "fetch": "fetch",
    "keys": "keys",
    "run": "run",
    "inspect": "inspect",
    "diagnose": "diagnose",
    "eval": "eval_",
    "rerun": "rerun",
    "sweep": "sweep",
    "ladder": "ladder",
    "experiment": "experiment",
    "snapshot": "snapshot",
    "report": "report",
    "export": "export",
    "import": "import_",
}

INPUT_ERRORS: tuple[tuple[str, str], ...] = (
    # (module, class): library errors that only ever describe what the user gave — a
    # recording, snapshot, template, settings file, experiment record or value that cannot
    # be used. They read as a `CommandError` wherever a command lets one through.
    ("rankscope.hub.recording", "RecordingError"),
    ("rankscope.snapshot_files", "SnapshotError"),
    ("rankscope.launch.templates", "TemplateError"),
    ("rankscope.launch.safety", "UnsafeValueError"),
    ("rankscope.launch.experiments", "ExperimentError"),
    ("rankscope.tui.settings", "SettingsError"),
    ("rankscope.sim.draw", "ScenarioError"),
)
"""Checked by name in ``sys.modules``: an error class whose module was never imported cannot
have been raised, so `main` imports none of them."""


class _ParseError(Exception):
    """A command line argparse refused (raised instead of argparse's exit)."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``rankscope: error: ...``) and a
    return value of `main`, not a usage block and a `SystemExit`."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(f"{message} (see {self.prog} --help)")


def _available() -> dict[str, ModuleType]:
    mods: dict[str, ModuleType] = {}
    for name, mod in COMMANDS.items():
        try:
            mods[name] = importlib.import_module(f"rankscope.commands.{mod}")
        except ModuleNotFoundError as exc:
            # A command whose module is not in this build is left out of the parser.
            if exc.name != f"rankscope.commands.{mod}":
                raise
    return mods


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the parser; with ``only``, import just that command's module."""
    parser = Parser(
        prog="rankscope",
        description="Live monitor and diagnosis for distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"rankscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only is not None and only in COMMANDS:
        mods: dict[str, ModuleType] = {
            only: importlib.import_module(f"rankscope.commands.{COMMANDS[only]}")
        }
    else:
        mods = _available()
    for name, mod in mods.items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)  # type: ignore[attr-defined]
        mod.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=mod.run)  # type: ignore[attr-defined]
    return parser


def is_input_error(exc: BaseException) -> bool:
    """Whether ``exc`` describes what the user gave (`CommandError` or an `INPUT_ERRORS`
    class, or an `OSError` naming a file) rather than a bug in rankscope."""
    if isinstance(exc, CommandError):
        return True
    if isinstance(exc, OSError) and exc.filename is not None:
        return True
    for module, name in INPUT_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
    return False


def _fail(message: str) -> int:
    # Messages quote what the user or the telemetry gave (run ids, host names): shown,
    # never obeyed by the terminal.
    from rankscope.sanitize import terminal_text

    print(f"rankscope: error: {terminal_text(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rankscope`` console script.

    Returns:
        The exit status: 0 on success, 2 for an error in what the user gave (one line on
        stderr), or the command's own status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(only=first if first in COMMANDS else None)
        args = parser.parse_args(argv)
    except _ParseError as exc:
        return _fail(str(exc))
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``rankscope diagnose --json | head``): nothing more to say,
        # and nothing to say it to; stdout is pointed at devnull so the exit flush is quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        if not is_input_error(exc):
            raise
        text = str(exc) if not isinstance(exc, KeyError) else str(exc.args[0])
        return _fail(" ".join(text.split()) or type(exc).__name__)


if __name__ == "__main__":
    sys.exit(main())
