"""``rankscope relay``: one per node, between the node's ranks and the hub.

The node's collectors send to it (``ipc://`` or loopback only: nothing off the node
reaches it), it forwards to the hub (or to a relay one level up) in bundles, with the keys
when the hub requires CURVE. `rankscope.hub.relay` has how and why."""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

from rankscope.commands import status_until_signal
from rankscope.errors import CommandError

HELP = "Forward a node's collectors to the hub in bundles (one per node; until Ctrl-C)"


def default_listen(tag: str | None = None) -> str:
    """``ipc://`` in the user's runtime directory (else the temporary one): the node's
    relay, per user, or one of its own for ``tag`` (``rankscope run --relay``: its pid)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{Path(base) / f'rankscope-relay-{tag or os.getuid()}.sock'}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--listen",
        default=None,
        help="where the node's collectors send: ipc://PATH or tcp://127.0.0.1:PORT (clock "
        "pings on PATH.clock or PORT+1) [default: ipc:// in $XDG_RUNTIME_DIR or /tmp, per user]",
    )
    p.add_argument(
        "--upstream",
        required=True,
        help="the hub's data address (or an upper relay's), tcp://HOST:PORT",
    )
    p.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="CURVE client keys for the upstream (default: those `rankscope keys` made in "
        "$RANKSCOPE_KEYS or ~/.config/rankscope/keys, else plain)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plain ZeroMQ to the upstream even where keys are found",
    )
    p.add_argument(
        "--flush-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="longest time a message waits in the relay [default: %(default)s]",
    )
    p.add_argument(
        "--hwm",
        type=int,
        default=64,
        metavar="BUNDLES",
        help="bundles queued for the upstream; past it the relay stops reading, and its "
        "collectors drop and count (never block) [default: %(default)s]",
    )
    p.add_argument(
        "--serve-keys",
        metavar="DIR",
        default=None,
        help="a rack's relay, which other nodes' relays reach: listen beyond loopback as a "
        "CURVE server with the hub's keys in DIR (hub.key_secret, authorized_clients/), "
        "taking only the authorised clients, as the hub does",
    )
    p.add_argument(
        "--reduce",
        action="store_true",
        help="match the collectives of the groups whose members all send here (a node's "
        "tensor-parallel groups) and send the hub their sums, reduce those of groups "
        "with members elsewhere (data parallel) to parts the hub combines, and gather the "
        "node's messages into one per flush; an upper relay with --reduce gathers its "
        "nodes' (hub.reduce, hub.partial)",
    )
    p.add_argument(
        "--raw-ring",
        type=float,
        default=0.0,
        metavar="MIB",
        help="keep this many MiB of the collectors' recent messages, as sent, and serve "
        "them for drill-down (`rankscope fetch`): what --reduce sums, the ring still holds "
        "row by row [default: 0, none]",
    )
    p.add_argument(
        "--raw-endpoint",
        default=None,
        metavar="ADDR",
        help="where --raw-ring is served: ipc://PATH or tcp://127.0.0.1:PORT [default: "
        "PATH.raw beside an ipc:// --listen, else a free loopback port]",
    )
    p.add_argument(
        "--drill",
        default=None,
        metavar="ADDR",
        help="the hub's drill address (rankscope hub --drill: tcp://HUB:PORT+2): connect "
        "to it with the upstream's keys and answer, from --raw-ring, the drill-down "
        "requests the hub routes here; no port opens on the node",
    )
    p.add_argument(
        "--status-every",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between status lines (0: none) [default: %(default)s]",
    )


def _curve(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from rankscope.collector.security import (
        KeyFileError,
        client_curve_from_env,
        load_client_curve,
    )

    if args.insecure:
        return None
    if args.keys is not None:
        try:
            return load_client_curve(Path(args.keys))
        except KeyFileError as exc:
            raise CommandError(f"--keys {args.keys}: {exc}") from None
    return client_curve_from_env()


def run(args: argparse.Namespace) -> int:
    from rankscope.hub.relay import Relay, RelayError, status_line

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    curve = _curve(args)
    if not args.flush_ms > 0:
        raise CommandError(f"--flush-ms must be > 0, got {args.flush_ms}")
    if not 0 <= args.raw_ring <= 1 << 20:
        raise CommandError(f"--raw-ring must be between 0 and {1 << 20} MiB, got {args.raw_ring}")
    if args.raw_endpoint is not None and not args.raw_ring:
        raise CommandError("--raw-endpoint needs --raw-ring MIB (the ring it serves)")
    if args.drill is not None and not args.raw_ring:
        raise CommandError("--drill needs --raw-ring MIB (the ring it answers from)")
    server = None
    if args.serve_keys is not None:
        from rankscope.hub.security import KeyFileError, load_hub_security

        try:
            server = load_hub_security(Path(args.serve_keys))
        except KeyFileError as exc:
            raise CommandError(f"--serve-keys {args.serve_keys}: {exc}") from None
    try:
        relay = Relay(
            args.listen or default_listen(),
            args.upstream,
            curve=curve,
            flush_s=args.flush_ms / 1000.0,
            hwm=args.hwm,
            reduce=args.reduce,
            server=server,
            raw_ring_bytes=int(args.raw_ring * (1 << 20)),
            raw_endpoint=args.raw_endpoint,
            drill=args.drill,
        )
        relay.start()
    except RelayError as exc:
        raise CommandError(str(exc)) from None
    mode = "CURVE" if curve is not None else "plain"
    print(
        f"relay on {relay.endpoint} (clock {relay.clock_endpoint}) -> {relay.upstream} ({mode})",
        flush=True,
    )
    if relay.ring is not None:
        print(
            f"raw ring of {args.raw_ring:g} MiB served on {relay.raw_endpoint} "
            f"(rankscope fetch {relay.raw_endpoint} --ranks ... --record DIR)",
            flush=True,
        )

    def line() -> str:
        return status_line(relay.counters, relay.reducer and relay.reducer.counters, relay.ring)

    try:
        status_until_signal(args.status_every, line)
    finally:
        relay.stop()
        print(line(), flush=True)
    return 0
