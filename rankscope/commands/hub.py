"""``rankscope hub``: run the hub alone, next to the job; viewers attach with
``rankscope open DIR`` to the recording it writes.

It listens on loopback unless ``--bind`` says otherwise. Beyond loopback it needs keys
(``rankscope keys``; then CURVE authenticates and encrypts every connection) or
``--insecure``: `rankscope.hub.security` has the rules."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import zmq

from rankscope.commands import status_until_signal
from rankscope.commands.keys import add_transport_options, hub_security_of
from rankscope.errors import CommandError
from rankscope.hub.recording import RecordingError
from rankscope.hub.runstate import MAX_INSTANCE_ROWS
from rankscope.hub.server import Hub
from rankscope.hub.store import Store
from rankscope.hub.validate import Limits

HELP = "Receive, validate, store and record what the collectors send (until Ctrl-C)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="data address tcp://HOST:PORT (clock on PORT+1; port 0 picks one; tcp://*:PORT "
        "for every interface, which needs keys or --insecure) [default: %(default)s]",
    )
    add_transport_options(p)
    p.add_argument("--record", metavar="DIR", default=None, help="write the recording here")
    p.add_argument(
        "--on-stall",
        metavar="CMD",
        default=None,
        help="run CMD with the hang bundle's path as its last argument when a run stalls "
        "(split like a shell would, never run by one)",
    )
    p.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="floor of the stall threshold in seconds (default 6; at least twice the "
        "longest recent step)",
    )
    p.add_argument(
        "--bundles",
        metavar="DIR",
        default=None,
        help="where hang bundles go (default: DIR of --record, else the current directory)",
    )
    p.add_argument(
        "--status-every",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between status lines (0: none) [default: %(default)s]",
    )
    p.add_argument(
        "--history",
        type=int,
        default=512,
        metavar="STEPS",
        help="steps per rank kept in memory for live views, at most [default: %(default)s]",
    )
    p.add_argument(
        "--max-cells",
        type=int,
        default=4_000_000,
        metavar="CELLS",
        help="rank × step cells kept in memory for all runs together (~93 bytes each): a "
        "new run's history is sized from what is left; runs with no new step for "
        "--idle seconds give theirs up first, down to their floor (--floor-cells, at "
        "least 16 steps), newest steps kept [default: %(default)s]",
    )
    p.add_argument(
        "--floor-cells",
        type=int,
        default=262_144,
        metavar="CELLS",
        help="rank × step cells every run keeps whatever the others need (at least 16 "
        "steps) [default: %(default)s]",
    )
    p.add_argument(
        "--max-instances",
        type=int,
        default=MAX_INSTANCE_ROWS,
        metavar="N",
        help="closed collective instances the hub keeps in memory over all runs (~105 "
        "bytes each), shared as the rings are: each run those of its newest steps; the "
        "sums of older ones stay [default: %(default)s]",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds without a new step (on the steps' own clock) after which a run is "
        "idle [default: %(default)s]",
    )
    p.add_argument(
        "--time-window",
        type=float,
        default=0.0,
        metavar="S",
        help="refuse times more than S seconds from the hub's clock (bad_time); 86400 "
        "suits a hub next to a real job (collectors align their clocks to it); 0: only "
        "impossible times are refused [default: %(default)s]",
    )
    p.add_argument(
        "--max-world",
        type=int,
        default=Limits.max_world_size,
        metavar="RANKS",
        help="most ranks a run may claim (world_too_large) [default: %(default)s]",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=Limits.max_runs,
        metavar="N",
        help="most runs held (too_many_runs) [default: %(default)s]",
    )
    p.add_argument(
        "--max-runs-per-job",
        type=int,
        default=Limits.max_runs_per_job,
        metavar="N",
        help="most runs of one job: its full run and reruns (too_many_runs) [default: %(default)s]",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=Limits.max_connections,
        metavar="N",
        help="most data connections open at once; more are refused at their handshake "
        "(too_many_connections). Each may hold a message of up to 32 MiB while it "
        "arrives, so N bounds that memory; a direct collector takes one, a relay one for "
        "its node; 0: no cap [default: %(default)s]",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=Limits.max_message_bytes,
        metavar="BYTES",
        help="largest message taken; ZeroMQ resets a connection that sends a larger one "
        "before holding it whole [default: %(default)s]",
    )
    p.add_argument(
        "--rcvhwm",
        type=int,
        default=10_000,
        metavar="N",
        help="whole messages ZeroMQ queues per connection for the hub before pushing back "
        "(senders then drop and count); with --max-connections and --max-message-bytes it "
        "bounds what ZeroMQ holds [default: %(default)s]",
    )
    p.add_argument(
        "--drill",
        action="store_true",
        help="also take drill-down requests on PORT+2 (PATH.drill): relays started with "
        "--raw-ring and --drill ADDR connect to it and answer for their ranks' raw rows "
        "(`rankscope fetch tcp://HUB:PORT+2 --ranks ...`), with the data socket's keys",
    )
    p.add_argument(
        "--no-resume",
        action="store_true",
        help="do not reload an existing recording in DIR into memory at start",
    )
    p.add_argument(
        "--prometheus",
        metavar="[ADDR:]PORT",
        default=None,
        help="also serve Prometheus metrics of the live store (a bare PORT listens on "
        "127.0.0.1; 0.0.0.0:PORT for a scraper on another host)",
    )


def _count(d: dict[str, int]) -> str:
    total = sum(d.values())
    if not total:
        return "0"
    worst = sorted(d.items(), key=lambda kv: -kv[1])[:3]
    return f"{total} (" + ", ".join(f"{k} {v}" for k, v in worst) + ")"


BACKLOG_SHOWN = 8 << 20
"""A recording this far behind the hub (bytes) shows in the status line: the writer
flushes every half second or 8 MiB, so more means the disk is not keeping up."""


def status_line(health: dict[str, Any], store: Store) -> str:
    """One line: runs, ranks, steps, events/s, rejects, drops, connections, messages that
    came through relays (when any did), those refused at the security handshake (when any
    were), and the recording's lag when the disk falls behind."""
    runs = store.runs()
    ranks = sum(r.n_ranks_seen for r in runs)
    world = sum(r.world_size for r in runs)
    last = max((r.last_step for r in runs if r.last_step is not None), default=None)
    t = health.get("transport", {})
    drops = health["drops"]
    line = (
        f"runs {len(runs)} | ranks {ranks}/{world} | last step {'-' if last is None else last}"
        f" | {health['events_per_s'] / 1e6:.2f} M ev/s | messages {health['messages']}"
        f" | rejects {_count(health['rejects'])}"
        f" | drops {drops['batches']} batches/{drops['events']} events"
        f" | connections {t.get('connects', 0) - t.get('disconnects', 0)}"
    )
    if t.get("bundles"):
        line += f" | relayed {t['bundled']} in {t['bundles']} bundles"
    if t.get("refused"):
        line += f" | refused {t['refused']} (keys)"
    if t.get("too_many_connections"):
        line += f" | refused {t['too_many_connections']} (--max-connections)"
    backlog = health.get("record_backlog_bytes", 0)
    if backlog >= BACKLOG_SHOWN:
        line += f" | recording {backlog / (1 << 20):.0f} MiB behind"
    return line


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    security = hub_security_of(args, args.bind)
    try:
        hub = Hub(
            args.bind,
            record_dir=args.record,
            store=Store(
                history_steps=args.history,
                max_cells=args.max_cells,
                floor_cells=args.floor_cells,
                idle_s=args.idle,
                max_instance_rows=args.max_instances,
            ),
            resume=not args.no_resume,
            rcvhwm=args.rcvhwm,
            security=security,
            drill=args.drill,
            limits=Limits(
                time_window_s=args.time_window or None,
                max_world_size=args.max_world,
                max_runs=args.max_runs,
                max_runs_per_job=args.max_runs_per_job,
                max_connections=args.max_connections,
                max_message_bytes=args.max_message_bytes,
            ),
        )
        hub.start()
    except (ValueError, RecordingError, zmq.ZMQError) as exc:
        raise CommandError(str(exc)) from None
    from rankscope.diagnosis.stall import STALL_S
    from rankscope.hub.hang import HangWatch

    if args.stall_s is not None and not args.stall_s > 0:
        hub.stop()
        raise CommandError(f"--stall-s must be > 0, got {args.stall_s}")
    try:
        watch = HangWatch(
            hub.store,
            args.bundles or args.record or ".",
            on_stall=args.on_stall,
            stall_s=args.stall_s or STALL_S,
            recording=args.record,
            flush=hub.recorder.flush if hub.recorder is not None else None,
        ).start()
    except ValueError as exc:  # an --on-stall with unbalanced quotes
        hub.stop()
        raise CommandError(f"--on-stall {args.on_stall!r}: {exc}") from None
    endpoint = None
    if args.prometheus:
        from rankscope.hub.prometheus import (
            PrometheusEndpoint,
            parse_listen,
            store_hangs,
            store_source,
        )

        try:
            addr, port = parse_listen(args.prometheus)
            endpoint = PrometheusEndpoint(
                store_source(hub.store), port, addr, hangs=store_hangs(hub.store, watch)
            )
            print(f"prometheus metrics on http://{addr}:{endpoint.start()}/metrics", flush=True)
        except (ValueError, OSError) as exc:
            watch.stop()
            hub.stop()
            raise CommandError(f"--prometheus {args.prometheus}: {exc}") from None
    where = f", recording to {args.record}" if args.record else ""
    resumed = f" (resumed {hub.resumed_frames} messages)" if hub.resumed_frames else ""
    mode = "CURVE" if security is not None else "plain"
    print(
        f"rankscope hub on {hub.endpoint} (clock {hub.clock_endpoint}, {mode}){where}{resumed}",
        flush=True,
    )
    if hub.drill_endpoint is not None:
        print(f"drill-down requests on {hub.drill_endpoint} (rankscope fetch)", flush=True)
    try:
        status_until_signal(args.status_every, lambda: status_line(hub.health, hub.store))
    finally:
        if endpoint is not None:
            endpoint.close()
        watch.stop()
        hub.stop()
        print("stopped: " + status_line(hub.health, hub.store), flush=True)
    return 0
