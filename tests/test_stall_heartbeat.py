"""Heartbeats: the wire kind, the hub's strict checks, and the hang judge on known cases."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.collector.heartbeat import inside_collective
from rankscope.collector.stacks import python_stacks
from rankscope.diagnosis.stall import STALL_S, judge_hang, stall_threshold_s
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store

S = 1_000_000_000
HEADER = {"job": "j", "run": "r", "rank": 0, "inc": 0, "batch": 1}
POS = {k: -1 for k in schema.BEAT_POS_FIELDS}


def _hello(rank: int, world: int = 2) -> bytes:
    ident = {
        "rank": rank,
        "world_size": world,
        "local_rank": rank,
        "host": "h",
        "node_rank": 0,
        "pid": 1,
    }
    return schema.hello_message({**HEADER, "rank": rank}, ident)


def _intake() -> tuple[Store, Intake]:
    store = Store()
    intake = Intake(store)
    for r in range(2):
        assert intake.feed(_hello(r))
    return store, intake


def test_a_beat_round_trips_and_lands_in_the_run():
    store, intake = _intake()
    pos = {**POS, "t": 5 * S, "step": 3, "group": 0, "seq": 7, "op": 0, "since": 4 * S}
    data = schema.beat_message({**HEADER, "rank": 1}, pos, stacks={"py": "x", "why": "y"})
    assert intake.feed(data, t_recv_ns=6 * S)
    beats = store.run_state("r").beats
    assert beats.count == 1 and beats.pos[1][schema.BEAT_POS_FIELDS.index("seq")] == 7
    assert beats.heard_ns[1] == 6 * S and beats.stacks[1]["py"] == "x"
    assert len(data) < 300  # the wire cost the heartbeat module states (~190 B)


def _raw(**fields) -> bytes:
    msg = {**HEADER, "kind": "beat", "v": schema.SCHEMA_VERSION, "pos": dict(POS), **fields}
    return msgpack.packb(msg, use_bin_type=True)


@pytest.mark.parametrize(
    "fields",
    [
        {"pos": "nope"},
        {"pos": {**POS, "step": "3"}},
        {"pos": {**POS, "seq": -5}},
        {"pos": {**POS, "op": len(schema.OPS)}},
        {"pos": {**POS, "t": 2**63 - 1}},
        {"pos": {**POS, "group": True}},
        {"state": "zombie"},
        {"stacks": {"py": "x" * (schema.MAX_STACK_CHARS + 1)}},
        {"stacks": {"evil": "x"}},
        {"stacks": {"py": 3}},
        {"stacks": ["py"]},
        {"pos": {f"k{i}": 0 for i in range(100)}},
    ],
)
def test_a_hostile_beat_is_refused_and_counted(fields):
    store, intake = _intake()
    assert not intake.feed(_raw(**fields))
    rejects = store.health["rejects"]
    assert sum(rejects.values()) == 1 and set(rejects) <= {"bad_beat", "bad_type"}, rejects
    assert store.run_state("r").beats.count == 0


def test_a_beat_before_hello_is_refused():
    store = Store()
    assert not Intake(store).feed(schema.beat_message(HEADER, dict(POS)))
    assert store.health["rejects"].get("unknown_rank") == 1


def test_stacks_are_held_for_a_bounded_number_of_ranks():
    from rankscope.hub.runstate import MAX_STACK_RANKS, Beats

    b = Beats(1000)
    for r in range(MAX_STACK_RANKS + 10):
        b.add(r, {"pos": POS, "stacks": {"py": "s"}}, r)
    assert len(b.stacks) == MAX_STACK_RANKS and min(b.stacks) == 10


def _beats(n: int, now: int, **cols) -> dict[str, np.ndarray]:
    out = {k: np.full(n, -1, np.int64) for k in schema.BEAT_POS_FIELDS}
    out["heard_ns"] = np.full(n, now - S // 2, np.int64)
    out["state"] = np.ones(n, np.int8)
    out["run_group"] = np.full(n, -1, np.int64)
    for k, v in cols.items():
        out[k] = np.asarray(v, out[k].dtype if k in out else np.int64)
    return out


GROUPS = {0: ((0, 1, 2, 3), "world"), 1: ((0, 1, 2, 3), "side")}
NOW = 1000 * S
STEPS = np.full(20, 0.1 * S)


def test_not_entered_names_the_rank_outside_and_what_the_others_wait_in():
    inside = [0, -1, 0, 0]
    b = _beats(4, NOW, step=[5] * 4, step_t0=[NOW - 30 * S] * 4, group=inside, seq=[9, -1, 9, 9],
               op=[0, -1, 0, 0], since=[NOW - 20 * S, -1, NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    h = judge_hang(b, NOW, STEPS, GROUPS, {1: "node7"})
    assert h.stalled and h.case == "not_entered"
    assert [(c.rank, c.host, c.group, c.seq, c.op) for c in h.culprits] == [
        (1, "node7", 0, 9, "all_reduce")
    ]
    assert [w.where for w in h.waiting] == [
        "in world:all_reduce#9", "step 5, outside collectives", "in world:all_reduce#9", "in world:all_reduce#9",
    ]  # fmt: skip


def test_a_silent_rank_is_gone_and_a_closing_beat_is_exit():
    b = _beats(4, NOW, step=[5] * 4, group=[0, -1, 0, 0], seq=[9, -1, 9, 9], op=[0, -1, 0, 0],
               since=[NOW - 20 * S, -1, NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    b["heard_ns"][1] = NOW - 30 * S
    h = judge_hang(b, NOW, STEPS, GROUPS)
    assert h.stalled and [(c.rank, c.case, c.seq) for c in h.culprits] == [(1, "gone", 9)]
    b["heard_ns"][1] = NOW
    b["state"][1] = 2
    h = judge_hang(b, NOW, STEPS, GROUPS)
    assert [(c.rank, c.case) for c in h.culprits] == [(1, "gone")] and "exited" in h.culprits[
        0
    ].detail


def test_a_rank_that_left_by_an_error_inside_a_collective_is_not_the_culprit():
    b = _beats(2, NOW, step=[5, 5], step_t0=[NOW - 30 * S] * 2, state=[2, 2], run_group=[0, -1])
    b["error"] = np.array([1, 0], np.int8)
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")})
    assert h.stalled and [(c.rank, c.case) for c in h.culprits] == [(1, "gone")]
    b["error"][:] = 0  # every rank closed without an error: the job finished
    assert not judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")}).stalled


def test_mismatch_names_the_rank_that_went_past():
    # Rank 1 skipped world#9 in step 5 and waits in side#4 of step 6; rank 0 waits in world#9.
    b = _beats(2, NOW, step=[5, 6], group=[0, 1], seq=[9, 4], op=[0, 0],
               since=[NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world"), 1: ((0, 1), "side")})
    assert h.stalled and [(c.rank, c.case, c.group, c.seq) for c in h.culprits] == [
        (1, "mismatch", 0, 9)
    ]


def test_every_member_inside_is_a_transfer_hang():
    b = _beats(2, NOW, step=[5, 5], group=[0, 0], seq=[9, 9], op=[0, 0], since=[NOW - 20 * S] * 2)
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")})
    assert h.stalled and h.case == "in_transfer" and [c.rank for c in h.culprits] == [0, 1]


def test_no_stall_within_what_the_steps_make_plausible():
    since = [NOW - 20 * S, -1]
    b = _beats(2, NOW, step=[5, 5], group=[0, -1], seq=[9, -1], op=[0, -1], since=since)
    assert judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")}).stalled
    slow = np.full(20, 15.0 * S)  # 15 s steps: 20 s without progress is not yet a stall
    h = judge_hang(b, NOW, slow, {0: ((0, 1), "world")})
    assert not h.stalled and h.culprits == () and h.threshold_s == 30.0
    assert stall_threshold_s(np.zeros(0)) == STALL_S


def test_ranks_all_busy_outside_collectives_are_not_hung():
    b = _beats(2, NOW, step=[0, 0], step_t0=[NOW - 60 * S] * 2)
    assert not judge_hang(b, NOW, np.zeros(0), {0: ((0, 1), "world")}).stalled


def test_the_heartbeat_finds_the_collective_a_thread_is_inside():
    pytest.importorskip("torch")
    from rankscope.collector import torch_collectives

    inside = threading.Event()
    release = threading.Event()

    def fn(tensor, op=None, group=None, async_op=False):
        inside.set()
        release.wait(10)

    wrapped = torch_collectives._wrap(fn, "all_reduce", "tensor", torch_collectives._T)
    state = torch_collectives._state
    old = state.mon

    class Quiet:  # a monitor that records nothing
        def _rec_coll(self, *a):
            return -1

        def _error(self, *a):
            pass

    state.mon = Quiet()
    try:
        t = threading.Thread(target=wrapped, args=(np.zeros(4),))
        t.start()
        assert inside.wait(10)
        import sys

        got = inside_collective(sys._current_frames()[t.ident])
        text = python_stacks(first=t.ident)
        release.set()
        t.join(10)
    finally:
        state.mon = old
        release.set()
    assert got is not None and got[0] == schema.OP_INDEX["all_reduce"] and got[1] == 0
    assert got[2] <= time.monotonic_ns()
    assert "training thread" in text and "in fn" in text
