"""``rankscope watch``: a hub and the live TUI in one process.

The simple case over SSH: start it on a machine the ranks can reach, point the collectors
at the address it prints, and watch. Quitting the view stops the hub (the recording, when
asked for, stays on disk). For a hub that outlives the view, run ``rankscope hub --record
DIR`` and attach any number of ``rankscope open DIR`` viewers.

The hub listens on loopback by default; beyond loopback it needs keys (``rankscope keys``,
then CURVE) or ``--insecure``, as ``rankscope hub`` does (`rankscope.hub.security`).
"""

from __future__ import annotations

import argparse
import sys

from rankscope.commands.grammar import add_run
from rankscope.commands.keys import add_transport_options, hub_security_of
from rankscope.errors import CommandError

HELP = "Hub + live TUI in one process (collectors push to --bind)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bind",
        default=None,
        help="data address the collectors push to (default: [hub] bind in the settings, "
        "tcp://127.0.0.1:5555; tcp://*:PORT for every interface needs keys or --insecure)",
    )
    add_transport_options(p)
    p.add_argument(
        "--record",
        metavar="DIR",
        default=None,
        help="also record into DIR (default: [hub] record_dir in the settings; none)",
    )
    add_run(p, "run to show (default: the newest full run)")
    p.add_argument("--config", default=None, help="settings file (see config/default.toml)")
    p.add_argument(
        "--drill",
        action="store_true",
        help="also take drill-down requests on PORT+2, as `rankscope hub --drill` does",
    )


def run(args: argparse.Namespace) -> int:
    import zmq

    from rankscope.hub.recording import RecordingError
    from rankscope.hub.server import Hub
    from rankscope.tui.app import make_app
    from rankscope.tui.settings import load_settings
    from rankscope.tui.sources import LiveSource

    settings = load_settings(args.config)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise CommandError(
            "watch needs a terminal; for a hub without a view run `rankscope hub --record DIR`"
        )
    bind = args.bind or settings.hub.bind
    record = args.record or settings.hub.record_dir or None
    security = hub_security_of(args, bind)
    try:
        hub = Hub(bind, record_dir=record, security=security, drill=args.drill)
        hub.start()
    except (ValueError, RecordingError, zmq.ZMQError) as exc:
        raise CommandError(f"cannot start the hub on {bind}: {exc}") from None
    try:
        app = make_app(settings, LiveSource(hub, f"live {hub.endpoint}"), run=args.run)
        app.run()
    finally:
        hub.stop()
    where = f"; recording in {record}" if record else ""
    print(f"rankscope watch: hub on {hub.endpoint} stopped{where}")
    return 0
