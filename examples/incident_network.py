"""The degraded-network incident: two "nodes", one rail rate-limited, and a one-node rerun.

The nodes are network namespaces set up by ``tests/netns.py`` (``TwoNodes``); this module
only needs what that object offers: ``popen(node, argv, env)``, ``hosts``, ``hub_endpoint``,
``rdzv_endpoint``, ``mgmt_ip(node)``, ``limit(rail, rate)``, ``topology(path)`` and
``start_hub(record, log)``. The tests and ``benchmarks/bench_real.py`` share it.

The job runs with hierarchical gradient averaging (``--grad-sync hier``): a sum inside each
node, then across nodes between same-local-rank peers, each local rank on its own rail. The
fault is a token-bucket limit on one rail, so one cross-node group slows down and nothing
else does. The one-node rerun is rendered from the stock ``torchrun`` launcher template and
run on the plan's host through ``ip netns exec`` (the namespaces' stand-in for ssh).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import incidents

DEGRADED_RAIL = 1
RATE = "24mbit"
FLAGS = (
    "--grad-sync=hier",
    "--rail-ifnames=rail0,rail1",
    "--tokens-per-rank=1024",
    "--len-max=256",
    "--len-sigma=0.6",
)
"""Narrow sequence lengths (little data skew) and one gradient bucket per step: compute
large enough that scheduler noise on two shared cores stays small beside it."""


@dataclass(frozen=True)
class NetworkIncident:
    """The windows and analyses of the degraded-rail incident."""

    hosts: tuple[str, ...]
    baseline: Any
    """`Window` of the two-node run on a healthy fabric."""
    fault: Any
    """`Window` of the same run with one rail rate-limited."""
    diagnosis: Any
    """Diagnosis of ``fault`` against ``baseline``."""
    launch: Any
    """The one-node rerun's `rankscope.launch.runner.Launch` (plan and commands)."""
    rerun: Any
    """`Window` of the one-node rerun."""
    record: Path


def run_two_node(
    nodes: Any, spec: incidents.RunSpec, topology: Path, logs: Path, timeout: float = 240.0
) -> None:
    """One torchrun agent per namespace, c10d rendezvous over the management link.

    Raises:
        incidents.WorkloadError: an agent exited non-zero (with its log's tail) or timed out.
    """
    procs = []
    for node in (0, 1):
        env = incidents.rankscope_env(nodes.hub_endpoint, spec)
        env["RANKSCOPE_TOPOLOGY"] = str(topology)
        argv = incidents.torchrun_argv(
            spec,
            nnodes=2,
            rdzv_endpoint=nodes.rdzv_endpoint,
            is_host=node == 0,
            local_addr=nodes.mgmt_ip(node),
        )
        log = logs / f"{spec.run}.node{node}.log"
        with open(log, "w") as out:
            procs.append((nodes.popen(node, argv, env, stdout=out, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for p, log in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise incidents.WorkloadError(f"{spec.run}: {log.name} still running") from None
        if rc != 0:
            raise incidents.WorkloadError(
                f"{spec.run} on {log.name} exited {rc}:\n{log.read_text()[-3000:]}"
            )


def windows(record: Path, specs: Sequence[incidents.RunSpec], timeout: float = 20.0):
    """Replay the hub's recording until every run is complete (it flushes every ~0.5 s).

    Returns:
        Run id -> `Window` (warm-up left out).
    """
    from rankscope.hub.replay import load

    deadline = time.monotonic() + timeout
    while True:
        store = load(record)
        try:
            return {s.run: incidents.settled_window(store, s, timeout=0.0) for s in specs}
        except incidents.WorkloadError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def reproduce(
    nodes: Any, workdir: Path, *, steps: int = incidents.STEPS, record: Path | None = None
) -> NetworkIncident:
    """Baseline, degraded rail, diagnosis, and the one-node rerun.

    Args:
        nodes: the two namespaces (``tests/netns.TwoNodes``), freshly created.
        workdir: where the topology file and logs go (and the recording by default).
        steps: steps per run.
        record: the hub's recording directory (default ``workdir/record``).

    Returns:
        The incident's windows and analyses.
    """
    from rankscope.diagnosis.engine import diagnose
    from rankscope.launch.plan import propose
    from rankscope.launch.runner import LaunchSettings, prepare
    from rankscope.launch.templates import find_launcher

    workdir.mkdir(parents=True, exist_ok=True)
    record = record if record is not None else workdir / "record"
    topology = nodes.topology(workdir / "topology.toml")
    nodes.start_hub(record, workdir / "hub.log")
    base = incidents.RunSpec("net-baseline", FLAGS, nproc=2, steps=steps)
    fault = incidents.RunSpec("net-fault", FLAGS, nproc=2, steps=steps)
    run_two_node(nodes, base, topology, workdir)
    nodes.limit(DEGRADED_RAIL, RATE)
    run_two_node(nodes, fault, topology, workdir)
    got = windows(record, [base, fault])
    w_base, w_fault = got[base.run], got[fault.run]
    d = diagnose(w_fault, w_base)

    plan = propose(w_fault, d.verdict.hypotheses, "one-node")
    launch = prepare(
        plan,
        find_launcher("torchrun"),
        LaunchSettings(hub=nodes.hub_endpoint, master_port=29601),
        record=record,
        manifest=w_fault.manifest,
        local=plan.hosts,
    )
    log = workdir / f"{launch.plan.run}.log"
    with open(log, "w") as out:
        for cmd in launch.commands:
            env = dict(cmd.env, RANKSCOPE_TOPOLOGY=str(topology))
            p = nodes.popen(
                nodes.hosts.index(cmd.host),
                list(cmd.argv),
                env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            if p.wait(timeout=240) != 0:
                raise incidents.WorkloadError(f"one-node rerun failed:\n{log.read_text()[-3000:]}")
    rerun = incidents.RunSpec(launch.plan.run, FLAGS, nproc=2, steps=steps)
    w_rerun = windows(record, [rerun])[rerun.run]
    return NetworkIncident(
        hosts=tuple(nodes.hosts),
        baseline=w_base,
        fault=w_fault,
        diagnosis=d,
        launch=launch,
        rerun=w_rerun,
        record=record,
    )


def transfer_by_group(window: Any) -> dict[tuple[int, ...], float]:
    """Median post-arrival transfer (ns) of each group's complete instances, by its ranks."""
    import numpy as np

    inst = window.instances
    ok = (inst.n_arrived >= inst.n_members) & (inst.n_members >= 2)
    out = {}
    for gid, g in window.groups.items():
        sel = ok & (inst.group == gid)
        if sel.any():
            out[tuple(g.ranks)] = float(np.median(inst.transfer[sel]))
    return out
