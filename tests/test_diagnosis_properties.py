"""Properties of the diagnosis that must hold for any window (hypothesis)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rankscope.collector import schema
from rankscope.diagnosis.critical import critical_path
from rankscope.diagnosis.decomposition import decompose
from rankscope.diagnosis.engine import diagnose
from rankscope.diagnosis.synthetic import instance_table, make_groups, make_window, rank_layout
from rankscope.diagnosis.window import Window

PHASE_NAMES = ("input", "forward", "backward", "optimizer", "memory", "checkpoint", "pp_wait")


@st.composite
def windows(draw) -> Window:
    """Random windows: ranks × steps with random phases, waits, transfers and instances."""
    n_ranks = draw(st.sampled_from([2, 4, 8, 16]))
    n_steps = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    step = rng.uniform(1e6, 5e6, (n_ranks, n_steps))
    t_start = np.cumsum(np.full((n_ranks, n_steps), 6e6), axis=1)
    phases = {}
    for name in PHASE_NAMES:
        if rng.random() < 0.7:
            phases[name] = rng.uniform(0, 0.5, (n_ranks, n_steps)) * step
    coll = {
        "n": rng.integers(0, 5, (n_ranks, n_steps)).astype(float),
        "exposed_wait_ns": rng.uniform(0, 0.5, (n_ranks, n_steps)) * step,
        "exposed_transfer_ns": rng.uniform(0, 0.5, (n_ranks, n_steps)) * step,
        "late_ns": rng.uniform(0, 1e5, (n_ranks, n_steps)),
    }
    present = rng.random((n_ranks, n_steps)) > 0.1
    present[:, 0] = True
    ranks = rank_layout(n_ranks, ranks_per_host=2)
    members = [list(range(n_ranks))] + [[r, r + 1] for r in range(0, n_ranks, 2)]
    groups = make_groups(ranks, members, names=["world"] + [f"tp{i}" for i in range(n_ranks // 2)])
    n_inst = draw(st.integers(0, 40))
    g = rng.integers(0, len(members), n_inst)
    first = rng.uniform(0, 1e6, n_inst)
    inst = instance_table(
        group=g,
        seq=np.arange(n_inst),
        step=rng.integers(0, n_steps, n_inst),
        op=np.full(n_inst, schema.OP_INDEX["all_reduce"]),
        nbytes=rng.integers(1, 1 << 24, n_inst),
        n_members=np.array([len(members[i]) for i in g]),
        first=first,
        last=first + rng.uniform(0, 1e5, n_inst),
        last_rank=np.array([members[i][rng.integers(len(members[i]))] for i in g]),
        margin=rng.uniform(0, 1e4, n_inst),
        transfer=rng.uniform(1e3, 1e5, n_inst),
    )
    work = {
        "tokens": rng.integers(1000, 9000, (n_ranks, n_steps)).astype(float),
        "attn_cost": rng.uniform(1e6, 1e8, (n_ranks, n_steps)),
    }
    return make_window(
        t_start,
        t_start + step,
        ranks=ranks,
        groups=groups,
        phase_ns=phases,
        coll=coll,
        instances=inst,
        work=work,
        present=present,
        clock_error_ns=rng.uniform(0, 1e3, n_ranks),
    )


@settings(max_examples=60, deadline=None)
@given(windows())
def test_categories_sum_to_step_time(w: Window) -> None:
    d = decompose(w)
    total = d.ns.sum(axis=0)
    step = w.step_ns
    ok = w.present
    assert np.allclose(total[ok], step[ok], rtol=1e-9, atol=1e-6)
    assert (d.ns[:, ok] >= -1e-9).all()
    assert np.isnan(d.ns[:, ~ok]).all()


def _permute(w: Window, perm: np.ndarray) -> Window:
    """The same run with global rank r renamed perm[r]."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)

    def rows(a: np.ndarray) -> np.ndarray:
        return a[inv]

    ri = w.ranks
    ranks = type(ri)(
        **{
            k: (rows(v) if isinstance(v, np.ndarray) else v)
            for k, v in ri.__dict__.items()
            if k != "mesh"
        },
        mesh={k: rows(v) for k, v in ri.mesh.items()},
    )
    groups = {
        gid: type(g)(g.id, g.name, tuple(int(perm[r]) for r in g.ranks), g.crosses_hosts)
        for gid, g in w.groups.items()
    }
    inst = w.instances
    inst2 = type(inst)(**{**inst.__dict__, "last_rank": perm[inst.last_rank].astype(np.int32)})
    fields = dict(w.__dict__)
    fields.update(
        ranks=ranks,
        groups=groups,
        instances=inst2,
        present=rows(w.present),
        t_start=rows(w.t_start),
        t_end=rows(w.t_end),
        phase_ns={k: rows(v) for k, v in w.phase_ns.items()},
        work={k: rows(v) for k, v in w.work.items()},
        memory={k: rows(v) for k, v in w.memory.items()},
        device={k: rows(v) for k, v in w.device.items()},
        coll={k: rows(v) for k, v in w.coll.items()},
        host={k: rows(v) for k, v in w.host.items()},
        phase_cpu_ns={k: rows(v) for k, v in w.phase_cpu_ns.items()},
        clock_error_ns=rows(w.clock_error_ns),
    )
    return Window(**fields)


@settings(max_examples=40, deadline=None)
@given(windows(), st.integers(0, 2**31 - 1))
def test_permuting_rank_ids_permutes_the_result(w: Window, seed: int) -> None:
    perm = np.random.default_rng(seed).permutation(w.world_size)
    wp = _permute(w, perm)
    d, dp = decompose(w), decompose(wp)
    assert np.allclose(dp.ns[:, perm], d.ns, equal_nan=True)
    c, cp = critical_path(w, d), critical_path(wp, dp)
    assert (cp.times_last[perm] == c.times_last).all()
    assert (cp.times_last_decisive[perm] == c.times_last_decisive).all()
    assert np.allclose(cp.late_mean_ns[perm], c.late_mean_ns, equal_nan=True)
    assert cp.ties == c.ties
    # The busiest rank is the same rank under its new name (when unique).
    busy = w.step_ns - d.category("arrival_wait") - d.category("pipeline_idle")
    for j in range(busy.shape[1]):
        col = np.where(np.isfinite(busy[:, j]), busy[:, j], -np.inf)
        if np.isfinite(col).any() and (col == col.max()).sum() == 1:
            assert cp.critical_rank[j] == perm[c.critical_rank[j]]
    full, fullp = diagnose(w), diagnose(wp)
    assert fullp.verdict.top.mechanism == full.verdict.top.mechanism
    top, topp = full.verdict.top, fullp.verdict.top
    assert sorted(topp.ranks) == sorted(int(perm[r]) for r in top.ranks)
    assert np.allclose(
        fullp.correlations.slow_rank.persistent[perm],
        full.correlations.slow_rank.persistent,
        equal_nan=True,
    )


@settings(max_examples=25, deadline=None)
@given(windows())
def test_any_window_renders_as_strict_json_and_text(w: Window) -> None:
    import json

    from rankscope.diagnosis.serialize import to_dict
    from rankscope.diagnosis.text import render_text
    from rankscope.diagnosis.verdict import MECHANISMS

    d = diagnose(w)
    data = json.loads(json.dumps(to_dict(d), allow_nan=False))
    assert data["verdict"]["hypotheses"][0]["mechanism"] == d.verdict.top.mechanism
    assert {h.mechanism for h in d.verdict.hypotheses} == set(MECHANISMS)
    assert all(0.0 <= h.score <= 1.0 for h in d.verdict.hypotheses)
    assert render_text(d).startswith(f"run {w.run}")


def test_degenerate_windows_are_diagnosed() -> None:
    import warnings

    one = np.array([[0.0, 10.0]])
    grid = np.tile(np.arange(3) * 10.0, (4, 1))
    absent = np.full((4, 3), np.nan)
    absent[:, 0] = 5
    cases = [
        make_window(one, one + 5, ranks=rank_layout(1, ranks_per_host=1)),
        make_window(grid, grid + 5, ranks=rank_layout(4)),
        make_window(grid, grid + absent, ranks=rank_layout(4)),
        make_window(grid[:, :1], grid[:, :1] + 5, ranks=rank_layout(4)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for w in cases:
            assert diagnose(w).verdict.top.mechanism == "healthy"
