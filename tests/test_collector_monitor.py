"""The Monitor end to end against a plain PULL socket: what it ships, and that it never
blocks or raises when the hub is absent or the input is bad."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest
import zmq

from rankscope.collector import runtime, schema
from rankscope.collector.identity import Identity
from rankscope.collector.monitor import Monitor
from rankscope.collector.pump import FLAG_PENDING, HOLD_NS, INCOMPLETE_NS, shippable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _identity(rank: int = 0, world: int = 2) -> Identity:
    return Identity(rank=rank, world_size=world, local_rank=rank, host="h0", node_rank=0, pid=1)


def _monitor(endpoint: str, **kw: object) -> Monitor:
    args: dict = dict(
        job="j",
        run="r1",
        identity=_identity(),
        hub=endpoint,
        sample_interval_s=0,
        clock_sync=False,
        flush_interval_s=0.05,
    )
    args.update(kw)
    return Monitor(**args).start()


class Pull:
    """A bare PULL socket standing in for the hub: decodes every message it gets."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    def messages(self, quiet_ms: int = 300) -> list[schema.Message]:
        out = []
        while self.sock.poll(quiet_ms):
            out.append(schema.decode(self.sock.recv()))
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def pull():
    p = Pull()
    yield p
    p.close()


def _tables(msgs: list[schema.Message], table: str) -> dict[str, np.ndarray]:
    parts = [m.tables[table] for m in msgs if table in m.tables]
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


def test_steps_phases_work_and_collectives_arrive(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    wall0 = time.time_ns()
    for k in range(3):
        with mon.step():
            with mon.phase("forward"):
                time.sleep(0.002)
            with mon.phase("my_phase"):
                pass
            with mon.collective("all_reduce", group=0, nbytes=4096):
                pass
            mon.register_group(7, "tp", [0, 1], backend="gloo")
            with mon.collective("all_gather", group=7, nbytes=128):
                pass
            mon.work(tokens=100, valid_tokens=90, samples=2, attn_cost=1e4)
            mon.work(tokens=50, attn_cost=5e3)
            mon.memory(allocated=1 << 20, reserved=2 << 20, peak=3 << 20, alloc_retries=k)
    mon.close()
    msgs = pull.messages()
    kinds = [m.kind for m in msgs]
    assert kinds[0] == "hello" and "groups" in kinds and "stats" in kinds
    hello = msgs[0].header
    assert hello["identity"]["rank"] == 0 and hello["identity"]["host"] == "h0"
    assert hello["manifest"]["job_config"] == {} and "python" in hello["manifest"]
    steps = _tables(msgs, "steps")
    assert steps["step"].tolist() == [0, 1, 2]
    assert steps["tokens"].tolist() == [150] * 3 and steps["valid_tokens"].tolist() == [90] * 3
    assert steps["attn_cost"].tolist() == [1.5e4] * 3 and np.isnan(steps["flops"]).all()
    assert steps["alloc_retries"].tolist() == [0, 1, 2]
    # Hub clock without sync = wall clock: the steps happened just now.
    assert np.all(np.abs(steps["t_start"] - wall0) < 5e9)
    assert np.all(steps["t_end"] > steps["t_start"])
    colls = _tables(msgs, "colls")
    assert (
        colls["op"].tolist() == [schema.OP_INDEX["all_reduce"], schema.OP_INDEX["all_gather"]] * 3
    )
    assert colls["group"].tolist() == [0, 7] * 3
    assert colls["seq"].tolist() == [0, 0, 1, 1, 2, 2]
    assert colls["step"].tolist() == [0, 0, 1, 1, 2, 2]
    assert np.all(colls["t_exit"] >= colls["t_enter"])
    assert np.all(colls["flags"] == schema.FLAG_MANUAL)
    phases = _tables(msgs, "phases")
    names = list(schema.PHASES) + next(m for m in msgs if m.kind == "steps").header["phase_names"]
    assert [names[i] for i in phases["phase"]] == ["forward", "my_phase"] * 3
    fwd = phases["phase"] == schema.PHASE_INDEX["forward"]
    assert np.all(phases["t1"][fwd] - phases["t0"][fwd] >= 2_000_000)
    groups = next(m for m in msgs if m.kind == "groups" and len(m.header["groups"]) == 2)
    assert {g["id"]: g["ranks"] for g in groups.header["groups"]} == {0: [0, 1], 7: [0, 1]}
    stats = [m for m in msgs if m.kind == "stats"][-1].header["stats"]
    assert stats["dropped_events"] == 0 and stats["errors"] == {}
    assert stats["pump_cpu_s"] > 0  # the background thread reports its own cost


def test_100k_collectives_without_a_hub_complete_and_count_drops(no_hub: str) -> None:
    # Nothing listens on this port: the loop must finish, and what did not fit is counted.
    mon = _monitor(no_hub, capacity=1024, hwm=2)
    with mon.step():
        for _ in range(100_000):
            with mon.collective("all_reduce", nbytes=8):
                pass
    mon.close(timeout_s=2)
    stats = mon.stats()
    assert mon._colls.head + mon._colls.dropped == 100_000
    assert stats["dropped_events"] > 0 or stats["dropped_batches"] > 0
    assert mon._seq[0] == 100_000  # sequence numbers advance even for dropped rows


def test_full_ring_drops_are_reported(pull: Pull) -> None:
    # Rows are recorded before the background thread starts: the ring of 16 rows fills
    # and the other 84 are refused and counted.
    mon = Monitor(
        job="j",
        run="r1",
        identity=_identity(),
        hub=pull.endpoint,
        capacity=16,
        sample_interval_s=0,
        clock_sync=False,
    )
    mon.begin_step()
    for _ in range(100):
        mon.record_collective("barrier", 0, nbytes=0, t_enter=1, t_exit=2)
    mon.end_step()
    mon.start()
    mon.close()
    msgs = pull.messages()
    colls = _tables(msgs, "colls")
    stats = [m for m in msgs if m.kind == "stats"][-1].header["stats"]
    assert len(colls["seq"]) == 16 and stats["dropped_events"] == 84
    assert colls["seq"].tolist() == list(range(16))


def test_bad_calls_are_counted_never_raised(pull: Pull, caplog: pytest.LogCaptureFixture) -> None:
    mon = _monitor(pull.endpoint)
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        mon.end_step()  # no step open
        mon.begin_step(-4)  # bad id: counted, numbered automatically
        mon.work(tokens="many")  # type: ignore[arg-type]
        mon.work(tokens=-1)
        mon.work(tokens="also bad")  # type: ignore[arg-type]
        mon.register_group(3, "x", [0, 99])  # rank outside the world
        mon.register_group(-1, "x", [0])
        mon.record_collective("all_reduce", "g")  # type: ignore[arg-type]
        mon.end_step()
    mon.close()
    errs = mon.stats()["errors"]
    assert errs == {
        "end_without_begin": 1,
        "bad_step": 1,
        "bad_work": 3,
        "bad_group": 2,
        "bad_collective": 1,
    }
    # Each reason is logged once, however often it happens.
    assert sum("bad_work" in r.message for r in caplog.records) == 1
    steps = _tables(pull.messages(), "steps")
    assert steps["step"].tolist() == [0]


def test_unknown_op_maps_to_other_and_manual_seq_is_kept(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    mon.begin_step(10)
    mon.record_collective("fancy_op", 0, seq=41, nbytes=5, t_enter=100, t_exit=200, flags=2)
    mon.record_collective(schema.OP_INDEX["send"], 0, nbytes=1, t_enter=300, t_exit=400)
    mon.end_step()
    mon.close()
    colls = _tables(pull.messages(), "colls")
    assert colls["op"].tolist() == [schema.OP_INDEX["other"], schema.OP_INDEX["send"]]
    assert colls["seq"].tolist() == [41, 0]
    assert colls["step"].tolist() == [10, 10]
    assert colls["flags"].tolist() == [2 | schema.FLAG_MANUAL, schema.FLAG_MANUAL]


def test_collectives_between_steps_go_to_the_next_step(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    with mon.step(5):
        pass
    with mon.collective("all_reduce"):
        pass
    with mon.step(6):
        pass
    mon.close()
    assert _tables(pull.messages(), "colls")["step"].tolist() == [6]


def test_pending_async_rows_wait_for_completion(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    mon.begin_step()
    t = time.monotonic_ns()
    idx = mon._rec_coll(0, 0, 8, t, schema.NO_TIME, schema.FLAG_ASYNC)
    mon.end_step()
    time.sleep(0.3)  # several flushes: the pending row must not be shipped yet
    assert mon._colls.tail == 0
    assert mon._colls.set_field(idx, "t_exit", t + 1000)
    mon.close()
    colls = _tables(pull.messages(), "colls")
    assert colls["t_exit"][0] - colls["t_enter"][0] == 1000


def test_shippable_prefix_rules() -> None:
    now = 10 * INCOMPLETE_NS
    step = np.array([1, 1, 2, 2])
    fresh = np.full(4, now)
    # Rows of an ended step ship, rows of the open step wait.
    assert shippable(step, fresh, None, last_ended=1, now_ns=now, final=False) == 2
    # The open step's rows ship anyway once older than HOLD_NS.
    old = np.full(4, now - HOLD_NS - 1)
    assert shippable(step, old, None, last_ended=1, now_ns=now, final=False) == 4
    # A pending row holds everything after it, until INCOMPLETE_NS.
    pending = np.array([False, True, False, False])
    assert shippable(step, old, pending, last_ended=2, now_ns=now, final=False) == 1
    ancient = np.full(4, now - INCOMPLETE_NS - 1)
    assert shippable(step, ancient, pending, last_ended=2, now_ns=now, final=False) == 4
    assert shippable(step, fresh, pending, last_ended=0, now_ns=now, final=True) == 4


def test_pending_flag_is_never_sent(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    mon.begin_step()
    idx = mon._rec_coll(0, 0, 8, time.monotonic_ns(), time.monotonic_ns(), FLAG_PENDING)
    mon.end_step()
    mon._colls.set_field(idx, "flags", schema.FLAG_DEVICE_TIMED)
    mon.close()
    assert _tables(pull.messages(), "colls")["flags"].tolist() == [schema.FLAG_DEVICE_TIMED]


def test_inert_monitor_does_nothing() -> None:
    mon = Monitor(
        job="j", run="r", identity=_identity(), hub="tcp://127.0.0.1:1", enabled=False
    ).start()
    with mon.step(), mon.phase("forward"), mon.collective("all_reduce"):
        mon.work(tokens=1)
    assert mon._colls.head == 0 and mon._steps.head == 0 and not mon.pump.running
    mon.close()


def test_start_is_idempotent_and_checks_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKSCOPE_HUB", f"tcp://127.0.0.1:{_free_port()}")
    for var in ("RANK", "WORLD_SIZE", "RANKSCOPE_RUN", "RANKSCOPE_JOB"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="scope"):
        runtime.start(job="j", scope="galaxy")
    with pytest.raises(ValueError, match="endpoint"):
        runtime.start(job="j", hub="localhost:5555")
    with pytest.raises(ValueError, match="job"):
        runtime.start(job="has space")
    with pytest.raises(ValueError, match="rank"):
        runtime.start(job="j", rank=-1)
    mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:
        assert runtime.current() is mon
        assert runtime.start(job="other") is mon
        assert mon.run.startswith("j-") and mon.identity.world_size == 1
    finally:
        runtime.close()
    assert runtime.current() is None


def test_run_and_job_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKSCOPE_HUB", f"tcp://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("RANKSCOPE_RUN", "run-42")
    monkeypatch.setenv("RANKSCOPE_JOB", "llm")
    monkeypatch.setenv("RANKSCOPE_SCOPE", "one-node")
    monkeypatch.setenv("RANKSCOPE_PARENT_RUN", "run-41")
    mon = runtime.start(sample_interval_s=0, instrument_torch=False)
    try:
        assert (mon.job, mon.run, mon.scope, mon.parent_run) == (
            "llm",
            "run-42",
            "one-node",
            "run-41",
        )
    finally:
        runtime.close()


def test_host_samples_ship_from_the_pump_and_steps_batch(pull: Pull) -> None:
    # Sampling rides on the background thread's wake-ups; steps ending faster than the
    # flush interval are shipped together, not one wake-up per step.
    mon = _monitor(pull.endpoint, sample_interval_s=0.1, flush_interval_s=0.2)
    n = 0
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        with mon.step(), mon.collective("all_reduce", group=0, nbytes=64):
            pass
        n += 1
        time.sleep(0.002)
    wakes = mon.pump.wakes
    mon.close()
    msgs = pull.messages()
    steps = _tables(msgs, "steps")
    assert steps["step"].tolist() == list(range(n))
    assert len([m for m in msgs if m.kind == "steps"]) < n / 4
    assert wakes < n / 4
    samples = _tables(msgs, "samples")
    assert len(samples["t"]) >= 2  # periodic ones plus the last one at close
    assert np.all(np.diff(samples["t"]) > 0)
    assert np.all(samples["rss_bytes"] > 0) and np.all(samples["load1"] >= 0)
    assert np.isnan(samples["sm_clock_mhz"]).all()  # no GPU here: device columns unknown
    stats = [m for m in msgs if m.kind == "stats"][-1].header["stats"]
    assert stats["sampler_cpu_s"] > 0 and stats["pump_cpu_s"] >= stats["sampler_cpu_s"]


def test_ddp_bucket_setting_from_arguments_and_env(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RANKSCOPE_HUB", f"tcp://127.0.0.1:{_free_port()}")
    with pytest.raises(ValueError, match="ddp_buckets 'sometimes'"):
        runtime.start(job="j", ddp_buckets="sometimes")
    with pytest.raises(ValueError, match="ddp_sample_every"):
        runtime.start(job="j", ddp_buckets="sampled", ddp_sample_every=0)
    with pytest.raises(ValueError, match="ddp_buckets"):
        Monitor(job="j", run="r", identity=_identity(), hub="tcp://127.0.0.1:1", ddp_buckets="")
    monkeypatch.setenv("RANKSCOPE_DDP_BUCKETS", "Sampled")
    monkeypatch.setenv("RANKSCOPE_DDP_SAMPLE_EVERY", "25")
    mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:
        assert (mon.ddp_buckets, mon.ddp_sample_every) == ("sampled", 25)
    finally:
        runtime.close()
    # Arguments win over the environment.
    mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False, ddp_buckets="off")
    try:
        assert mon.ddp_buckets == "off"
    finally:
        runtime.close()
    # A bad environment value is untrusted input: warned about, the default used.
    monkeypatch.setenv("RANKSCOPE_DDP_BUCKETS", "never")
    monkeypatch.setenv("RANKSCOPE_DDP_SAMPLE_EVERY", "-3")
    with caplog.at_level("WARNING", logger="rankscope"):
        mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:
        assert (mon.ddp_buckets, mon.ddp_sample_every) == ("auto", 10)
    finally:
        runtime.close()
    assert "RANKSCOPE_DDP_BUCKETS='never'" in caplog.text
    assert "RANKSCOPE_DDP_SAMPLE_EVERY='-3'" in caplog.text


@pytest.mark.parametrize("first", [None, 0, 40])
def test_setup_before_the_programs_first_step_is_not_a_step(pull: Pull, first) -> None:
    """Auto-instrumentation opens a step at the first activity (here: setup collectives
    such as DDP's parameter broadcast); a program that then marks its own steps gets them
    under its ids, once each, and the setup's rows count in its first step."""
    mon = _monitor(pull.endpoint)
    mon._auto = True  # as the torch hooks set it before the program marks a step
    now = time.monotonic_ns()
    mon._rec_coll(schema.OP_INDEX["broadcast"], 0, 64, now, now + 1000, 0)  # opens a step
    mon._rec_phase(schema.PHASE_INDEX["checkpoint"], now, now + 500)
    base = 0 if first is None else first
    for k in range(2):
        mon.begin_step(None if first is None else first + k)
        with mon.collective("all_reduce", group=0, nbytes=4096):
            pass
        mon.end_step()
    mon.close()
    msgs = pull.messages()
    assert _tables(msgs, "steps")["step"].tolist() == [base, base + 1]
    colls = _tables(msgs, "colls")
    assert colls["step"].tolist() == [base, base, base + 1]
    assert colls["seq"].tolist() == [0, 1, 2]  # the setup call keeps its place in the group
    assert _tables(msgs, "phases")["step"].tolist() == [base]
    stats = [m for m in msgs if m.kind == "stats"][-1].header["stats"]
    assert stats["errors"] == {}


def test_auto_steps_already_ended_are_kept_when_the_program_takes_over(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    mon._auto = True
    now = time.monotonic_ns()
    mon._rec_coll(schema.OP_INDEX["all_reduce"], 0, 64, now, now + 1000, 0)
    # An optimizer step: its phase, then auto step 0 ends and step 1 opens.
    mon._optimizer_end(schema.PHASE_INDEX["optimizer"], now + 2000, now + 3000)
    mon.begin_step(5)
    mon.end_step()
    mon.close()
    steps = _tables(pull.messages(), "steps")
    assert steps["step"].tolist() == [0, 1, 5]


def test_step_rows_carry_the_training_thread_s_cpu_and_run_queue_time(pull: Pull) -> None:
    from rankscope.collector.runqueue import wait_ns

    mon = _monitor(pull.endpoint)
    for step in range(3):
        mon.begin_step(step)
        end = time.perf_counter() + 0.01
        while time.perf_counter() < end:
            pass
        mon.end_step()
    mon.close()
    steps = _tables(pull.messages(), "steps")
    wall = steps["t_end"] - steps["t_start"]
    assert steps["step"].tolist() == [0, 1, 2]
    assert ((steps["cpu_ns"] > 0) & (steps["cpu_ns"] <= wall * 1.05)).all(), steps["cpu_ns"]
    if wait_ns() < 0:
        assert (steps["runq_ns"] == -1).all()  # not measurable here: unknown, not zero
    else:
        assert ((steps["runq_ns"] >= 0) & (steps["runq_ns"] <= wall)).all(), steps["runq_ns"]


def test_values_that_do_not_fit_are_counted_and_never_stop_the_stream(pull: Pull) -> None:
    mon = _monitor(pull.endpoint)
    mon.begin_step(1 << 63)  # beyond int64: counted, numbered automatically
    mon.work(tokens=1 << 63)
    mon.memory(allocated=1 << 64)
    with mon.collective("all_reduce", group=1 << 40, nbytes=8):  # beyond int32
        pass
    mon.record_phase("forward", 1 << 64, 5)
    mon.end_step()
    mon.begin_step()
    mon.end_step()
    mon.close()
    assert mon.stats()["errors"] == {
        "bad_step": 1,
        "bad_work": 1,
        "bad_memory": 1,
        "malformed_row": 2,
    }
    msgs = pull.messages()
    assert _tables(msgs, "steps")["step"].tolist() == [0, 1]
    colls = _tables(msgs, "colls")
    assert colls["group"].tolist() == [-1] and colls["nbytes"].tolist() == [8]
    phases = _tables(msgs, "phases")
    assert phases["t0"].tolist() == [-1] and phases["t1"][0] != -1  # shipped as unknown
