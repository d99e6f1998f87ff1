"""Ports for tests that must name a port before anything binds it.

Where a server can bind port 0 and report the port it got (the hub does), tests do that:
nothing can take the port between the choice and the bind. The rest (a rendezvous both
torchrun agents are told, a hub restarted on the port of the one before, a launcher's
``--master-port``) need a port chosen in advance; `free_port_pair` picks one outside the
kernel's ephemeral range, where no connection's local end and no bind to port 0 can land
on it between the probe and the bind.
"""

from __future__ import annotations

import random
import socket


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for local ports of connections and binds to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback (hub data and clock), outside the
    ephemeral range: a collector reconnecting to a port in that range may also be handed
    the same port as its own local end (a TCP self-connection), and a hub restarted there
    could not bind it."""
    lo, hi = ephemeral_range()
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(20000, lo - 2) if lo > 20002 else rng.randrange(hi + 1, 65533)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")
