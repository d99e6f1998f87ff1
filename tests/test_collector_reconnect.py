"""A hub that restarts without its recording knows nothing of the ranks; the collector
must notice the reconnect and say hello (and its groups) again at once, and hold what it
recorded while the hub was away so that it is not sent ahead of that hello."""

from __future__ import annotations

import random
import socket
import time

import numpy as np
import zmq

from rankscope.collector.identity import Identity
from rankscope.collector.monitor import Monitor
from rankscope.hub.server import Hub


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _free_port_pair() -> int:
    """A free port P (and P + 1) outside the ephemeral range: a client reconnecting to a
    port in that range may be handed the very same port as its own local end (a TCP
    self-connection), which would keep the restarted hub from binding it."""
    lo, hi = _ephemeral_range()
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


def _hub_on(port: int) -> Hub:
    # A port just released by a stopped hub may take the kernel a moment to free.
    for _ in range(50):
        try:
            return Hub(bind=f"tcp://127.0.0.1:{port}", record_dir=None).start()
        except zmq.ZMQError:
            time.sleep(0.1)
    return Hub(bind=f"tcp://127.0.0.1:{port}", record_dir=None).start()


def _wait_for(pred, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _steps(mons: list[Monitor], first: int, last: int) -> None:
    for step in range(first, last + 1):
        for mon in mons:
            with mon.step(step):
                t = time.monotonic_ns()
                mon.record_collective("all_reduce", 0, nbytes=64, t_enter=t, t_exit=t + 1000)
        time.sleep(0.01)


def _complete_steps(hub: Hub, run: str) -> set[int]:
    if run not in hub.store.run_ids():
        return set()
    w = hub.store.window(run)
    return set(w.steps[w.present.all(axis=0)].tolist())


def test_fresh_hub_on_the_same_port_accepts_data_after_a_prompt_hello() -> None:
    port = _free_port_pair()
    endpoint = f"tcp://127.0.0.1:{port}"
    hub = Hub(bind=endpoint, record_dir=None).start()
    mons = [
        Monitor(
            job="j",
            run="reconnect",
            identity=Identity(rank=r, world_size=2, local_rank=r, host="h", node_rank=0, pid=r),
            hub=endpoint,
            sample_interval_s=0,
            flush_interval_s=0.05,
        ).start()
        for r in range(2)
    ]
    try:
        _steps(mons, 0, 9)
        assert _wait_for(lambda: _complete_steps(hub, "reconnect") >= set(range(10)))
        hub.stop()
        assert _wait_for(lambda: all(m.pump.sender.connected is False for m in mons)), (
            "the collectors did not notice the hub going away"
        )
        _steps(mons, 10, 19)  # while no hub listens
        hub = _hub_on(port)  # a new process's worth of state: no recording, no ranks known
        known = _wait_for(lambda: bool(hub.store.runs()) and hub.store.runs()[0].n_ranks_seen == 2)
        assert known, f"no hello reached the new hub; rejects: {hub.health['rejects']}"
        unknown_after_hello = hub.health["rejects"].get("unknown_rank", 0)
        _steps(mons, 20, 29)
        ok = _wait_for(lambda: _complete_steps(hub, "reconnect") >= set(range(10, 30)))
        rejects = hub.health["rejects"]
        assert ok, f"steps missing at the new hub; rejects: {rejects}"
        assert rejects.get("unknown_rank", 0) == unknown_after_hello, rejects
        # Nothing was queued ahead of that hello: the rows held meanwhile came after it.
        assert unknown_after_hello == 0, rejects
        summary = hub.store.runs()[0]
        assert summary.n_ranks_seen == 2
        w = hub.store.window("reconnect")
        assert list(w.groups[0].ranks) == [0, 1]  # the groups came again with the hello
        inst = w.instances
        assert len(inst) > 0 and (inst.n_arrived == inst.n_members).all()
        # The rows recorded while the hub was away arrive with their own step ids.
        assert np.isin(np.arange(10, 20), w.steps).all()
        assert [m.stats()["reconnects"] for m in mons] == [1, 1]
    finally:
        for m in mons:
            m.close(timeout_s=1.0)
        hub.stop()
