"""`build_window`: a complete Window from raw tables, checked cell by cell."""

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.diagnosis.arrivals import build_window
from rankscope.diagnosis.window import COLL_AGGREGATES, DEVICE_COLUMNS

BASE = 1_700_000_000_000_000_000


def table(name: str, rank: list[int], **cols) -> dict[str, np.ndarray]:
    t = schema.empty_table(name, len(rank))
    for c, v in cols.items():
        t[c][:] = v
    t["rank"] = np.array(rank, dtype=np.int32)
    return t


def identities() -> dict[int, dict]:
    return {
        r: {
            "rank": r,
            "world_size": 3,
            "local_rank": r % 2,
            "host": "b-host" if r < 2 else "a-host",
            "node_rank": r // 2,
            "pid": 100 + r,
            "rail": r % 2,
            "mesh": {"dp": r},
            "incarnation": 1 if r == 2 else 0,
        }
        for r in range(3)
    }


def small_window(**kw):
    # Ranks 0 and 2 report steps 10 and 11; rank 1 only step 11 (step 10 lost).
    steps = table(
        "steps",
        [0, 2, 0, 1, 2],
        step=[10, 10, 11, 11, 11],
        t_start=[BASE + 0, BASE + 5, BASE + 1000, BASE + 1010, BASE + 1005],
        t_end=[BASE + 900, BASE + 950, BASE + 2000, BASE + 2010, BASE + 1990],
        tokens=[100, 200, 300, -1, 500],
        attn_cost=[1.5, 2.5, np.nan, 4.0, 5.0],
    )
    phases = table(
        "phases",
        [0, 0, 0, 1],
        step=[10, 10, 11, 11],
        phase=[schema.PHASE_INDEX["forward"], schema.PHASE_INDEX["forward"], 9, 0],
        t0=[BASE + 0, BASE + 500, BASE + 1000, BASE + 1010],
        t1=[BASE + 100, BASE + 550, BASE + 1100, BASE + 1020],
    )
    colls = table(
        "colls",
        [0, 1, 2, 0, 2],
        step=[11, 11, 11, 10, 10],
        group=[0, 0, 0, 1, 1],
        seq=[0, 0, 0, 0, 0],
        t_enter=[BASE + 1500, BASE + 1600, BASE + 1550, BASE + 800, BASE + 700],
        t_exit=[BASE + 1700, BASE + 1700, BASE + 1700, BASE + 850, BASE + 850],
        nbytes=[8, 8, 8, 4, 4],
        op=0,
        flags=0,
    )
    samples = table(
        "samples",
        [0, 0, 0, 2],
        t=[BASE + 100, BASE + 200, BASE + 1500, BASE + 3000],
        sm_clock_mhz=[1000.0, 1400.0, np.nan, 900.0],
        throttle=[1, 4, -1, 2],
        rss_bytes=[10, -1, 30, 40],
    )
    groups = [
        {"id": 0, "name": "world", "ranks": [0, 1, 2]},
        {"id": 1, "name": "pair", "ranks": [0, 2]},
    ]
    return build_window(
        job="j",
        run="r1",
        identities=identities(),
        groups=groups,
        steps=steps,
        phases=phases,
        colls=colls,
        samples=samples,
        phase_names=["mine"],
        manifest={"torch": "2.13"},
        **kw,
    )


def test_dense_step_grid_and_origin() -> None:
    w = small_window()
    assert w.t0_ns == BASE
    assert w.steps.tolist() == [10, 11]
    assert w.world_size == 3
    assert w.present.tolist() == [[True, True], [False, True], [True, True]]
    assert w.t_start[0].tolist() == [0.0, 1000.0]
    assert np.isnan(w.t_start[1, 0]) and w.t_start[1, 1] == 1010.0
    assert w.step_ns[2].tolist() == [945.0, 985.0]
    assert w.work["tokens"][:, 1].tolist()[0] == 300.0
    assert np.isnan(w.work["tokens"][1, 1])  # -1 means unknown
    assert np.isnan(w.work["attn_cost"][0, 1])
    assert w.manifest == {"torch": "2.13"}


def test_identities_and_groups() -> None:
    w = small_window()
    assert w.ranks.hosts == ("a-host", "b-host")
    assert w.ranks.host.tolist() == [1, 1, 0]
    assert w.ranks.rail.tolist() == [0, 1, 0]
    assert w.ranks.mesh["dp"].tolist() == [0, 1, 2]
    assert w.ranks.mesh["tp"].tolist() == [-1, -1, -1]
    assert w.ranks.incarnation.tolist() == [0, 0, 1]
    assert w.ranks.gpu_index.tolist() == [-1, -1, -1]
    assert w.groups[0].crosses_hosts and w.groups[0].name == "world"
    assert w.groups[1].ranks == (0, 2) and w.groups[1].crosses_hosts


def test_phases_are_summed_by_name_and_masked_where_absent() -> None:
    w = small_window()
    assert w.phase_ns["forward"][0].tolist() == [150.0, 0.0]
    assert w.phase_ns["mine"][0].tolist() == [0.0, 100.0]
    assert w.phase_ns["input"][1, 1] == 10.0
    assert np.isnan(w.phase_ns["forward"][1, 0])
    assert set(schema.PHASES) <= set(w.phase_ns)


def test_collectives_match_and_aggregate() -> None:
    w = small_window()
    inst = w.instances
    assert inst.group.tolist() == [0, 1]
    assert inst.last_rank.tolist() == [1, 0]
    assert inst.first.tolist() == [1500.0, 700.0]
    assert inst.skew.tolist() == [100.0, 100.0]
    assert w.coll["times_last"].tolist()[1] == [pytest.approx(np.nan, nan_ok=True), 1.0]
    assert w.coll["late_ns"][:, 1].tolist() == [0.0, 100.0, 50.0]
    assert w.coll["wait_ns"][:, 0].tolist()[0] == 0.0
    assert w.coll["wait_ns"][2, 0] == 100.0
    assert set(w.coll) == set(COLL_AGGREGATES)
    assert len(w.rows) == 5 and w.rows.t_enter.min() == 700.0


def test_device_samples_fall_into_their_step() -> None:
    w = small_window()
    assert w.device["sm_clock_mhz"][0].tolist()[0] == 1200.0
    assert np.isnan(w.device["sm_clock_mhz"][0, 1])  # the one sample there is NaN
    assert w.device["throttle"][0, 0] == 5.0  # 1 | 4
    assert np.isnan(w.device["throttle"][0, 1])
    assert w.device["rss_bytes"][0].tolist() == [10.0, 30.0]
    assert np.isnan(w.device["sm_clock_mhz"][2]).all()  # rank 2's sample is after its steps
    assert set(w.device) == set(DEVICE_COLUMNS)


def test_last_keeps_the_most_recent_steps() -> None:
    w = small_window(last=1)
    assert w.steps.tolist() == [11]
    assert w.t0_ns == BASE + 1000
    assert w.instances.group.tolist() == [0]
    assert w.coll["late_ns"][:, 0].tolist() == [0.0, 100.0, 50.0]
    assert len(w.rows) == 3


def test_bad_tables_are_named() -> None:
    steps = table("steps", [0], step=[1], t_start=[BASE], t_end=[BASE + 1])
    del steps["tokens"]
    with pytest.raises(ValueError, match="tokens"):
        build_window(job="j", run="r", identities={}, groups=[], steps=steps)
    steps = table("steps", [0], step=[1], t_start=[BASE], t_end=[BASE + 1])
    phases = table("phases", [0], step=[1], phase=[42], t0=[BASE], t1=[BASE + 1])
    with pytest.raises(ValueError, match="phase code"):
        build_window(job="j", run="r", identities={}, groups=[], steps=steps, phases=phases)


def test_store_aggregates_agree_with_the_union_of_raw_rows(tmp_path) -> None:
    """The hub folds exposed time row by row as instances complete; the diagnosis can also
    take the union of overlapping async rows from raw rows. Both must give the same
    numbers, so the decomposition does not depend on how many raw steps the store kept."""
    from rankscope.diagnosis.exposure import exposed_union, rows_cover_window
    from rankscope.hub import replay
    from rankscope.hub.server import Hub
    from rankscope.sim import load_scenario, run

    rec = tmp_path / "rec"
    with Hub(record_dir=str(rec)) as hub:
        run(load_scenario("data-imbalance", ranks=16, seed=2), hub.endpoint, 12, run_id="u")
    w = replay.load(rec, raw_steps=64).window("u")
    assert rows_cover_window(w)
    union = exposed_union(w)
    for name in ("exposed_wait_ns", "exposed_transfer_ns"):
        seen = np.isfinite(union[name])
        assert seen.any()
        np.testing.assert_allclose(w.coll[name][seen], union[name][seen], rtol=0, atol=1.0)
    # Overlapping DDP buckets are counted once: exposed time never exceeds the step.
    exposed = w.coll["exposed_wait_ns"] + w.coll["exposed_transfer_ns"]
    assert np.all(exposed[w.present] <= w.step_ns[w.present] + 1.0)
