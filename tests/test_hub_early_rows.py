"""Rows that reach the hub before their step: the collector ships the collective and phase
rows of a step that has run for a second (``collector.pump.HOLD_NS``) without waiting for
its end, so a long step's rows come in messages ahead of its step row. The store must
count them in that step's cell as if they had come with it."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from test_hub_job import assert_windows_equal, header
from test_hub_matching import RUN, reference, single_group_job

from rankscope.collector import schema
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store


def _split(message: bytes, phases: dict[str, np.ndarray] | None) -> tuple[bytes, bytes]:
    """One steps message as two: its collectives (and ``phases``) first, under an empty
    step table, then its step row alone."""
    m = msgpack.unpackb(message)
    tables = m["tables"]
    st = {k: np.frombuffer(v, schema.STEP_COLUMNS[k]) for k, v in tables["steps"]["cols"].items()}
    co = {k: np.frombuffer(v, schema.COLL_COLUMNS[k]) for k, v in tables["colls"]["cols"].items()}
    rank, batch = m["rank"], m["batch"]
    early = schema.steps_message(
        header(RUN, rank, batch=2 * batch),
        schema.empty_table("steps", 0),
        phases=phases,
        colls=co,
    )
    late = schema.steps_message(header(RUN, rank, batch=2 * batch + 1), st)
    return early, late


@pytest.mark.parametrize("settle_between", [False, True])
def test_rows_before_their_step_count_in_its_cell(settle_between: bool) -> None:
    head, body, raw, groups = single_group_job(world=4, steps=6, colls=5)
    store = Store(raw_steps=100)
    intake = Intake(store)
    for message in head:
        assert intake.feed(message)
    long_step = 3
    for message in body:
        m = msgpack.unpackb(message)
        step = int(np.frombuffer(m["tables"]["steps"]["cols"]["step"], np.int64)[0])
        if step != long_step:
            assert intake.feed(message)
            continue
        fwd = schema.empty_table("phases", 1)
        fwd["step"][:] = step
        fwd["phase"][:] = schema.PHASE_INDEX["forward"]
        fwd["t0"][:] = 1_000 + m["rank"]
        fwd["t1"][:] = 3_000_000 + 1_000 + m["rank"]
        early, late = _split(message, fwd)
        assert intake.feed(early)
        if settle_between:
            store.settle()  # a matching pass runs before the step row comes
        assert intake.feed(late)
    w = store.window(RUN)
    assert_windows_equal(
        w, reference(raw, groups, 4), skip=("health", "clock_error_ns", "phase_ns")
    )
    col = int(np.flatnonzero(w.steps == long_step)[0])
    assert np.all(w.coll["n"][:, col] == 5)
    np.testing.assert_array_equal(w.phase_ns["forward"][:, col], 3_000_000)
    assert w.present[:, col].all()
    assert store.totals(RUN).instances_complete == 30
