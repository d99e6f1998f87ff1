"""The simulated cluster's mechanics: collective semantics, per-rank timelines, scopes,
pipelines, the packers, and determinism."""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys

import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.sim import Cluster, ScopeSpec, iter_messages, load_scenario
from rankscope.sim.spec import WorkloadSpec
from rankscope.sim.workload import draw_lengths, pack_step


def _steps(cluster: Cluster, n: int) -> list:
    return [cluster.step(k) for k in range(n)]


def _cat(tables: list, name: str) -> dict[str, np.ndarray]:
    return {
        k: np.concatenate([getattr(t, name)[k] for t in tables]) for k in getattr(tables[0], name)
    }


@pytest.fixture(scope="module", params=["healthy", "pipeline", "data-imbalance"])
def run(request) -> tuple[Cluster, list]:
    if request.param == "pipeline":
        sc = load_scenario("slow-device", ranks=32, layout__tp=4, layout__pp=2)
    else:
        sc = load_scenario(request.param, ranks=32)
    cluster = Cluster(sc)
    return cluster, _steps(cluster, 4)


def test_no_collective_finishes_before_its_last_member_arrives(run) -> None:
    cluster, tables = run
    c = _cat(tables, "colls")
    # compare on the true clock: each rank's times carry its own small alignment error
    true = {
        k: c[k] - cluster.clock_offset[c["rank"]] for k in ("t_enter", "t_start", "t_end", "t_exit")
    }
    key = c["group"].astype(np.int64) << 40 | c["seq"]
    uniq, inv = np.unique(key, return_inverse=True)
    last = np.full(uniq.shape[0], np.iinfo(np.int64).min)
    np.maximum.at(last, inv, true["t_enter"])
    assert np.all(true["t_end"] > last[inv])
    assert np.all(true["t_exit"] >= true["t_end"])
    # every member leaves at the same device instant (one transfer per instance)
    lo = np.full(uniq.shape[0], np.iinfo(np.int64).max)
    np.minimum.at(lo, inv, true["t_end"])
    assert np.all(true["t_end"] == lo[inv])


def test_every_instance_has_each_member_once(run) -> None:
    cluster, tables = run
    c = _cat(tables, "colls")
    members = {g["id"]: sorted(g["ranks"]) for g in cluster.groups}
    key = c["group"].astype(np.int64) << 40 | c["seq"]
    order = np.lexsort((c["rank"], key))
    key, rank, group = key[order], c["rank"][order], c["group"][order]
    cuts = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    for a, b in itertools.pairwise(cuts):
        assert rank[a:b].tolist() == members[int(group[a])]
    # sequence numbers of a group run without gaps across steps
    for g in np.unique(c["group"]):
        seqs = np.unique(c["seq"][c["group"] == g])
        assert np.array_equal(seqs, np.arange(seqs[0], seqs[0] + seqs.shape[0]))


def test_rank_timelines_are_ordered(run) -> None:
    cluster, tables = run
    prev_end = None
    for t in tables:
        s, p, c = t.steps, t.phases, t.colls
        assert np.all(s["t_end"] > s["t_start"])
        if prev_end is not None:
            assert np.all(s["t_start"] > prev_end)
        prev_end = s["t_end"]
        assert np.all(p["t1"] >= p["t0"])
        assert np.all(p["t0"] >= s["t_start"][p["rank"]]) and np.all(
            p["t1"] <= s["t_end"][p["rank"]]
        )
        assert np.all(c["t_exit"] > c["t_enter"])
        assert np.all(c["t_enter"] >= s["t_start"][c["rank"]])
        assert np.all(c["t_exit"] <= s["t_end"][c["rank"]])
        # each rank issues its collectives in order
        for r in range(cluster.layout.world_size):
            a, b = t.coll_offsets[r], t.coll_offsets[r + 1]
            assert np.all(np.diff(c["t_enter"][a:b]) >= 0)
        w = t.steps
        assert np.all(w["valid_tokens"] <= w["tokens"]) and np.all(w["samples"] > 0)
        assert np.all(w["attn_cost"] <= w["valid_tokens"].astype(float) ** 2)


def test_pipeline_stages_exchange_activations_and_wait() -> None:
    cluster = Cluster(load_scenario("healthy", ranks=32, layout__tp=4, layout__pp=2))
    assert (cluster.layout.pp, cluster.layout.dp, cluster.layout.tp) == (2, 4, 4)
    t = cluster.step(0)
    c = t.colls
    sends, recvs = c["op"] == schema.OP_INDEX["send"], c["op"] == schema.OP_INDEX["recv"]
    accum = cluster.workload.grad_accum
    # per pipeline pair: accum forward activations and accum backward gradients
    assert sends.sum() == recvs.sum() == 2 * accum * 16
    # a stage-1 rank waits for stage 0 before its first forward: the pipeline bubble
    wait = t.phases["phase"] == schema.PHASE_INDEX["pp_wait"]
    waits = np.bincount(t.phases["rank"][wait], minlength=32)
    assert np.all(waits > 0)
    first_fwd = {}
    fwd = t.phases["phase"] == schema.PHASE_INDEX["forward"]
    for r, t0 in zip(t.phases["rank"][fwd], t.phases["t0"][fwd]):
        first_fwd.setdefault(int(r), int(t0))
    stage0 = np.mean([first_fwd[r] for r in range(16)])
    stage1 = np.mean([first_fwd[r] for r in range(16, 32)])
    assert stage1 > stage0 + 1e6


@pytest.mark.parametrize(
    ("scope", "world"),
    [
        (ScopeSpec("full"), 64),
        (ScopeSpec("two-node", hosts=("node002", "node005")), 16),
        (ScopeSpec("one-node", hosts=(3,)), 8),
        (ScopeSpec("one-rank", ranks=(13,)), 1),
    ],
)
def test_scopes_keep_local_shapes(scope: ScopeSpec, world: int) -> None:
    sc = load_scenario("healthy", topology__gpus_per_host=8)
    full, part = Cluster(sc), Cluster(sc, scope)
    assert part.layout.world_size == world
    assert part.identities[0]["world_size"] == world
    # same per-rank work per micro batch, layers per stage and gradient size
    assert part.layers == full.layers and part.grad_bytes == full.grad_bytes
    assert part.workload == full.workload
    assert part.manifest["job_config"]["micro_batch"] == full.manifest["job_config"]["micro_batch"]
    assert (
        part.manifest["job_config"]["global_batch"] < full.manifest["job_config"]["global_batch"]
        or world == 64
    )
    tokens_full = full.step(0).steps["tokens"].mean()
    tokens_part = part.step(0).steps["tokens"].mean()
    assert abs(tokens_part / tokens_full - 1.0) < 0.1
    if scope.scope == "one-rank":
        assert part.layout.device.tolist() == [full.layout.device[13]]
    if scope.hosts:
        hosts = {h if isinstance(h, int) else int(h[4:]) for h in scope.hosts}
        assert set(part.layout.hosts) == hosts


@pytest.mark.parametrize(
    ("scope", "message"),
    [
        (ScopeSpec("one-node", hosts=("node099",)), "not in this 8-host cluster"),
        (ScopeSpec("one-node", hosts=("node001", "node002")), "takes 1 host"),
        (ScopeSpec("two-node", hosts=("node001", "node001")), "repeat"),
        (ScopeSpec("one-rank", ranks=(64,)), "outside the full world"),
        (ScopeSpec("custom"), "custom scope needs hosts"),
        (ScopeSpec("half"), "unknown scope"),
        (ScopeSpec("one-node", hosts=("gpu7",)), "unknown host"),
    ],
)
def test_bad_scope_is_named(scope: ScopeSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cluster(load_scenario("healthy", topology__gpus_per_host=8), scope)


def test_steps_run_in_order() -> None:
    cluster = Cluster(load_scenario("healthy", ranks=8))
    cluster.step(0)
    with pytest.raises(ValueError, match="next is 1"):
        cluster.step(3)


def test_same_scenario_and_seed_give_identical_messages() -> None:
    a = iter_messages(load_scenario("slow-device", ranks=16), 3, run_id="x", t0_ns=10**18)
    b = iter_messages(load_scenario("slow-device", ranks=16), 3, run_id="x", t0_ns=10**18)
    assert a == b
    c = iter_messages(load_scenario("slow-device", ranks=16, seed=99), 3, run_id="x", t0_ns=10**18)
    assert a != c
    msgs = [schema.decode(m) for m in a]
    kinds = [m.kind for m in msgs]
    assert kinds.count("hello") == 16 and kinds.count("groups") == 1
    assert kinds.count("steps") == 3 * 16
    # one device sample per rank and step, sent at the sampler's own pace
    rows = [m.tables["samples"]["t"].shape[0] for m in msgs if m.kind == "samples"]
    assert sum(rows) == 3 * 16 and 16 <= len(rows) <= 3 * 16


def test_identical_across_processes() -> None:
    code = (
        "import hashlib\n"
        "from rankscope.sim import iter_messages, load_scenario\n"
        "m = iter_messages(load_scenario('checkpoint', ranks=16), 5, t0_ns=7)\n"
        "print(hashlib.sha256(b''.join(m)).hexdigest())\n"
    )
    here = hashlib.sha256(
        b"".join(iter_messages(load_scenario("checkpoint", ranks=16), 5, t0_ns=7))
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here.hexdigest()


def test_packers_balance_what_they_promise() -> None:
    spec = WorkloadSpec(seq_len=16384, grad_accum=4, tail_fraction=0.06, tail_alpha=1.0)
    w_attn = 24 * 2048 / 1.3e9
    lens = draw_lengths(spec, np.random.default_rng(5), 1_000_000)
    assert lens.sum() == 1_000_000 and lens.min() >= 1 and lens.max() <= spec.seq_len
    tok = pack_step(
        WorkloadSpec(**{**spec.__dict__, "packer": "token_balanced"}),
        np.random.default_rng(5),
        64,
        w_attn,
    )
    att = pack_step(spec, np.random.default_rng(5), 64, w_attn)
    # same documents, same valid tokens in total
    assert tok.valid_tokens.sum() == att.valid_tokens.sum()
    per_rank_tok = tok.valid_tokens.sum(axis=1)
    assert per_rank_tok.max() == per_rank_tok.min()  # tokens exactly balanced
    cost_tok = per_rank_tok + w_attn * tok.attn_cost.sum(axis=1)
    cost_att = att.valid_tokens.sum(axis=1) + w_attn * att.attn_cost.sum(axis=1)
    assert cost_att.max() / cost_att.mean() < 1.01
    assert cost_tok.max() / cost_tok.mean() > cost_att.max() / cost_att.mean() + 0.02
    # attention cost is what the token-balanced packer leaves unbalanced
    assert tok.attn_cost.sum(axis=1).max() > 1.3 * att.attn_cost.sum(axis=1).max()
    assert att.valid_tokens.sum(axis=1).max() / att.valid_tokens.sum(axis=1).mean() < 1.1


def test_merged_steps_keep_each_ranks_rows_in_order() -> None:
    from rankscope.sim import merge_steps

    cluster = Cluster(load_scenario("checkpoint", ranks=16))
    parts = _steps(cluster, 5)
    merged = merge_steps(parts)
    for r in (0, 7, 15):
        got = merged.rank_tables(r)
        for name in ("steps", "phases", "colls", "samples"):
            for col in got[name]:
                want = np.concatenate([p.rank_tables(r)[name][col] for p in parts])
                np.testing.assert_array_equal(got[name][col], want)
    assert merged.rank_tables(3)["steps"]["step"].tolist() == [0, 1, 2, 3, 4]


def test_sim_imports_only_the_collector_and_numpy() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import rankscope.sim as s\n"
        "for m in pkgutil.iter_modules(s.__path__):\n"
        "    importlib.import_module('rankscope.sim.' + m.name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] == 'torch' or k.startswith("
        "('rankscope.hub', 'rankscope.diagnosis', 'rankscope.tui', 'rankscope.launch')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_batched_messages_carry_the_same_rows() -> None:
    sc = load_scenario("healthy", ranks=16)

    def rows(per: int) -> dict[tuple[str, int], dict[str, np.ndarray]]:
        out: dict[tuple[str, int], dict[str, list]] = {}
        for m in iter_messages(sc, 5, t0_ns=3, steps_per_message=per):
            msg = schema.decode(m)
            for name, cols in msg.tables.items():
                slot = out.setdefault((name, msg.header["rank"]), {})
                for c, v in cols.items():
                    slot.setdefault(c, []).append(v)
        return {k: {c: np.concatenate(v) for c, v in d.items()} for k, d in out.items()}

    one, three = rows(1), rows(3)
    assert one.keys() == three.keys()
    for key in one:
        for col in one[key]:
            np.testing.assert_array_equal(one[key][col], three[key][col])
