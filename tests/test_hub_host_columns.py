"""Host evidence (GC pauses, thread CPU time, tokens per expert) from the wire to the
`Window`: the store, ``build_window``, old senders without the columns, hostile values."""

import msgpack
import numpy as np
from test_hub_job import BASE, STEP_NS, assert_windows_equal, header, identity

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import build_window
from rankscope.diagnosis.regime import since
from rankscope.diagnosis.window import HOST_COLUMNS, WORK_COLUMNS
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store

RUN = "host"
FWD, BWD = schema.PHASE_INDEX["forward"], schema.PHASE_INDEX["backward"]


def _hello(world: int) -> list[bytes]:
    out = []
    for r in range(world):
        out.append(schema.hello_message(header(RUN, r), identity(r, world), t_start_ns=BASE))
    return out


def _tables(rank: int, step: int) -> tuple[dict, dict]:
    """One step of one rank: 3 ms of wall, host columns known, two forward spans (one of
    unknown CPU time on rank 1) and one backward span."""
    t = BASE + step * STEP_NS
    st = schema.empty_table("steps", 1)
    st["step"][:] = step
    st["t_start"][:] = t
    st["t_end"][:] = t + 3_000_000
    st["gc_ns"][:] = 200_000 * rank
    st["gc_count"][:] = rank
    st["cpu_ns"][:] = 2_000_000 + 1000 * step
    st["expert_tokens"][:] = 100 * (rank + 1)
    ph = schema.empty_table("phases", 3)
    ph["step"][:] = step
    ph["phase"][:] = [FWD, FWD, BWD]
    ph["t0"][:] = [t, t + 500_000, t + 1_000_000]
    ph["t1"][:] = [t + 400_000, t + 900_000, t + 2_000_000]
    ph["cpu_ns"][:] = [380_000, -1 if rank == 1 else 390_000, 950_000]
    return st, ph


def _job(world: int = 3, steps: int = 4) -> tuple[list[bytes], dict]:
    msgs = _hello(world)
    raw: dict[str, list] = {"steps": [], "phases": []}
    for s in range(steps):
        for r in range(world):
            st, ph = _tables(r, s)
            msgs.append(schema.steps_message(header(RUN, r, batch=s), st, ph))
            raw["steps"].append({**st, "rank": np.array([r])})
            raw["phases"].append({**ph, "rank": np.full(3, r)})
    cat = {k: {c: np.concatenate([t[c] for t in v]) for c in v[0]} for k, v in raw.items()}
    return msgs, cat


def _store(msgs: list[bytes]) -> Store:
    store = Store()
    intake = Intake(store)
    for m in msgs:
        assert intake.feed(m)
    return store


def _identities(world: int) -> dict:
    return {r: {**identity(r, world), "incarnation": 0} for r in range(world)}


def test_store_window_carries_host_columns_and_phase_cpu_as_build_window_does() -> None:
    msgs, raw = _job()
    store = _store(msgs)
    w = store.window(RUN)
    ref = build_window(job="j", run=RUN, identities=_identities(3), groups=[], **raw)
    assert_windows_equal(w, ref, skip=("health", "clock_error_ns", "manifest"))
    assert set(w.host) == set(HOST_COLUMNS) and "expert_tokens" in w.work
    assert w.host["gc_ns"][:, 0].tolist() == [0.0, 200_000.0, 400_000.0]
    assert w.host["gc_count"][2].tolist() == [2.0] * 4
    assert w.host["cpu_ns"][0].tolist() == [2_000_000.0 + 1000 * s for s in range(4)]
    assert w.work["expert_tokens"][:, 0].tolist() == [100.0, 200.0, 300.0]
    # Σ over the forward spans; rank 1 has one span of unknown CPU time: unknown.
    fwd = w.phase_cpu_ns["forward"]
    assert fwd[0].tolist() == [770_000.0] * 4 and fwd[2].tolist() == [770_000.0] * 4
    assert np.isnan(fwd[1]).all()
    assert w.phase_cpu_ns["backward"][1].tolist() == [950_000.0] * 4
    # Phases no span reported CPU time of are absent; a phase with none in a cell is 0.
    assert set(w.phase_cpu_ns) == {"forward", "backward"}
    assert store.health["rejects"] == {}


def _without_new_columns(data: bytes) -> bytes:
    """The message as an older collector sends it: none of the optional columns."""
    m = msgpack.unpackb(data, raw=False)
    for name, cols in schema.OPTIONAL_COLUMNS.items():
        table = m["tables"].get(name)
        if table is not None:
            for c in cols:
                del table["cols"][c]
    return msgpack.packb(m, use_bin_type=True)


def test_a_message_without_the_new_columns_validates_and_reads_as_unknown() -> None:
    msgs, raw = _job(world=2, steps=3)
    old = [_without_new_columns(m) if schema.decode(m).kind == "steps" else m for m in msgs]
    dec = schema.decode(old[-1])
    assert (dec.tables["steps"]["cpu_ns"] == -1).all() and (
        dec.tables["phases"]["cpu_ns"] == -1
    ).all()
    store = _store(old)
    w = store.window(RUN)
    assert w.present.all()
    for name in HOST_COLUMNS:
        assert np.isnan(w.host[name]).all(), name
    assert np.isnan(w.work["expert_tokens"]).all()
    assert w.phase_cpu_ns == {}
    assert w.phase_ns["forward"][0, 0] == 800_000.0  # the old columns are intact
    assert store.health["rejects"] == {}
    # build_window takes tables without the columns too.
    old_raw = {
        "steps": {
            k: v for k, v in raw["steps"].items() if k not in schema.OPTIONAL_COLUMNS["steps"]
        },
        "phases": {k: v for k, v in raw["phases"].items() if k != "cpu_ns"},
    }
    ref = build_window(job="j", run=RUN, identities=_identities(2), groups=[], **old_raw)
    assert_windows_equal(w, ref, skip=("health", "clock_error_ns", "manifest"))
    # And the encoder fills absent optional columns, so such tables can still be sent.
    st = schema.empty_table("steps", 2)
    for c in schema.OPTIONAL_COLUMNS["steps"]:
        del st[c]
    data = schema.steps_message(header(RUN, 0), st)
    assert (schema.decode(data).tables["steps"]["gc_ns"] == -1).all()


def test_a_newer_sender_with_unknown_columns_still_decodes() -> None:
    st, ph = _tables(0, 0)
    m = msgpack.unpackb(schema.steps_message(header(RUN, 0), st, ph), raw=False)
    m["tables"]["steps"]["cols"]["future_column"] = b"\x00" * 8
    dec = schema.decode(msgpack.packb(m, use_bin_type=True))
    assert "future_column" not in dec.tables["steps"]
    assert int(dec.tables["steps"]["cpu_ns"][0]) == 2_000_000


def test_hostile_host_values_are_read_as_unknown_and_counted() -> None:
    msgs = _hello(1)
    st, ph = _tables(0, 0)
    st["gc_ns"][:] = -5  # below the unknown mark
    st["cpu_ns"][:] = 10 * STEP_NS  # ten times the step's wall time
    st["gc_count"][:] = -3
    st["expert_tokens"][:] = -(1 << 40)
    ph["cpu_ns"][:] = [1 << 62, 123, -7]
    msgs.append(schema.steps_message(header(RUN, 0), st, ph))
    # A batch of several steps takes the vectorized path.
    many = schema.empty_table("steps", 20)
    many["step"][:] = np.arange(1, 21)
    many["t_start"][:] = BASE + many["step"] * STEP_NS
    many["t_end"][:] = many["t_start"] + 1_000_000
    many["cpu_ns"][:] = 900_000
    many["cpu_ns"][[3, 7]] = [5_000_000, -9]
    many["gc_ns"][:] = 0
    msgs.append(schema.steps_message(header(RUN, 0, batch=1), many))
    store = _store(msgs)
    w = store.window(RUN)
    assert w.present.all()
    assert store.health["rejects"] == {"bad_host_value": 4 + 2 + 2}
    for name in HOST_COLUMNS:
        assert np.isnan(w.host[name][0, 0]), name
    assert np.isnan(w.work["expert_tokens"][0, 0])
    cpu = w.host["cpu_ns"][0, 1:]
    assert np.isnan(cpu[[3, 7]]).all() and (np.delete(cpu, [3, 7]) == 900_000).all()
    assert (w.host["gc_ns"][0, 1:] == 0).all()
    # Of the two forward spans one is refused (unknown): the cell is unknown. The backward
    # span's -7 is refused too, and no other backward span has a CPU time.
    assert np.isnan(w.phase_cpu_ns["forward"][0, 0])
    assert "backward" not in w.phase_cpu_ns
    assert w.step_ns[0, 0] == 3_000_000.0  # the rest of the step is kept


def test_since_slices_host_and_phase_cpu() -> None:
    msgs, _ = _job(world=2, steps=5)
    w = _store(msgs).window(RUN)
    later = since(w, 2)
    assert later.steps.tolist() == [2, 3, 4]
    assert set(later.host) == set(HOST_COLUMNS) and set(later.phase_cpu_ns) == set(w.phase_cpu_ns)
    for d, full in ((later.host, w.host), (later.phase_cpu_ns, w.phase_cpu_ns)):
        for name, arr in d.items():
            assert arr.shape == (2, 3), name
            np.testing.assert_array_equal(arr, full[name][:, 2:])
    assert later.work["expert_tokens"].shape == (2, 3)
    assert set(WORK_COLUMNS) == set(later.work)


def test_a_recording_of_old_and_new_senders_replays_to_the_same_window(tmp_path) -> None:
    from rankscope.hub.recording import RecordingWriter
    from rankscope.hub.replay import load

    msgs, _ = _job(world=2, steps=3)
    # Rank 1 is an older collector; a step of rank 0 carries an impossible CPU time.
    mixed = [
        _without_new_columns(m)
        if (d := schema.decode(m)).kind == "steps" and d.header["rank"]
        else m
        for m in msgs
    ]
    st, ph = _tables(0, 3)
    st["cpu_ns"][:] = -12
    mixed.append(schema.steps_message(header(RUN, 0, batch=9), st, ph))
    live = Store()
    writer = RecordingWriter(tmp_path, flush_s=0.0)
    intake = Intake(live, recorder=writer)
    for m in mixed:
        assert intake.feed(m)
    writer.close()
    replayed = load(tmp_path)
    a, b = live.window(RUN), replayed.window(RUN)
    assert_windows_equal(a, b, skip=("health",))
    assert np.isnan(b.host["cpu_ns"][0, 3]) and np.isnan(b.host["cpu_ns"][1]).all()
    assert (b.host["cpu_ns"][0, :3] > 0).all()
    assert replayed.health["rejects"] == live.health["rejects"] == {"bad_host_value": 1}


def test_a_run_queue_delay_the_step_cannot_hold_is_unknown_and_counted() -> None:
    # The thread cannot wait for a core longer than its step lasted, nor a negative time.
    msgs = _hello(1)
    many = schema.empty_table("steps", 4)
    many["step"][:] = np.arange(4)
    many["t_start"][:] = BASE + many["step"] * STEP_NS
    many["t_end"][:] = many["t_start"] + 1_000_000
    many["runq_ns"][:] = [200_000, 10 * 1_000_000, -4, 1 << 62]
    msgs.append(schema.steps_message(header(RUN, 0), many))
    store = _store(msgs)
    q = store.window(RUN).host["runq_ns"][0]
    assert q[0] == 200_000 and np.isnan(q[1:]).all(), q
    assert store.health["rejects"] == {"bad_host_value": 3}
