"""Message streams the hub accepts but that are unusual: every reader still answers.

Found by feeding perturbed simulator streams (dropped, repeated, reordered messages and
edited tables) to the readers of a recording; each test holds one such stream to a window
and a diagnosis instead of a traceback.
"""

from __future__ import annotations

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis import diagnose
from rankscope.diagnosis.assemble import device_means
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store
from rankscope.sim import Cluster, load_scenario
from rankscope.sim.emit import Kept, RankStreams

T0 = 1_700_000_000_000_000_000


@pytest.fixture(scope="module")
def messages() -> list[tuple[int, bytes]]:
    scenario = load_scenario("healthy", ranks=16, topology__gpus_per_host=8, seed=0)
    cluster = Cluster(scenario, t0_ns=T0)
    keep = Kept()
    streams = RankStreams(cluster, keep, run_id="r", scope="full")
    streams.start()
    for k in range(4):
        streams.add(cluster.step(k))
    streams.finish()
    return keep.out


def _unknown_step_times(data: bytes, columns: tuple[str, ...]) -> bytes:
    """A steps message with ``columns`` of its steps table unknown (``NO_TIME``)."""
    m = schema.decode(data)
    if m.kind != "steps":
        return data
    steps = {k: np.array(v) for k, v in m.tables["steps"].items()}
    for c in columns:
        steps[c][:] = schema.NO_TIME
    header = {k: m.header[k] for k in ("job", "run", "rank", "inc", "batch")}
    return schema.steps_message(
        header, steps, m.tables.get("phases"), m.tables.get("colls"), m.header["phase_names"]
    )


@pytest.mark.parametrize("columns", [("t_start",), ("t_end",), ("t_start", "t_end")])
def test_steps_of_unknown_span_with_samples_still_give_a_window(
    messages: list[tuple[int, bytes]], columns: tuple[str, ...]
) -> None:
    # Every rank's steps arrive with an unknown start or end (NO_TIME, which the hub
    # accepts), and the device samples arrive as usual: no sample falls in a step.
    store = Store(history_steps=64, raw_steps=16)
    taken = Intake(store).feed_many([_unknown_step_times(d, columns) for _, d in messages], 0)
    assert taken == len(messages)
    store.settle()
    w = store.window("r")
    assert w.steps.shape[0] == 4
    assert all(np.isnan(v).all() for v in w.device.values())
    diagnose(w)


def test_device_means_of_step_rows_without_a_known_span_are_unknown() -> None:
    steps = np.arange(2)
    rows = {
        "rank": np.array([0, 0, 1]),
        "step": np.array([0, 1, 0]),
        "t_start": np.array([schema.NO_TIME, 10, 0]),
        "t_end": np.array([5, schema.NO_TIME, schema.NO_TIME]),
    }
    samples = {c: np.zeros(3, dt) for c, dt in schema.SAMPLE_COLUMNS.items()}
    samples["t"] = np.array([1, 2, 11])
    samples["rank"] = np.array([0, 1, 0])
    out = device_means(samples, rows, 2, steps)
    assert all(v.shape == (2, 2) and np.isnan(v).all() for v in out.values())
