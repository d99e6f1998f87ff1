"""Two "nodes" on one machine: network namespaces joined by veth pairs.

Layout (addresses exist only inside the two namespaces this module creates; the root
namespace and its interfaces are never touched)::

    namespace A (host "<ns A>")                    namespace B (host "<ns B>")
    ┌─────────────────────────┐    rail 0     ┌─────────────────────────┐
    │ rail0    10.77.0.1      ├───────────────┤ rail0    10.77.0.2      │  local rank 0
    │ rail1    10.77.1.1      ├───────────────┤ rail1    10.77.1.2      │  local rank 1
    │ mgmt0    10.77.100.1    ├───────────────┤ mgmt0    10.77.100.2    │  hub, rendezvous
    │ hub (binds 10.77.100.1) │   management  │                         │
    └─────────────────────────┘               └─────────────────────────┘

A rail-optimised fabric in miniature: local rank i of every node binds its collectives to
``rail<i>`` (``GLOO_SOCKET_IFNAME``, set per local rank by the example's
``--rail-ifnames``), so a cross-node group of same-local-rank peers travels on one rail. A
rail is degraded with a ``tc ... tbf`` token bucket on both of its ends (netem is not
available on every kernel; tbf is). The management link carries the rendezvous store and
rankscope's own traffic, so a degraded rail does not also delay the monitor, as on a
cluster whose management network is separate from its training fabric.

The hub runs inside namespace A, bound to A's management address, and records to a
directory that the test reads from the root namespace (namespaces share the filesystem).
Interface names and addresses are the same in every pair of namespaces — each namespace
has its own network stack — so concurrent runs never clash; namespace names are unique
(process id and a counter) and double as the host names the ranks report, so a launcher
can reach a "host" with ``ip netns exec <host>``.

Two ranks in one namespace talk over that namespace's local route, never through a veth:
intra-node collectives are not shaped, only cross-node ones.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RAILS = 2
MGMT = "mgmt0"
HUB_PORT = 5555
_counter = itertools.count()
_support: str | None = None
_checked = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def rail_ifname(rail: int) -> str:
    return f"rail{rail}"


def rail_ip(rail: int, node: int) -> str:
    return f"10.77.{rail}.{node + 1}"


def mgmt_ip(node: int) -> str:
    return f"10.77.100.{node + 1}"


def unsupported() -> str | None:
    """Why namespaces cannot be used here, or None when they can (checked once).

    Returns:
        A reason naming the missing piece (not root, no ``ip``/``tc``, namespace or veth
        creation refused, ``tbf`` qdisc unavailable), or None.
    """
    global _support, _checked
    if _checked:
        return _support
    _checked = True
    if os.name != "posix" or os.geteuid() != 0:
        _support = "network namespaces need root"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _support = "iproute2 (ip, tc) is not installed"
    else:
        try:
            nodes = create()
        except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
            err = getattr(exc, "stderr", "") or str(exc)
            _support = f"cannot create network namespaces and veth pairs: {err.strip()}"
        else:
            try:
                nodes.limit(0, "100mbit")
            except subprocess.CalledProcessError as exc:
                _support = f"tc tbf is not available: {exc.stderr.strip()}"
            finally:
                nodes.destroy()
    return _support


@dataclass(frozen=True)
class TwoNodes:
    """Two namespaces joined by ``RAILS`` rail links and a management link.

    Attributes:
        ns: namespace names, which are also the host names the ranks report.
    """

    ns: tuple[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list, compare=False, repr=False)
    """Everything started through `popen`, stopped by `destroy` even if it never got as
    far as entering its namespace."""

    @property
    def hosts(self) -> tuple[str, str]:
        return self.ns

    @property
    def hub_endpoint(self) -> str:
        """Where ranks on either node reach the hub (inside namespace A)."""
        return f"tcp://{mgmt_ip(0)}:{HUB_PORT}"

    @property
    def rdzv_endpoint(self) -> str:
        return f"{mgmt_ip(0)}:29500"

    def mgmt_ip(self, node: int) -> str:
        """Node's address on the management link."""
        return mgmt_ip(node)

    def prefix(self, node: int) -> list[str]:
        """The argv prefix that runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns[node]]

    def env(self, node: int) -> dict[str, str]:
        """Environment for processes on ``node``: the host name rankscope reports."""
        return {"RANKSCOPE_HOST": self.ns[node]}

    def popen(
        self,
        node: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kw,
    ) -> subprocess.Popen:
        """Start ``argv`` inside node ``node`` (own session, so it can be stopped whole)."""
        full_env = dict(os.environ)
        full_env.update(self.env(node))
        full_env.update(env or {})
        proc = subprocess.Popen(
            [*self.prefix(node), *argv], env=full_env, start_new_session=True, **kw
        )
        self.procs.append(proc)
        return proc

    def start_hub(self, record_dir: str | os.PathLike[str], log: Path) -> subprocess.Popen:
        """Run a rankscope hub inside namespace A, recording to ``record_dir``.

        Returns once the hub answers on its port (or raises with its log).
        """
        code = (
            "import signal, sys, threading\n"
            "from rankscope.hub.server import Hub\n"
            "stop = threading.Event()\n"
            "signal.signal(signal.SIGTERM, lambda *a: stop.set())\n"
            "with Hub(sys.argv[1], sys.argv[2]):\n"
            "    print('ready', flush=True)\n"
            "    stop.wait()\n"
        )
        out = open(log, "w")  # noqa: SIM115 (the hub writes to it until it is stopped)
        proc = self.popen(
            0,
            [sys.executable, "-c", code, self.hub_endpoint, str(record_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if "ready" in log.read_text():
                return proc
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the hub in {self.ns[0]} did not start:\n{log.read_text()[-2000:]}")

    def topology(self, path: Path) -> Path:
        """Write the topology file that maps local rank i to NIC ``rail<i>``, rail i."""
        lines = ["version = 1", "", "[gpus]"]
        lines += [f'"{r}" = {{ nic = "{rail_ifname(r)}", rail = {r} }}' for r in range(RAILS)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def limit(self, rail: int, rate: str, burst: str = "32kb", latency: str = "200ms") -> None:
        """Rate-limit one rail in both directions with a token bucket.

        Args:
            rail: which rail.
            rate: e.g. ``"40mbit"``.
            burst: bucket size.
            latency: how long a packet may wait in the bucket before it is dropped.
        """
        for ns in self.ns:
            _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", rail_ifname(rail),
                "root", "tbf", "rate", rate, "burst", burst, "latency", latency)  # fmt: skip

    def qdisc(self, node: int, rail: int) -> str:
        """``tc qdisc show`` of a rail on one node (to check what is in place)."""
        out = _ip("netns", "exec", self.ns[node], "tc", "qdisc", "show", "dev", rail_ifname(rail))
        return out.stdout

    def pids(self) -> list[int]:
        """Processes running in either namespace (all started through this harness)."""
        found: list[int] = []
        for ns in self.ns:
            out = _ip("netns", "pids", ns, check=False)
            found += [int(p) for p in out.stdout.split() if p.isdigit()]
        return found

    def _running(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def destroy(self) -> None:
        """Stop what runs inside, then delete both namespaces (and with them the veths).

        Each process started through `popen` leads its own session, so its whole group
        (torchrun's workers included) is signalled; anything else still inside the
        namespaces was started from those and is signalled by pid.
        """
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self._running():
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while (self.pids() or self._running()) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.pids() and not self._running():
                break
        for ns in self.ns:
            _ip("netns", "del", ns, check=False)


def create(tag: str | None = None) -> TwoNodes:
    """Create two namespaces joined by the rail and management veth pairs.

    Args:
        tag: unique suffix (default: process id and a counter).

    Returns:
        The nodes; call `TwoNodes.destroy` when done (the `two_nodes` fixture does).
    """
    tag = tag or f"{os.getpid()}-{next(_counter)}"
    nodes = TwoNodes(ns=(f"rsnode-a-{tag}", f"rsnode-b-{tag}"))
    links = [(rail_ifname(r), rail_ip(r, 0), rail_ip(r, 1)) for r in range(RAILS)]
    links.append((MGMT, mgmt_ip(0), mgmt_ip(1)))
    a, b = nodes.ns
    try:
        for ns in nodes.ns:
            _ip("netns", "add", ns)
        for ifname, ip_a, ip_b in links:
            # Both ends are created directly inside their namespaces, under the same name:
            # nothing ever appears in the root namespace.
            _ip("link", "add", ifname, "netns", a, "type", "veth", "peer", "name", ifname,
                "netns", b)  # fmt: skip
            for ns, addr in ((a, ip_a), (b, ip_b)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
        for ns in nodes.ns:
            _ip("-n", ns, "link", "set", "lo", "up")
    except BaseException:
        nodes.destroy()
        raise
    return nodes


@pytest.fixture
def two_nodes() -> Iterator[TwoNodes]:
    """Two fresh namespaces for one test, always torn down; skips with the reason when
    namespaces cannot be created here."""
    reason = unsupported()
    if reason:
        pytest.skip(reason)
    nodes = create()
    try:
        yield nodes
    finally:
        nodes.destroy()
