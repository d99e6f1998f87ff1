"""The ``rankscope`` command line.

Each subcommand lives in its own module under ``rankscope.commands`` exposing
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported
only when their command runs, so ``rankscope hub`` never pays for Textual or torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from rankscope.version import __version__

COMMANDS: dict[str, str] = {
    # name -> module under rankscope.commands
    "demo": "demo",
    "watch": "watch",
    "open": "open_",
    "hub": "hub",
    "run": "run",
    "inspect": "inspect",
    "diagnose": "diagnose",
    "eval": "eval_",
    "rerun": "rerun",
    "ladder": "ladder",
    "experiment": "experiment",
    "snapshot": "snapshot",
    "report": "report",
    "export": "export",
}


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
    parser = argparse.ArgumentParser(
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rankscope`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
