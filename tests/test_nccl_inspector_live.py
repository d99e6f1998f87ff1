"""The live NCCL Inspector path: a test writes Inspector-format lines (NVIDIA/nccl
``ext-profiler/inspector``, output format v4.0, one JSON object per line, file
``<dump dir>/<host>-pid<pid>.log``) into the dump directory while real collectors record
the host side of the same collectives and ship to a real hub on loopback; the hub's window
must carry the device times from the file."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from rankscope.collector import inspector_tail, runtime, schema
from rankscope.collector.clock import realtime_minus_monotonic_ns
from rankscope.collector.identity import Identity
from rankscope.collector.inspector_tail import InspectorTail
from rankscope.collector.monitor import Monitor
from rankscope.commands import run as run_cmd
from rankscope.diagnosis.grouprows import transfer_time
from rankscope.errors import CommandError
from rankscope.hub.server import Hub

COMM = "0x7f8c496ae9f661"
KSTART_US = 100
"""Device start of each written collective after its host entry (µs)."""
KDUR_US = 1000
"""Device duration of each written collective (µs)."""


def _shift_us() -> int:
    """Realtime minus monotonic, in µs (the Inspector writes gettimeofday times)."""
    return realtime_minus_monotonic_ns() // 1000


def _record(
    rank: int,
    n: int,
    seq: int,
    t_enter_ns: int,
    *,
    coll: str = "AllReduce",
    last_enter_ns: int | None = None,
    comm: str = COMM,
) -> str:
    """One Inspector v4.0 verbose record, as the plugin's dump thread writes it: the kernel
    starts `KSTART_US` after this rank's entry and ends `KSTART_US + KDUR_US` after the last
    member's (``last_enter_ns``, default this rank's), as a collective's kernels do."""
    shift = _shift_us()
    enter = t_enter_ns // 1000 + shift
    last = (t_enter_ns if last_enter_ns is None else last_enter_ns) // 1000 + shift
    k0, k1 = enter + KSTART_US, last + KSTART_US + KDUR_US
    obj = {
        "header": {"id": comm, "rank": rank, "n_ranks": n, "nnodes": 1},
        "metadata": {
            "inspector_output_format_version": "v4.0",
            "git_rev": "",
            "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": k1 + 5,
            "hostname": "h0",
            "pid": 1000 + rank,
        },
        "coll_perf": {
            "coll": coll,
            "coll_sn": seq,
            "coll_msg_size_bytes": 1 << 20,
            "coll_exec_time_us": KDUR_US,
            "coll_timing_source": "kernel_gpu",
            "coll_algobw_gbs": 1.0,
            "coll_busbw_gbs": 1.0,
            "event_trace_sn": {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": []},
            "event_trace_ts": {
                "coll_start_ts": enter,
                "coll_stop_ts": enter + 5,
                "kernel_events": [
                    {
                        "channel_id": 0,
                        "kernel_start_ts": k0,
                        "kernel_stop_ts": k1,
                        "kernel_record_ts": k1,
                    }
                ],
            },
        },
    }
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _identity(rank: int, world: int) -> Identity:
    return Identity(rank=rank, world_size=world, local_rank=rank, host="h0", node_rank=0, pid=1)


def _monitor(endpoint: str, rank: int, world: int, run: str = "r1") -> Monitor:
    return Monitor(
        job="j",
        run=run,
        identity=_identity(rank, world),
        hub=endpoint,
        sample_interval_s=0,
        clock_sync=False,
        flush_interval_s=0.05,
    )


def _offline(rank: int, world: int) -> Monitor:
    """A monitor whose pump never starts: the test polls the tail itself."""
    return Monitor(
        job="j",
        run="r",
        identity=_identity(rank, world),
        hub="tcp://127.0.0.1:9",
        sample_interval_s=0,
        clock_sync=False,
    )


def _tail(mon: Monitor, dump: Path, **kw: int) -> InspectorTail:
    tail = InspectorTail(mon, str(dump), plugin="/x/libnccl-profiler-inspector.so", **kw)
    return tail.install()


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)
        f.flush()


@pytest.fixture
def hub():
    h = Hub(bind="tcp://127.0.0.1:0", record_dir=None).start()
    yield h
    h.stop()


def test_device_times_from_a_growing_inspector_file_reach_the_hub_window(
    hub: Hub, tmp_path: Path
) -> None:
    world, steps = 2, 6
    mons = [_monitor(hub.endpoint, r, world) for r in range(world)]
    tails = [_tail(m, tmp_path, pid=1000 + r, hold_ns=3_000_000_000) for r, m in enumerate(mons)]
    for m in mons:
        m.start()
    files = [tmp_path / f"h0-pid{1000 + r}.log" for r in range(world)]
    enters: dict[tuple[int, int], int] = {}
    try:
        for step in range(steps):
            for r, m in enumerate(mons):
                with m.step(step):
                    t = time.monotonic_ns()
                    m.record_collective(
                        "all_reduce", 0, nbytes=1 << 20, t_enter=t, t_exit=t + 2_000_000
                    )
                enters[(r, step)] = t
            for r in range(world):
                last = max(enters[(q, step)] for q in range(world))
                line = _record(r, world, step, enters[(r, step)], last_enter_ns=last)
                if step == 2 and r == 0:
                    # A record in two writes: the partial line waits for its end.
                    _append(files[r], line[:40])
                    time.sleep(0.15)
                    _append(files[r], line[40:])
                else:
                    _append(files[r], line)  # the file appears after the collectors started
                if step == 3 and r == 1:
                    _append(files[r], '{"header": {"id": "0x1", "rank": 1, "n_ra\n')  # garbled
            time.sleep(0.02)

        def all_timed() -> bool:
            w = hub.store.window("r1")
            rows = w.rows
            return (
                rows is not None
                and len(rows) == world * steps
                and bool(((rows.flags & schema.FLAG_INSPECTOR) != 0).all())
            )

        assert _wait_for(all_timed), hub.store.window("r1").rows
    finally:
        for m in mons:
            m.close()
    w = hub.store.window("r1")
    rows = w.rows
    assert rows is not None
    assert ((rows.flags & schema.FLAG_DEVICE_TIMED) != 0).all()
    assert ((rows.flags & schema.FLAG_INSPECTOR_OWN) == 0).all()
    # Device start 100 µs after the host entry, 1000 µs long, as the file says (µs rounding
    # and the realtime/monotonic shift read at two moments: a few µs).
    np.testing.assert_allclose(rows.t_start - rows.t_enter, KSTART_US * 1000, atol=5_000)
    lasts = np.array([max(enters[(q, int(s))] for q in range(world)) for s in rows.step])
    own = np.array([enters[(int(r), int(s))] for r, s in zip(rows.rank, rows.step)])
    np.testing.assert_allclose(
        rows.t_end - rows.t_start, KDUR_US * 1000 + (lasts - own), atol=5_000
    )
    assert w.manifest["device_time_source"] == "nccl-inspector"
    # The hub's bandwidth uses the device transfer: t_end - max(t_start) over the members.
    inst = w.instances
    assert len(inst) == steps and np.isfinite(inst.device_transfer).all()
    np.testing.assert_array_equal(transfer_time(inst), inst.device_transfer)
    np.testing.assert_allclose(inst.device_transfer, KDUR_US * 1000, atol=5_000)
    for t in tails:
        assert t.matched == steps and t.own == 0 and t.late == 0
    assert tails[0].malformed == 0 and tails[1].malformed == 1
    assert mons[1].stats()["errors"]["nccl_inspector_line"] == 1


def test_manifest_names_the_inspector_as_device_time_source(hub: Hub, tmp_path: Path) -> None:
    mon = _monitor(hub.endpoint, 0, 1, run="r-man")
    _tail(mon, tmp_path, pid=1000)
    mon.start()
    try:
        with mon.step(0):
            t = time.monotonic_ns()
            mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
        assert _wait_for(lambda: "r-man" in hub.store.run_ids())
        assert _wait_for(lambda: bool(hub.store.window("r-man").manifest))
    finally:
        mon.close()
    man = hub.store.window("r-man").manifest
    assert man["device_time_source"] == "nccl-inspector"
    assert man["nccl_inspector"]["dump_dir"] == str(tmp_path)


def test_records_without_a_host_row_ship_as_their_own_flagged_rows(
    hub: Hub, tmp_path: Path
) -> None:
    mon = _monitor(hub.endpoint, 0, 1, run="r-own")
    tail = _tail(mon, tmp_path, pid=1000, wait_ns=100_000_000)
    mon.start()
    path = tmp_path / "h0-pid1000.log"
    try:
        with mon.step(0):
            t = time.monotonic_ns()
            mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
        _append(path, _record(0, 1, 0, t))
        # seq 1 was never recorded by the collector (e.g. a C++ call it does not see).
        _append(path, _record(0, 1, 1, t + 5_000_000, coll="AllGather"))
        with mon.step(1):
            pass

        def both() -> bool:
            rows = hub.store.window("r-own").rows if "r-own" in hub.store.run_ids() else None
            return rows is not None and len(rows) == 2

        assert _wait_for(both)
    finally:
        mon.close()
    rows = hub.store.window("r-own").rows
    assert rows is not None
    own = (rows.flags & schema.FLAG_INSPECTOR_OWN) != 0
    assert own.sum() == 1 and tail.own == 1 and tail.matched == 1
    gather = schema.OP_INDEX["all_gather"]
    assert int(rows.group[own][0]) == inspector_tail.own_group_id(COMM, gather)
    assert int(rows.group[own][0]) & inspector_tail.OWN_GROUP_BIT
    assert int(rows.seq[own][0]) == 1 and int(rows.op[own][0]) == schema.OP_INDEX["all_gather"]
    assert float(rows.t_end[own][0] - rows.t_start[own][0]) == pytest.approx(
        KDUR_US * 1000, abs=2000
    )


def test_tail_in_process_rotation_garbage_and_bounded_partial(tmp_path: Path) -> None:
    """The tail alone, polled on this thread (no pump): a replaced file is read from its
    start, a line without an end longer than MAX_LINE is dropped and counted."""
    mon = _offline(0, 1)
    tail = InspectorTail(mon, str(tmp_path / "later"), pid=42)
    tail.poll()  # no directory yet: nothing, no error
    assert tail.records == 0 and not mon._errors
    (tmp_path / "later").mkdir()
    path = tmp_path / "later" / "h0-pid42.log"
    t = time.monotonic_ns()
    for s in range(3):
        mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t + s, t_exit=t + s + 1000)
    _append(path, _record(0, 1, 0, t))
    tail.poll()  # the file appeared late: found at once while none is known
    assert tail.matched == 1
    # Rotation: a new file under the same name holds the next records from its start.
    path.unlink()
    path.write_text(_record(0, 1, 1, t) + "x" * 10 + "\n")
    tail.poll()
    assert tail.matched == 2 and tail.malformed == 1
    _append(path, "y" * (inspector_tail.MAX_LINE + 10))
    tail.poll()
    assert tail.malformed == 2
    line = _record(0, 1, 2, t)
    _append(path, "\n" + line[:100])  # the plugin is half-way through a record
    tail.poll()
    assert tail.matched == 2 and tail.malformed == 2
    _append(path, line[100:])
    tail.poll()
    assert tail.matched == 3 and tail.malformed == 2
    flags = [mon._colls.slots[i][9] for i in range(3)]
    assert all(f & schema.FLAG_INSPECTOR for f in flags)
    mon.close()


def test_communicators_map_to_groups_by_size_position_then_op(tmp_path: Path) -> None:
    """Rank 0 of a 2x2 mesh sits first in its tp group [0, 1] and its dp group [0, 2]:
    size and position fit both, the op of the held row at that seq decides."""
    mon = _offline(0, 4)
    mon.register_group(1, "tp", [0, 1])
    mon.register_group(2, "dp", [0, 2])
    t = time.monotonic_ns()
    mon.record_collective("all_reduce", 1, nbytes=1 << 20, t_enter=t, t_exit=t + 1000)
    mon.record_collective("all_gather", 2, nbytes=1 << 20, t_enter=t, t_exit=t + 1000)
    path = tmp_path / "h0-pid5.log"
    _append(path, _record(0, 2, 0, t, comm="0xaaa"))
    _append(path, _record(0, 2, 0, t, coll="AllGather", comm="0xbbb"))
    tail = InspectorTail(mon, str(tmp_path), pid=5)
    tail.poll()
    assert tail._comm_group == {"0xaaa": 1, "0xbbb": 2} and tail.matched == 2
    assert all(mon._colls.slots[i][9] & schema.FLAG_INSPECTOR for i in range(2))
    mon.close()


def test_coll_sn_counts_per_nccl_function_and_matches_the_groups_rows_of_it(
    tmp_path: Path,
) -> None:
    """NCCL's coll_sn is comm->seqNumber[func]: in a group that runs all_reduce, all_gather,
    all_reduce, barrier (seq 0..3), the Inspector numbers AllReduce 0, AllGather 0,
    AllReduce 1, AllReduce 2 (the barrier is a one-element all-reduce)."""
    mon = _offline(0, 1)
    t = time.monotonic_ns()
    ops = ("all_reduce", "all_gather", "all_reduce", "barrier", "send")
    for k, op in enumerate(ops):
        at = t + k * 10_000_000
        mon.record_collective(op, 0, nbytes=8, t_enter=at, t_exit=at + 1000)
    path = tmp_path / "h0-pid5.log"
    for k, (coll, sn) in enumerate(
        (("AllReduce", 0), ("AllGather", 0), ("AllReduce", 1), ("AllReduce", 2))
    ):
        _append(path, _record(0, 1, sn, t + k * 10_000_000, coll=coll))
    tail = InspectorTail(mon, str(tmp_path), pid=5)
    tail.poll()
    assert tail.matched == 4 and tail.own == 0 and tail.late == 0
    slots = [mon._colls.slots[i] for i in range(len(ops))]
    assert all(sl is not None for sl in slots)
    for k, sl in enumerate(slots[:4]):
        assert sl[9] & schema.FLAG_INSPECTOR  # type: ignore[index]
        # Each row got its own record's times: 100 µs after its own entry.
        assert abs(sl[6] - (t + k * 10_000_000) - KSTART_US * 1000) < 5_000  # type: ignore[index]
    assert not slots[4][9] & schema.FLAG_INSPECTOR  # type: ignore[index]  # p2p: not recorded
    mon.close()


def test_rows_wait_for_the_first_record_and_stop_waiting_for_a_group_never_timed(
    tmp_path: Path,
) -> None:
    """Before any record was read no communicator is mapped, yet the first collectives
    must not ship untimed (seen under load: step 0 shipped before the first dump was
    read). An unmapped group's rows of an NCCL function wait; point-to-point rows, which
    the Inspector never times, do not; a group whose rows keep shipping unmatched after
    their whole wait (a gloo group) stops waiting."""
    mon = _offline(0, 1)
    tail = InspectorTail(mon, str(tmp_path), pid=5, hold_ns=1_000_000)
    t = time.monotonic_ns()
    mon.record_collective("send", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
    mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
    colls = mon._colls.unread(16)
    assert tail.hold(colls, t + 2000) == 1  # the send ships, the all-reduce waits
    # Its record arrives: the group is mapped and the row carries the device times.
    _append(tmp_path / "h0-pid5.log", _record(0, 1, 0, t))
    tail.poll()
    assert tail.matched == 1
    assert tail.hold(mon._colls.unread(16), t + 2000) == 2
    mon.close()

    mon = _offline(0, 1)
    tail = InspectorTail(mon, str(tmp_path / "none"), pid=5, hold_ns=1_000_000)
    n = inspector_tail.GIVE_UP_ROWS
    for k in range(n + 1):
        mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t + k, t_exit=t + k + 1000)
    colls = mon._colls.unread(16)
    assert tail.hold(colls, t + 2000) == 0  # within the wait: all held
    # After the whole wait each ships; the group is given up on after GIVE_UP_ROWS.
    assert tail.hold(colls[:n], t + 10_000_000) == n
    mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t + 20, t_exit=t + 1020)
    assert tail.hold(mon._colls.unread(16)[n:], t + 2000) == 2
    mon.close()


def test_without_the_plugin_nothing_changes(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(inspector_tail.ENV_PLUGIN, raising=False)
    monkeypatch.setattr(runtime, "_active", None)
    mon = runtime.start(
        job="j",
        run="r-plain",
        hub=hub.endpoint,
        rank=0,
        world_size=1,
        sample_interval_s=0,
        clock_sync=False,
        flush_interval_s=0.05,
        instrument_torch=False,
    )
    try:
        assert mon.inspector is None and mon.pump.hold is None
        assert not mon.pump.extra_manifest
        with mon.step(0):
            t = time.monotonic_ns()
            mon.record_collective("all_reduce", 0, nbytes=8, t_enter=t, t_exit=t + 1000)
        assert _wait_for(
            lambda: (
                "r-plain" in hub.store.run_ids() and hub.store.window("r-plain").rows is not None
            )
        )
    finally:
        runtime.close()
    rows = hub.store.window("r-plain").rows
    assert rows is not None
    assert ((rows.flags & (schema.FLAG_INSPECTOR | schema.FLAG_DEVICE_TIMED)) == 0).all()
    assert "nccl_inspector" not in mon.stats()


def test_start_validates_the_plugin_and_sets_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "_active", None)
    with pytest.raises(ValueError, match="does not exist"):
        runtime.start(job="j", run="r", nccl_inspector=str(tmp_path / "missing.so"))
    with pytest.raises(ValueError, match="is not a file"):
        runtime.start(job="j", run="r", nccl_inspector=str(tmp_path))
    monkeypatch.setenv(inspector_tail.ENV_PLUGIN, str(tmp_path / "gone.so"))
    assert runtime._inspector_plugin(os.environ, None) is None  # ignored, with a warning
    plugin = tmp_path / "libnccl-profiler-inspector.so"
    plugin.write_bytes(b"\x7fELF")
    env: dict[str, str] = {}
    mon = _monitor("tcp://127.0.0.1:9", 0, 1, run="r-env")
    tail = inspector_tail.start_tail(mon, str(plugin), env)
    assert env["NCCL_PROFILER_PLUGIN"] == str(plugin) and env["NCCL_INSPECTOR_ENABLE"] == "1"
    assert env["NCCL_INSPECTOR_DUMP_VERBOSE"] == "1"
    assert env["NCCL_INSPECTOR_DUMP_DIR"] == tail.dump_dir and Path(tail.dump_dir).is_dir()
    assert tail.dump_dir.endswith("r-env") and mon.inspector is tail
    mon.close()


def test_start_from_the_environment_rankscope_run_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = tmp_path / "libnccl-profiler-inspector.so"
    plugin.write_bytes(b"\x7fELF")
    for key in inspector_tail.plugin_env("", ""):
        monkeypatch.setenv(key, "")  # restored after the test, whatever start sets
    monkeypatch.setenv(inspector_tail.ENV_PLUGIN, str(plugin))
    monkeypatch.setenv("NCCL_INSPECTOR_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setattr(runtime, "_active", None)
    mon = runtime.start(
        job="j",
        run="r-zero",
        hub="tcp://127.0.0.1:9",
        rank=0,
        world_size=1,
        sample_interval_s=0,
        clock_sync=False,
        instrument_torch=False,
    )
    try:
        assert mon.inspector is not None and mon.inspector.dump_dir == str(tmp_path / "dump")
        assert mon.inspector.plugin == str(plugin) and mon.pump.hold is not None
        assert os.environ["NCCL_PROFILER_PLUGIN"] == str(plugin)
    finally:
        runtime.close()


def _run_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return args


def test_run_nccl_inspector_sets_the_plugin_environment_for_every_rank(tmp_path: Path) -> None:
    plugin = tmp_path / "libnccl-profiler-inspector.so"
    plugin.write_bytes(b"\x7fELF")
    args = _run_args("--nccl-inspector", str(plugin), "--run", "llm-9", "--", "torchrun", "t.py")
    env = run_cmd.build_env(args, {}, "/site")
    assert env["RANKSCOPE_NCCL_INSPECTOR"] == str(plugin)
    assert env["NCCL_PROFILER_PLUGIN"] == str(plugin)
    assert env["NCCL_INSPECTOR_ENABLE"] == "1" and env["NCCL_INSPECTOR_DUMP_VERBOSE"] == "1"
    assert env["NCCL_INSPECTOR_DUMP_DIR"] == inspector_tail.default_dump_dir("llm-9")
    assert int(env["NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS"]) > 0
    # A dump directory the user chose is kept.
    env = run_cmd.build_env(args, {"NCCL_INSPECTOR_DUMP_DIR": "/data/insp"}, "/site")
    assert env["NCCL_INSPECTOR_DUMP_DIR"] == "/data/insp"
    # Without the flag no NCCL variable is set.
    plain = run_cmd.build_env(_run_args("--", "torchrun", "t.py"), {}, "/site")
    assert not any(k.startswith(("NCCL_", "RANKSCOPE_NCCL")) for k in plain)
    for bad, why in ((tmp_path / "nope.so", "does not exist"), (tmp_path, "is not a file")):
        with pytest.raises(CommandError, match=why) as exc:
            run_cmd.build_env(_run_args("--nccl-inspector", str(bad), "--", "x"), {}, "/site")
        assert "\n" not in str(exc.value) and str(exc.value).startswith("--nccl-inspector")
