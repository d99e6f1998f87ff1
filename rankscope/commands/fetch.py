"""``rankscope fetch ENDPOINT --record DIR``: a relay's raw rows of chosen ranks, as a
recording.

A reducing relay (``rankscope relay --reduce``) sends the hub sums where it can; with
``--raw-ring MIB`` it also keeps its ranks' recent messages as they were sent and serves
them (`rankscope.hub.rawring`). This command asks for some ranks and steps and writes what
comes back as an ordinary recording, so ``rankscope export --perfetto``, ``open`` and
``diagnose`` read those ranks row by row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rankscope.commands.grammar import add_run, rank_ranges, steps_count
from rankscope.errors import CommandError
from rankscope.sanitize import terminal_text

HELP = "Copy a relay's raw rows of chosen ranks and steps into a recording (drill-down)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="a relay's raw endpoint, as `rankscope relay --raw-ring` printed it "
        "(ipc://PATH.raw, tcp://HOST:PORT), or the hub's drill endpoint (`rankscope hub "
        "--drill`: tcp://HUB:PORT+2), which asks the relays that hold the ranks",
    )
    p.add_argument("--record", metavar="DIR", required=True, help="recording to write into")
    add_run(p, "run id (default: the newest run the relay holds)")
    p.add_argument(
        "--ranks",
        metavar="SPEC",
        default=None,
        help="ranks, e.g. 0-7,49 (default: every rank the relay holds)",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--steps",
        type=steps_count,
        default=None,
        metavar="N",
        help="the newest N steps the relay holds of those ranks (default: all it holds)",
    )
    when.add_argument(
        "--step-range",
        default=None,
        metavar="A:B",
        help="steps A to B, inclusive",
    )
    p.add_argument(
        "--max-mib",
        type=float,
        default=256.0,
        metavar="MIB",
        help="most MiB of messages in the reply; past it the reply is cut and says so "
        "[default: %(default)s]",
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="[default: 10]")
    p.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="CURVE client keys, for a hub (or a rack's relay) that serves the hub's keys "
        "(default: those `rankscope keys` made, else plain)",
    )
    p.add_argument("--insecure", action="store_true", help="plain ZeroMQ even where keys are found")


def _step_range(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        lo, hi = int(a), int(b)
    except ValueError:
        raise CommandError(f"--step-range {text!r}: expected A:B, two step ids") from None
    if not sep or not 0 <= lo <= hi:
        raise CommandError(f"--step-range {text!r}: expected A:B with 0 <= A <= B")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    from rankscope.commands.relay import _curve
    from rankscope.hub.rawring import MAX_REPLY_BYTES, RawFetchError, Request, fetch
    from rankscope.hub.recording import RecordingWriter

    try:
        ranks = tuple(rank_ranges(args.ranks)) if args.ranks is not None else None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    steps = _step_range(args.step_range) if args.step_range is not None else None
    if not 0 < args.max_mib <= MAX_REPLY_BYTES >> 20:
        raise CommandError(f"--max-mib must be in (0, {MAX_REPLY_BYTES >> 20}], got {args.max_mib}")
    if not args.timeout > 0:
        raise CommandError(f"--timeout must be > 0, got {args.timeout}")
    req = Request(
        run=args.run,
        ranks=ranks,
        steps=steps,
        last=args.steps,
        max_bytes=max(1, int(args.max_mib * (1 << 20))),
    )
    try:
        reply = fetch(args.endpoint, req, timeout_s=args.timeout, curve=_curve(args))
    except (RawFetchError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if reply.run is None or not reply.messages:
        raise CommandError(
            f"{args.endpoint} holds nothing for that request"
            + (f" (ranks not held: {_short(reply.missing)})" if reply.missing else "")
        )
    source = {
        "kind": "relay-raw",
        "endpoint": args.endpoint,
        "ranks": list(ranks) if ranks is not None else None,
        "held": {str(r): list(v) for r, v in reply.held.items()},
        "cut": reply.cut,
    }
    writer = RecordingWriter(Path(args.record), info={"source": source})
    try:
        for data, t in zip(reply.messages, reply.t_recv):
            writer.append(data, t)
    finally:
        writer.close()
    size = sum(map(len, reply.messages)) / (1 << 20)
    print(
        f"{len(reply.messages)} messages ({size:.1f} MiB) of run "
        f"{terminal_text(reply.run)} into {args.record}"
    )
    for r, (lo, hi) in list(reply.held.items())[:16]:
        print(f"  rank {r}: the relay holds steps {lo}-{hi}")
    if len(reply.held) > 16:
        print(f"  ... and {len(reply.held) - 16} more ranks")
    if reply.missing:
        print(
            f"rankscope: warning: held by no relay that answered: ranks {_short(reply.missing)}",
            file=sys.stderr,
        )
    if reply.cut:
        print(
            f"rankscope: warning: the reply was cut at {args.max_mib:g} MiB; ask for fewer "
            "ranks or steps, or a larger --max-mib",
            file=sys.stderr,
        )
    return 0


def _short(ranks: list[int]) -> str:
    text = ", ".join(map(str, ranks[:16]))
    return text + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
