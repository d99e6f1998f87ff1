"""A pairwise sweep on gloo across two "nodes" finds the rate-limited rail.

The nodes are the network namespaces of ``tests/netns.py``: two ranks per node, local rank
i bound to ``rail<i>``, rail 1 rate-limited with ``tc tbf`` on both of its ends. The
parent is a short two-node run of the network incident's workload
(``examples/incident_network.py``) recorded by a hub inside namespace A; then
``rankscope sweep PATH --scope pairwise --yes`` launches its worker on both nodes through a
launcher template that enters each host's namespace (``ip netns exec``, the namespaces'
stand-in for ssh), and its JSON must name rail 1 and a link on it, and no link of rail 0.
Needs root, iproute2 and torch; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from netns import two_nodes  # noqa: E402

__all__ = ["two_nodes"]  # the fixture, imported for pytest

# One parent run across the namespaces and one sweep of six links at two sizes; the limit
# only catches a hang.
pytestmark = [pytest.mark.netns, pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]

SLOW_RAIL = 1
RATE = "200mbit"
"""25 MB/s: a 4 MiB all_reduce between two ranks moves 4 MiB each way, ~0.17 s on the
limited rail, against milliseconds on an unshaped veth."""
BURST = "64kb"
PARENT_STEPS = 10
SWEEP_PORT = 29611

TEMPLATE = """\
description = "torchrun inside each host's network namespace (the test's two nodes)"
per_host = true
command = [
  "{{python}}", "-m", "rankscope", "run", "--",
  "torchrun",
  "--nnodes={{nnodes}}",
  "--nproc-per-node={{nproc_per_node}}",
  "--node-rank={{node_rank}}",
  "--master-addr={master}",
  "--master-port={{master_port}}",
  "{{script}}", "{{script_args}}",
]
argv = ["{{command}}"]
# The host names are namespace names: "reaching" a host is entering its namespace.
remote_argv = ["ip", "netns", "exec", "{{host}}", "sh", "-c", "{{command_shell}}"]

[env]
RANKSCOPE_HUB = "{{hub}}"
RANKSCOPE_JOB = "{{job}}"
RANKSCOPE_RUN = "{{run}}"
RANKSCOPE_PARENT_RUN = "{{parent_run}}"
RANKSCOPE_SCOPE = "{{scope}}"
RANKSCOPE_HOST = "{{host}}"
"""
"""The shipped torchrun template, except that a host is entered with ``ip netns exec``
and the rendezvous address is node A's management address (a namespace's name does not
resolve)."""


def test_pairwise_sweep_across_namespaces_finds_the_limited_rail(
    two_nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    pytest.importorskip("torch")
    import incident_network
    import incidents

    from rankscope.cli import main
    from rankscope.launch.sweep import load_result, pair_points

    nodes = two_nodes
    record = tmp_path / "record"
    topology = nodes.topology(tmp_path / "topology.toml")
    nodes.start_hub(record, tmp_path / "hub.log")
    nodes.limit(SLOW_RAIL, RATE, burst=BURST)
    assert "tbf" in nodes.qdisc(0, SLOW_RAIL) and "tbf" not in nodes.qdisc(0, 0)
    parent = incidents.RunSpec(
        "net-sweep-parent", incident_network.FLAGS, nproc=2, steps=PARENT_STEPS
    )
    incident_network.run_two_node(nodes, parent, topology, tmp_path)
    window = incident_network.windows(record, [parent])[parent.run]
    assert window.world_size == 4 and list(window.ranks.rail) == [0, 1, 0, 1]

    launchers = tmp_path / "launchers"
    launchers.mkdir()
    (launchers / "netns.toml").write_text(TEMPLATE.format(master=nodes.mgmt_ip(0)))
    # Without a baseline two rails are too few for the verdict to single one out (it
    # names a rank), so the sweep is pointed at the job's world group: every link of it.
    (world,) = [g.name for g in window.groups.values() if len(g.ranks) == window.world_size]
    argv = ["sweep", str(record), "--scope", "pairwise", "--run", parent.run, "--group", world]
    argv += ["--launcher", "netns", "--launchers", str(launchers), "--backend=gloo"]
    argv += ["--hub", nodes.hub_endpoint, "--master-port", str(SWEEP_PORT)]
    argv += ["--sizes", "1M", "4M", "--warmup", "1", "--iters", "3"]
    code = main([*argv, "--yes", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    res = json.loads(out)
    pw, found = res["pairwise"], res["found"]
    points = pair_points(load_result(res["result"]), window)
    with capsys.disabled():
        print(f"\npairwise sweep across namespaces, {RATE} tbf on rail {SLOW_RAIL} (busbw GB/s):")
        for p in sorted(points, key=lambda p: (p.pair, p.nbytes)):
            where = f"rail {p.rails[0]}" if p.rails[0] == p.rails[1] else "mixed rails"
            where += ", cross-node" if p.crosses_hosts else ", inside a node"
            print(
                f"  link {p.pair[0]}-{p.pair[1]} ({where}) {p.nbytes >> 20} MiB: {p.busbw_gbps:.4g}"
            )
        print(f"  per rail at 4 MiB: {pw['rail_busbw_gbps']}")
    ranks = window.ranks
    on_rail = {
        r: {
            f"{a}-{b}"
            for a in range(4)
            for b in range(a + 1, 4)
            if ranks.host[a] != ranks.host[b] and ranks.rail[a] == ranks.rail[b] == r
        }
        for r in (0, 1)
    }
    assert on_rail == {0: {"0-2"}, 1: {"1-3"}}
    # Every link of the four ranks was timed, inside and across the nodes.
    assert set(pw["pair_busbw_gbps"]) == {f"{a}-{b}" for a in range(4) for b in range(a + 1, 4)}
    assert found["finding"] == "network_rail" and found["rail"] == SLOW_RAIL, res["conclusion"]
    assert found["pair"] is not None and f"{found['pair'][0]}-{found['pair'][1]}" in on_rail[1]
    slow = {f"{a}-{b}" for a, b in found["slow_pairs"]}
    assert not slow & on_rail[0], found
    assert pw["rail_busbw_gbps"]["1"] < 0.5 * pw["rail_busbw_gbps"]["0"], pw
    # The sweep reached the hub inside namespace A as a run of its own, one complete step
    # (all four ranks) per link and size, though only the link's two ranks work in it.
    rows = len(pw["pair_busbw_gbps"]) * 2
    child = _wait_run(record, res["run"], rows)
    assert child.scope == "sweep" and child.parent_run == parent.run, child
    assert child.n_ranks_seen == 4 and child.steps_complete == rows, child


def _wait_run(record: Path, run: str, steps: int, timeout: float = 30.0):
    from rankscope.hub.replay import load

    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in load(record).runs() if r.run == run]
        if found and found[0].steps_complete >= steps:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no run {run!r} with {steps} complete steps: {found}")
        time.sleep(0.5)
