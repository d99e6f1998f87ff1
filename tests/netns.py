"""Two "nodes" on one machine: network namespaces joined by veth pairs.

Layout (addresses exist only inside the two namespaces this module creates; the root
namespace and its interfaces are never touched)::

    namespace A                                   namespace B
    ┌────────────────────────┐   data link    ┌────────────────────────┐
    │ <data_if[0]> 10.77.0.1 ├────────────────┤ <data_if[1]> 10.77.0.2 │  gloo traffic
    │ <mgmt_if[0]> 10.77.1.1 ├────────────────┤ <mgmt_if[1]> 10.77.1.2 │  hub, rendezvous
    │ hub (binds 10.77.1.1)  │   mgmt link    │                        │
    └────────────────────────┘                └────────────────────────┘

The data link carries the training collectives (``GLOO_SOCKET_IFNAME`` names it) and is
the one rate-limited with ``tc ... tbf``; the management link carries the rendezvous store
and rankscope's own traffic, so a degraded data link does not also delay the monitor, as on
a cluster whose management network is separate from its training fabric. The hub runs inside
namespace A, bound to A's management address, and writes its recording to a directory that
the test reads from the root namespace (namespaces share the filesystem).

Each namespace has its own network stack, so the same 10.77.x.x addresses and ports can be
used by concurrent test runs without clashing; only interface and namespace names need to be
unique, and they are derived from the process id and a counter.

Two ranks in one namespace talk over that namespace's local route (never through the veth),
so intra-node collectives are not shaped, only cross-node ones.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

DATA_NET = "10.77.0"
MGMT_NET = "10.77.1"
_counter = itertools.count()
_support: str | None = None
_checked = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


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
                nodes.limit("100mbit")
            except subprocess.CalledProcessError as exc:
                _support = f"tc tbf is not available: {exc.stderr.strip()}"
            finally:
                nodes.destroy()
    return _support


@dataclass(frozen=True)
class TwoNodes:
    """Two namespaces joined by a data link and a management link.

    Attributes:
        ns: namespace names (A, B).
        data_if: data-link interface names, one in each namespace.
        mgmt_if: management-link interface names.
        hosts: host names the ranks of each namespace report (``RANKSCOPE_HOST``).
    """

    ns: tuple[str, str]
    data_if: tuple[str, str]
    mgmt_if: tuple[str, str]
    hosts: tuple[str, str]

    def data_ip(self, node: int) -> str:
        return f"{DATA_NET}.{node + 1}"

    def mgmt_ip(self, node: int) -> str:
        return f"{MGMT_NET}.{node + 1}"

    def prefix(self, node: int) -> list[str]:
        """The argv prefix that runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns[node]]

    def env(self, node: int) -> dict[str, str]:
        """Environment for a training process on ``node``: gloo on the data link, and the
        host/NIC names rankscope reports."""
        return {
            "GLOO_SOCKET_IFNAME": self.data_if[node],
            "RANKSCOPE_HOST": self.hosts[node],
            "RANKSCOPE_NIC": self.data_if[node],
        }

    def popen(
        self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw
    ) -> subprocess.Popen:
        """Start ``argv`` inside node ``node`` (its own process group, so teardown can stop
        it and its children)."""
        full_env = dict(os.environ)
        full_env.update(self.env(node))
        full_env.update(env or {})
        return subprocess.Popen(
            [*self.prefix(node), *argv], env=full_env, start_new_session=True, **kw
        )

    def limit(self, rate: str, burst: str = "32kb", latency: str = "100ms") -> None:
        """Rate-limit the data link in both directions with a token bucket.

        Args:
            rate: e.g. ``"40mbit"``.
            burst: bucket size.
            latency: how long a packet may wait in the bucket before it is dropped.
        """
        for node in (0, 1):
            _ip(
                "netns",
                "exec",
                self.ns[node],
                "tc",
                "qdisc",
                "replace",
                "dev",
                self.data_if[node],
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            )

    def unlimit(self) -> None:
        """Remove the rate limit from the data link."""
        for node in (0, 1):
            _ip(
                "netns",
                "exec",
                self.ns[node],
                "tc",
                "qdisc",
                "del",
                "dev",
                self.data_if[node],
                "root",
                check=False,
            )

    def qdisc(self, node: int) -> str:
        """``tc qdisc show`` for node's data interface (to check the limit is in place)."""
        out = _ip("netns", "exec", self.ns[node], "tc", "qdisc", "show", "dev", self.data_if[node])
        return out.stdout

    def pids(self) -> list[int]:
        """Processes running in either namespace (all started by this harness)."""
        found: list[int] = []
        for ns in self.ns:
            out = _ip("netns", "pids", ns, check=False)
            found += [int(p) for p in out.stdout.split() if p.isdigit()]
        return found

    def destroy(self) -> None:
        """Stop what runs inside, then delete both namespaces (and with them the veths)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        for ns in self.ns:
            _ip("netns", "del", ns, check=False)


def create(tag: str | None = None) -> TwoNodes:
    """Create two namespaces joined by a data and a management veth pair.

    Args:
        tag: unique suffix (default: process id and a counter); interface names stay within
            Linux's 15 characters.

    Returns:
        The nodes; call `TwoNodes.destroy` when done (the `two_nodes` fixture does).
    """
    tag = tag or f"{os.getpid() % 100000}{next(_counter)}"
    nodes = TwoNodes(
        ns=(f"rsA{tag}", f"rsB{tag}"),
        data_if=(f"rsd{tag}a", f"rsd{tag}b"),
        mgmt_if=(f"rsm{tag}a", f"rsm{tag}b"),
        hosts=("node-a", "node-b"),
    )
    try:
        for ns in nodes.ns:
            _ip("netns", "add", ns)
        for ifs, net in ((nodes.data_if, DATA_NET), (nodes.mgmt_if, MGMT_NET)):
            # Both ends are created directly inside their namespaces: nothing ever
            # appears in the root namespace.
            _ip(
                "link",
                "add",
                ifs[0],
                "netns",
                nodes.ns[0],
                "type",
                "veth",
                "peer",
                "name",
                ifs[1],
                "netns",
                nodes.ns[1],
            )
            for node in (0, 1):
                _ip("-n", nodes.ns[node], "addr", "add", f"{net}.{node + 1}/24", "dev", ifs[node])
                _ip("-n", nodes.ns[node], "link", "set", ifs[node], "up")
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
