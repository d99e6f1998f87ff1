"""``rankscope run``: instrument an unmodified training command (zero-code).

    rankscope run --hub tcp://HUB:5555 --job llm -- torchrun --nproc_per_node=8 train.py

Puts a generated ``sitecustomize.py`` first on ``PYTHONPATH`` (any existing one still
runs), sets the ``RANKSCOPE_*`` environment and replaces itself with the command. Every
rank starts its collector when it initialises its process group.

The collectors use CURVE when they find keys (``--keys DIR``, which sets ``RANKSCOPE_KEYS``
for every rank, else ``$RANKSCOPE_KEYS`` or ``~/.config/rankscope/keys``; see
``rankscope keys``).

``--nccl-inspector PLUGIN.so`` loads NVIDIA's NCCL Inspector in every rank (its
environment, a dump directory per run) and each collector streams its device-timed
collectives (`rankscope.collector.inspector_tail`).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from rankscope.collector import schema
from rankscope.collector.monitor import DDP_BUCKET_MODES, DDP_SAMPLE_EVERY
from rankscope.commands.grammar import add_run
from rankscope.errors import CommandError

HELP = "run a training command with zero-code instrumentation (rankscope run -- torchrun ...)"

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hub",
        default=None,
        help="hub address tcp://HOST:PORT (default: $RANKSCOPE_HUB or tcp://127.0.0.1:5555)",
    )
    parser.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="keys directory holding hub.key and client.key_secret (`rankscope keys`); sets "
        "RANKSCOPE_KEYS (default: $RANKSCOPE_KEYS, else ~/.config/rankscope/keys when there)",
    )
    parser.add_argument("--job", default=None, help="job name (default: the script name)")
    parser.add_argument(
        "--scope", default=None, choices=schema.SCOPES, help="scope of this run (default: full)"
    )
    add_run(parser, "run id shared by all ranks (default: new)")
    parser.add_argument(
        "--parent-run", metavar="ID", default=None, help="run this one is a reduced rerun of"
    )
    parser.add_argument("--topology", default=None, help="topology TOML (racks, NIC/rail per GPU)")
    parser.add_argument(
        "--ddp-buckets",
        default=None,
        choices=DDP_BUCKET_MODES,
        help=(
            "how DDP's gradient all-reduce is timed: auto (default: tail on CPU, every on "
            "GPU), every (each bucket, through a comm hook), sampled (the buckets of one "
            "step in --ddp-sample-every), tail (no hook: one row per backward, from the end "
            "of the rank's backward to its last bucket's completion; CPU), off (not timed)"
        ),
    )
    parser.add_argument(
        "--ddp-sample-every",
        type=int,
        default=None,
        metavar="N",
        help=f"with --ddp-buckets sampled: time the buckets of one step in N ({DDP_SAMPLE_EVERY})",
    )
    parser.add_argument(
        "--nccl-inspector",
        metavar="PLUGIN.so",
        default=None,
        help="load NVIDIA's NCCL Inspector plugin (libnccl-profiler-inspector.so) in every "
        "rank and stream its device-timed collectives (sets NCCL_PROFILER_PLUGIN, "
        "NCCL_INSPECTOR_* with a dump directory per run, and RANKSCOPE_NCCL_INSPECTOR)",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="run this node's relay in this process: the command's ranks send to it over "
        "ipc (no keys on the node) and it forwards to --hub in bundles, with the keys "
        "(`rankscope relay`); the command then runs as a child, not in place of rankscope",
    )
    parser.add_argument(
        "--reduce",
        action="store_true",
        help="with --relay: the relay matches the node's own groups and gathers the node's "
        "messages into one per flush (`rankscope relay --reduce`)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the environment and command instead of running them (writes nothing)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")


def _check(value: str | None, what: str) -> str | None:
    if value is not None and not _LABEL.match(value):
        raise CommandError(f"{what} {value!r} must be 1-128 characters of letters, digits, ._:@+-")
    return value


def _multi_node(command: list[str]) -> bool:
    """True for a torchrun command that spans several nodes (each node runs its own
    ``rankscope run``, so a run id generated here would differ between nodes)."""
    for i, arg in enumerate(command):
        value = None
        if arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
        elif arg == "--nnodes" and i + 1 < len(command):
            value = command[i + 1]
        if value is not None:
            return value.strip() not in ("1", "1:1")
    return False


def _keys_dir(arg: str) -> str:
    """``--keys DIR`` as an absolute path, once the client's keys are known to be there."""
    from rankscope.collector.security import KeyFileError, load_client_curve

    path = os.path.abspath(os.path.expanduser(arg))
    try:
        load_client_curve(Path(path))
    except KeyFileError as exc:
        raise CommandError(f"--keys {arg}: {exc} (make keys with `rankscope keys`)") from None
    return path


def build_env(args: argparse.Namespace, base: dict[str, str], site_dir: str) -> dict[str, str]:
    """The environment the command runs in.

    Args:
        args: parsed arguments.
        base: the current environment.
        site_dir: directory holding the bootstrap ``sitecustomize.py``.

    Returns:
        A new environment map.
    """
    from rankscope.collector.clock import clock_endpoint
    from rankscope.collector.runtime import DEFAULT_HUB, new_run_id
    from rankscope.collector.sender import check_endpoint

    env = dict(base)
    hub = args.hub or env.get("RANKSCOPE_HUB") or DEFAULT_HUB
    try:
        clock_endpoint(check_endpoint(hub))
    except ValueError as exc:
        raise CommandError(f"--hub: {exc}") from None
    env["RANKSCOPE_HUB"] = hub
    if args.keys:
        env["RANKSCOPE_KEYS"] = _keys_dir(args.keys)
    job = _check(args.job, "--job")
    if job:
        env["RANKSCOPE_JOB"] = job
    if args.scope:
        env["RANKSCOPE_SCOPE"] = args.scope
    if _check(args.parent_run, "--parent-run"):
        env["RANKSCOPE_PARENT_RUN"] = args.parent_run
    run = _check(args.run, "--run")
    if run is None and not _multi_node(args.command) and not env.get("RANKSCOPE_RUN"):
        # One launcher on one node: name the run here, so it survives elastic restarts.
        script = next((a for a in args.command if a.endswith(".py")), "job")
        run = new_run_id(job or os.path.splitext(os.path.basename(script))[0] or "job")
    if run:
        env["RANKSCOPE_RUN"] = run
    if args.topology:
        path = os.path.abspath(args.topology)
        if not os.path.isfile(path):
            raise CommandError(f"--topology {args.topology!r} is not a file")
        env["RANKSCOPE_TOPOLOGY"] = path
    if args.ddp_buckets:
        env["RANKSCOPE_DDP_BUCKETS"] = args.ddp_buckets
    if args.ddp_sample_every is not None:
        if args.ddp_sample_every < 1:
            raise CommandError(f"--ddp-sample-every must be >= 1, got {args.ddp_sample_every}")
        env["RANKSCOPE_DDP_SAMPLE_EVERY"] = str(args.ddp_sample_every)
    if args.nccl_inspector:
        from rankscope.collector import inspector_tail

        try:
            plugin = inspector_tail.check_plugin(args.nccl_inspector)
        except ValueError as exc:
            raise CommandError(f"--nccl-inspector: {exc}") from None
        dump_dir = env.get("NCCL_INSPECTOR_DUMP_DIR") or inspector_tail.default_dump_dir(run)
        env.update(inspector_tail.plugin_env(plugin, dump_dir))
    env["RANKSCOPE_ZERO_CODE"] = "1"
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = site_dir + (os.pathsep + old if old else "")
    return env


def run(args: argparse.Namespace) -> int:
    from rankscope.collector.autostart import prepare_site_dir, site_dir_path

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    if not command:
        raise CommandError("run: no command given (rankscope run [options] -- COMMAND ...)")
    exe = shutil.which(command[0])
    if args.reduce and not args.relay:
        raise CommandError("run: --reduce needs --relay (it is what the node's relay does)")
    if args.dry_run:
        # The bootstrap directory is named, not written: a dry run leaves no file behind.
        env = build_env(args, dict(os.environ), site_dir_path())
        for key in sorted(env):
            if key.startswith(("RANKSCOPE_", "NCCL_PROFILER_", "NCCL_INSPECTOR_")) or (
                key == "PYTHONPATH"
            ):
                print(f"{key}={env[key]}")
        if args.relay:
            what = " (reducing)" if args.reduce else ""
            print(f"relay{what}: {_relay_listen()} -> {env['RANKSCOPE_HUB']}")
        print(shlex.join(command))
        if exe is None:
            print(f"rankscope: warning: command not found here: {command[0]!r}", file=sys.stderr)
        return 0
    if exe is None:
        print(f"rankscope: error: command not found: {command[0]!r}", file=sys.stderr)
        return 127  # the shell's status for a command that is not there
    env = build_env(args, dict(os.environ), prepare_site_dir())
    if args.nccl_inspector:
        # The plugin creates one directory level only; make the per-run one here.
        os.makedirs(env["NCCL_INSPECTOR_DUMP_DIR"], exist_ok=True)
    if args.relay:
        return _run_relayed(exe, command, env, reduce=args.reduce)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, env)
    return 0  # not reached


def _relay_listen() -> str:
    """This node's relay address for one ``rankscope run --relay``: a socket of its own."""
    from rankscope.commands.relay import default_listen

    return default_listen(str(os.getpid()))


def _run_relayed(exe: str, command: list[str], env: dict[str, str], reduce: bool = False) -> int:
    """Run ``command`` as a child whose ranks send to a relay in this process; the relay
    forwards to the hub ``env`` names. Ctrl-C and SIGTERM go to the child; when it exits
    the relay forwards what is left (briefly) and its summary goes to stderr."""
    import signal
    import subprocess

    from rankscope.collector.security import client_curve_from_env
    from rankscope.hub.relay import Relay, RelayError, status_line

    upstream = env["RANKSCOPE_HUB"]
    try:
        relay = Relay(
            _relay_listen(), upstream, curve=client_curve_from_env(env), reduce=reduce
        ).start()
    except RelayError as exc:
        raise CommandError(f"--relay: {exc}") from None
    child_env = dict(env)
    child_env["RANKSCOPE_HUB"] = relay.endpoint
    # On the node the ranks speak plain ZeroMQ to the relay (its socket is this user's).
    child_env["RANKSCOPE_KEYS"] = "off"
    child_env.pop("RANKSCOPE_CLIENT_KEY", None)
    print(f"rankscope: relay on {relay.endpoint} -> {upstream}", file=sys.stderr, flush=True)
    try:
        child = subprocess.Popen([exe, *command[1:]], env=child_env)
    except OSError as exc:
        relay.stop(drain_s=0)
        raise CommandError(f"cannot run {command[0]!r}: {exc}") from None

    def forward(sig: int, _frame: object) -> None:
        child.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        relay.stop()
        print(
            f"rankscope: relay: {status_line(relay.counters, relay.reducer and relay.reducer.counters)}",
            file=sys.stderr,
            flush=True,
        )
    return code if code >= 0 else 128 - code
