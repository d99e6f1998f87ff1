"""Torch auto-instrumentation in one real gloo process (world size 1): what each hook
records, that results are unchanged, and that uninstalling restores torch."""

from __future__ import annotations

import socket
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from rankscope.collector import schema, torch_hooks  # noqa: E402
from rankscope.collector.identity import Identity  # noqa: E402
from rankscope.collector.monitor import Monitor  # noqa: E402

pytestmark = pytest.mark.torch
assert funcol.all_reduce  # imported before the fixtures install: wrapped at install

OP = schema.OP_INDEX
PH = schema.PHASE_INDEX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.fixture
def mon(world):
    m = Monitor(
        job="t",
        run="r",
        identity=Identity(rank=0, world_size=1, local_rank=0, host="h", node_rank=0, pid=1),
        hub=f"tcp://127.0.0.1:{_free_port()}",
        flush_interval_s=3600,  # rows stay in the rings for the test to read
        sample_interval_s=0,
        clock_sync=False,
    ).start()
    # The background thread's first pass ships whatever is in the rings; let it happen
    # before the test writes rows it means to read back.
    end = time.monotonic() + 20
    while m.pump.cpu_s == 0.0 and time.monotonic() < end:
        time.sleep(0.005)
    torch_hooks.install(m)
    yield m
    torch_hooks.uninstall()
    m.close(timeout_s=0.2)


def _colls(m: Monitor) -> np.ndarray:
    return m._colls.unread()


def test_collectives_are_recorded_and_results_unchanged(mon: Monitor) -> None:
    x = torch.arange(8, dtype=torch.float32)
    dist.all_reduce(x)
    assert x.tolist() == list(range(8))  # world of one: the sum is the input
    out = torch.zeros(8)
    dist.all_gather_into_tensor(out, x)
    dist.broadcast(x, src=0)
    dist.barrier()
    lst = [torch.zeros(8)]
    dist.all_gather(lst, x)
    dist.reduce_scatter_tensor(torch.zeros(8), torch.ones(8))
    rows = _colls(mon)
    assert rows["op"].tolist() == [
        OP["all_reduce"],
        OP["all_gather"],
        OP["broadcast"],
        OP["barrier"],
        OP["all_gather"],
        OP["reduce_scatter"],
    ]
    assert rows["nbytes"].tolist() == [32, 32, 32, 0, 32, 32]
    assert rows["group"].tolist() == [0] * 6
    assert rows["seq"].tolist() == list(range(6))
    assert np.all(rows["t_exit"] >= rows["t_enter"]) and np.all(rows["flags"] == 0)


def test_async_collective_gets_its_exit_from_the_future(mon: Monitor) -> None:
    x = torch.ones(1000)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    deadline = time.monotonic() + 5
    while _colls(mon)["t_exit"][0] == schema.NO_TIME and time.monotonic() < deadline:
        time.sleep(0.01)
    row = _colls(mon)[0]
    assert row["flags"] & schema.FLAG_ASYNC
    assert row["t_exit"] >= row["t_enter"] and row["nbytes"] == 4000
    # The internal pending bit is cleared once the completion is seen.
    from rankscope.collector.pump import FLAG_PENDING

    assert not row["flags"] & FLAG_PENDING


def test_subgroups_get_stable_ids_and_are_registered(mon: Monitor) -> None:
    g = dist.new_group([0])
    dist.all_reduce(torch.ones(2), group=g)
    dist.all_reduce(torch.ones(2), group=g)
    dist.all_reduce(torch.ones(2))
    rows = _colls(mon)
    gid = int(g.group_name)
    assert rows["group"].tolist() == [gid, gid, 0]
    assert rows["seq"].tolist() == [0, 1, 0]  # one sequence per group
    _, groups = mon._groups_snapshot()
    assert {g["id"]: g["ranks"] for g in groups} == {0: [0], gid: [0]}
    assert next(x for x in groups if x["id"] == gid)["backend"] == "gloo"


def test_training_loop_auto_steps_phases_and_ddp_buckets(mon: Monitor) -> None:
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 2)), batch_size=4)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Three optimizer steps: three step rows, and a fourth step opened for what follows.
    steps = mon._steps.unread()
    assert steps["step"].tolist() == [0, 1, 2]
    assert np.all(steps["t_end"] > steps["t_start"])
    assert np.all(steps["t_start"][1:] == steps["t_end"][:-1])  # continuous
    phases = mon._phases.unread()
    names = phases["phase"].tolist()
    assert names.count(PH["input"]) == 3
    assert names.count(PH["forward"]) == 3
    assert names.count(PH["optimizer"]) == 3
    assert names.count(PH["backward"]) == 3
    for k in range(3):
        in_step = phases[phases["step"] == k]
        by = {int(p["phase"]): p for p in in_step}
        assert {PH["input"], PH["forward"], PH["backward"], PH["optimizer"]} <= set(by)
        # forward, then backward (from the output's gradient to autograd's end), then step
        fwd, bwd, opt_ = by[PH["forward"]], by[PH["backward"]], by[PH["optimizer"]]
        assert fwd["t1"] <= bwd["t0"] < bwd["t1"] <= opt_["t0"]
    # On CPU the default times DDP's all-reduce by its tail: no comm hook, one blocking
    # row per backward, from the end of the backward phase to the end of DDP's wait.
    assert not model._comm_hooks
    rows = _colls(mon)
    tail = (rows["flags"] & schema.FLAG_DDP_TAIL) != 0
    assert tail.sum() == 3 and len(rows) == 3
    assert np.all(rows["op"][tail] == OP["all_reduce"])
    assert not np.any(rows["flags"][tail] & (schema.FLAG_ASYNC | schema.FLAG_DDP_BUCKET))
    assert rows["step"][tail].tolist() == [0, 1, 2]
    assert rows["seq"][tail].tolist() == [0, 1, 2]
    n_params = sum(p.numel() for p in model.parameters())
    assert rows["nbytes"][tail].tolist() == [4 * n_params] * 3
    for k, row in enumerate(rows[tail]):
        by = {int(p["phase"]): p for p in phases[phases["step"] == k]}
        # The rank arrives when its backward ends, and leaves before the optimizer steps.
        assert row["t_enter"] == by[PH["backward"]]["t1"]
        assert row["t_enter"] <= row["t_exit"] <= by[PH["optimizer"]]["t0"]
    # The forward phase comes from DDP's forward, not module hooks: every call of the model
    # keeps torch's fast path.
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_automatic_phases_and_steps_carry_the_threads_cpu_time(mon: Monitor) -> None:
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size=4)
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    phases = mon._phases.unread()
    assert {PH["input"], PH["forward"], PH["backward"], PH["optimizer"]} <= set(
        phases["phase"].tolist()
    )
    wall = phases["t1"] - phases["t0"]
    # On CPU, autograd runs backward on the calling thread: every phase knows its CPU time,
    # and it never exceeds the span's wall time (by more than the clock reads' spread).
    assert (phases["cpu_ns"] >= 0).all()
    assert (phases["cpu_ns"] <= wall + 2_000_000).all()
    steps = mon._steps.unread()
    assert len(steps) == 2 and (steps["cpu_ns"] >= 0).all()
    assert (steps["cpu_ns"] <= steps["t_end"] - steps["t_start"] + 2_000_000).all()
    assert (steps["gc_count"] >= 0).all() and (steps["gc_ns"] >= 0).all()


def test_plain_module_forward_is_timed_through_hooks(mon: Monitor) -> None:
    model = nn.Linear(4, 2)
    torch_hooks.instrument(model, mon)
    with mon.step(0):
        model(torch.randn(3, 4))
    phases = mon._phases.unread()
    assert phases["phase"].tolist() == [PH["forward"]]
    torch_hooks.uninstall()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not hasattr(DDP.forward, "__wrapped__")  # the class patch is undone too


def test_a_compiled_ddp_model_keeps_its_phases_and_its_all_reduce(mon: Monitor) -> None:
    # torch.compile skips DDP's own forward (it runs as Python and compiles the module
    # inside it), and so does rankscope's timing wrapper of it: the phases and the
    # all-reduce's tail are recorded as for an eager model. (Traced instead, the wrapper
    # crashed a two-rank torchrun job in the compiler's guards: test_torch_e2e's
    # test_a_compiled_ddp_job_reports_its_steps_phases_and_collectives.)
    torch._dynamo.reset()
    model = torch.compile(DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # it did compile frames
    assert mon._steps.unread()["step"].tolist() == [0, 1, 2]
    names = mon._phases.unread()["phase"].tolist()
    for phase in ("forward", "backward", "optimizer"):
        assert names.count(PH[phase]) == 3, (phase, names)
    rows = _colls(mon)
    assert ((rows["flags"] & schema.FLAG_DDP_TAIL) != 0).sum() == 3
    assert mon._errors == {}


def test_a_full_graph_with_a_collective_compiles_whole(mon: Monitor) -> None:
    # Inside a region torch.compile traces, a wrapped collective is the graph's: traced as
    # if rankscope were not there, so fullgraph=True still makes one graph (the call is not
    # recorded: compilation hides it). Before, tracing the wrapper broke the graph.
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x * 2

    assert f(torch.ones(4)).tolist() == [2.0] * 4
    assert len(_colls(mon)) == 0
    # A plain module compiled whole: its forward hooks do nothing inside the graph.
    lin = nn.Linear(4, 2)
    torch_hooks.instrument(lin, mon)
    g = torch.compile(lin, fullgraph=True, backend="eager")
    with mon.step(0):
        assert g(torch.randn(3, 4)).shape == (3, 2)
    # Outside any compiled region the same collective is recorded as always.
    dist.all_reduce(torch.ones(2))
    assert _colls(mon)["op"].tolist() == [OP["all_reduce"]]


def test_ddp_gradients_match_without_instrumentation(mon: Monitor) -> None:
    torch.manual_seed(0)
    base = nn.Linear(4, 2)
    ref = nn.Linear(4, 2)
    ref.load_state_dict(base.state_dict())
    x = torch.randn(5, 4)
    model = DDP(base)
    model(x).sum().backward()
    torch_hooks.uninstall()
    plain = DDP(ref)
    plain(x).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad)


def test_user_comm_hook_wins_and_its_collectives_are_seen(mon: Monitor) -> None:
    calls = []

    def my_hook(state, bucket):
        calls.append(1)
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )

    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(None, my_hook)
    model(torch.randn(3, 4)).sum().backward()
    assert calls == [1]
    rows = _colls(mon)
    assert len(rows) == 1
    assert rows["flags"][0] & schema.FLAG_ASYNC and not rows["flags"][0] & schema.FLAG_DDP_BUCKET


def test_explicit_steps_turn_auto_steps_off(mon: Monitor) -> None:
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for k in (10, 11):
        mon.begin_step(k)
        p.grad = torch.ones(2)
        opt.step()
        dist.all_reduce(torch.ones(1))
        mon.end_step()
    assert mon._steps.unread()["step"].tolist() == [10, 11]
    assert _colls(mon)["step"].tolist() == [10, 11]


def test_uninstall_restores_torch(mon: Monitor) -> None:
    assert hasattr(dist.all_reduce, "__rankscope_original__")
    torch_hooks.uninstall()
    assert not hasattr(dist.all_reduce, "__rankscope_original__")
    from torch.utils.data import dataloader

    assert not hasattr(dataloader._BaseDataLoaderIter.__next__, "__wrapped__")
    dist.all_reduce(torch.ones(1))
    assert len(_colls(mon)) == 0


def test_device_mesh_coordinates_and_group_names(mon: Monitor) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert mon.identity.mesh == {"dp": 0, "tp": 0}
    dist.all_reduce(torch.ones(1), group=mesh.get_group("tp"))
    gid = int(_colls(mon)["group"][0])
    _, groups = mon._groups_snapshot()
    assert next(g for g in groups if g["id"] == gid)["name"] == "tp"


def test_functional_collectives_are_rows_that_end_at_the_first_wait(mon: Monitor) -> None:
    # Tensor parallelism's collectives (DTensor) are the functional ones: launched by the
    # call, waited for where the result is first used.
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    x = torch.arange(6, dtype=torch.float32)
    y = funcol.all_reduce(x, "sum", mesh)
    assert isinstance(y, funcol.AsyncCollectiveTensor)
    time.sleep(0.02)  # the thread does other work before it uses the result
    launched = _colls(mon)[0]
    assert launched["t_exit"] == schema.NO_TIME  # not waited for yet
    assert (y + 0).tolist() == x.tolist()  # first use: the wait
    with warnings.catch_warnings():  # deprecated in torch 2.13, in favour of the single
        warnings.simplefilter("ignore", FutureWarning)
        g = funcol.all_gather_tensor(x, 0, (mesh, 0))  # calls all_gather_single inside
    assert g.wait().tolist() == x.tolist()
    rows = _colls(mon)
    assert rows["op"].tolist() == [OP["all_reduce"], OP["all_gather"]]  # one row a call
    assert rows["nbytes"].tolist() == [24, 24]
    gid = int(rows["group"][0])
    assert rows["group"].tolist() == [gid, gid] and rows["seq"].tolist() == [0, 1]
    _, groups = mon._groups_snapshot()
    assert next(g for g in groups if g["id"] == gid)["name"] == "tp"
    ar = rows[0]
    assert ar["flags"] & schema.FLAG_ASYNC
    assert ar["t_exit"] - ar["t_enter"] >= 15_000_000, ar  # the wait came after the sleep
    from rankscope.collector.pump import FLAG_PENDING

    assert not rows["flags"][0] & FLAG_PENDING


def test_functional_collectives_never_waited_for_stay_bounded(mon, monkeypatch) -> None:
    import torch.distributed._functional_collectives as funcol

    from rankscope.collector import torch_funcol

    monkeypatch.setattr(torch_funcol, "MAX_PENDING", 4)
    kept = [funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD) for _ in range(10)]
    assert len(torch_funcol._fc.pending) == 4
    rows = _colls(mon)
    assert len(rows) == 10
    # The six oldest ship without an exit time; the four newest still wait for theirs.
    done = (rows["flags"] & torch_funcol.FLAG_PENDING) == 0
    assert done.tolist() == [True] * 6 + [False] * 4
    assert np.all(rows["t_exit"][:6] == schema.NO_TIME)
    for k in kept:
        k.wait()
    assert np.all((_colls(mon)["flags"] & torch_funcol.FLAG_PENDING) == 0)


def test_functional_collectives_imported_later_are_wrapped_at_the_next_step(mon) -> None:
    # A program that imports DTensor after rankscope installed: the next step boundary
    # wraps them, as it patches a pipelining import; one that never does never loads them.
    import sys

    from rankscope.collector import torch_funcol

    torch_hooks.uninstall()
    funcol = sys.modules.pop(torch_funcol.MODULE)
    try:
        torch_hooks.install(mon)
        assert not torch_funcol.patched()
        assert torch_funcol.MODULE not in sys.modules  # not loaded for rankscope's sake
    finally:
        sys.modules[torch_funcol.MODULE] = funcol
    p = nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    torch.optim.SGD([p], lr=0.1).step()  # a step boundary
    assert torch_funcol.patched()
    assert hasattr(funcol.all_reduce, "__rankscope_original__")
    funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()
    assert OP["all_reduce"] in _colls(mon)["op"].tolist()


def test_uninstall_restores_the_functional_collectives(mon: Monitor) -> None:
    import torch.distributed._functional_collectives as funcol

    assert hasattr(funcol.all_reduce, "__rankscope_original__")
    assert hasattr(funcol.wait_tensor, "__rankscope_original__")
    torch_hooks.uninstall()
    assert not hasattr(funcol.all_reduce, "__rankscope_original__")
    assert not hasattr(funcol.wait_tensor, "__rankscope_original__")
    funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()
    assert len(_colls(mon)) == 0


@pytest.mark.parametrize("mode", ["every", "sampled", "tail", "auto", "off"])
def test_ddp_bucket_timing_settings(mon: Monitor, mode: str) -> None:
    mon.ddp_buckets, mon.ddp_sample_every = mode, 2
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(3)]
    ref = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    ref.load_state_dict(nn.Sequential(*layers).state_dict())
    # A small bucket cap: one bucket per parameter or so, several per step.
    model = DDP(nn.Sequential(*layers), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = torch.randn(4, 8, 32)
    for x in xs:
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    # World size 1: DDP's averaged gradient is the local one, whatever the setting.
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b)
    deadline = time.monotonic() + 5
    while np.any(_colls(mon)["t_exit"] == schema.NO_TIME) and time.monotonic() < deadline:
        time.sleep(0.01)
    rows = _colls(mon)
    bucket = rows[(rows["flags"] & schema.FLAG_DDP_BUCKET) != 0]
    tail = rows[(rows["flags"] & schema.FLAG_DDP_TAIL) != 0]
    assert mon._steps.unread()["step"].tolist() == [0, 1, 2, 3]
    assert set(mon._phases.unread()["phase"].tolist()) >= {PH["forward"], PH["optimizer"]}
    if mode in ("off", "tail", "auto"):
        assert len(bucket) == 0 and not model._comm_hooks  # DDP's built-in path
        # tail, and auto on a CPU model: one row per backward whatever the buckets.
        assert tail["step"].tolist() == ([] if mode == "off" else [0, 1, 2, 3])
        return
    assert len(tail) == 0
    per_step = np.bincount(bucket["step"], minlength=4).tolist()
    assert np.all(bucket["t_exit"] >= bucket["t_enter"])
    # DDP's first step runs one bucket, then rebuilds them in gradient order.
    first, n = per_step[0], per_step[2]
    assert first >= 1 and n >= 3
    if mode == "every":
        assert per_step == [first, n, n, n]
        assert bucket["seq"].tolist() == list(range(len(bucket)))
    else:
        # Steps 0 and 2 only; the group's sequence still counts every bucket issued, so
        # instances match across ranks whichever steps each of them recorded.
        assert per_step == [first, 0, n, 0]
        assert bucket["seq"].tolist() == list(range(first)) + list(range(first + n, first + 2 * n))


def test_backward_is_left_to_a_program_that_marks_it(mon: Monitor) -> None:
    model = DDP(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    with torch.no_grad():
        model(x)  # no gradient, no backward to time
    out = {"logits": model(x), "n": 3}
    out["logits"].sum().backward()
    assert mon._phases.unread()["phase"].tolist().count(PH["backward"]) == 2
    with mon.phase("backward"):
        model(x).sum().backward()
    # Only the program's own span from now on.
    model(x).sum().backward()
    assert mon._phases.unread()["phase"].tolist().count(PH["backward"]) == 3


def test_ddp_hook_follows_a_restarted_monitor(mon: Monitor) -> None:
    sub = dist.new_group([0])
    model = DDP(nn.Linear(4, 2), process_group=sub)
    model(torch.randn(3, 4)).sum().backward()
    gid = torch_hooks._state.gids[sub]
    assert gid > 0
    torch_hooks.uninstall()
    again = Monitor(
        job="t",
        run="r2",
        identity=Identity(rank=0, world_size=1, local_rank=0, host="h", node_rank=0, pid=1),
        hub=f"tcp://127.0.0.1:{_free_port()}",
        flush_interval_s=3600,
        sample_interval_s=0,
        clock_sync=False,
    ).start()
    try:
        torch_hooks.install(again)
        torch_hooks.instrument(model, again)
        model(torch.randn(3, 4)).sum().backward()
        rows = again._colls.unread()
        assert rows["group"].tolist() == [gid]
        _, groups = again._groups_snapshot()
        assert gid in {g["id"] for g in groups}  # the new monitor learnt the group
    finally:
        torch_hooks.uninstall()
        again.close(timeout_s=0.2)


def test_ddp_tail_follows_synchronising_backwards_only(mon: Monitor) -> None:
    model = DDP(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with model.no_sync():  # gradient accumulation: DDP reduces nothing after this forward
        model(x).sum().backward()
    model(x).sum().backward()
    with torch.no_grad():
        model(x)
    tail = _colls(mon)
    assert (tail["flags"] & schema.FLAG_DDP_TAIL).tolist() == [schema.FLAG_DDP_TAIL]
    phases = mon._phases.unread()
    assert phases["phase"].tolist().count(PH["backward"]) == 2  # both backwards are timed
    # A program that marks backward itself keeps its own span; the tail is still timed.
    with mon.phase("backward"):
        model(x).sum().backward()
    rows = _colls(mon)
    assert len(rows) == 2 and rows["seq"].tolist() == [0, 1]
    assert mon._phases.unread()["phase"].tolist().count(PH["backward"]) == 3


def test_ddp_timing_mode_follows_the_model_device() -> None:
    from rankscope.collector.torch_ddp import resolve_mode

    class OnGPU:  # what DDP exposes of where its model lives
        device_type = "cuda"

    class OnCPU:
        device_type = "cpu"

    gpu, cpu = OnGPU(), OnCPU()
    # Host times say nothing of an NCCL reduction: a GPU model gets the per-bucket hook.
    assert [resolve_mode(m, gpu) for m in ("auto", "tail", "every", "sampled", "off")] == [
        "every",
        "every",
        "every",
        "sampled",
        "off",
    ]
    assert [resolve_mode(m, cpu) for m in ("auto", "tail", "every")] == ["tail", "tail", "every"]


class _HookedOutput(nn.Module):
    """A model that puts a gradient hook on its own output, as some programs do."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        out.register_hook(lambda g: self.seen.append("model"))
        return out


def test_backward_timing_keeps_the_programs_gradient_hooks(mon: Monitor) -> None:
    seen: list[str] = []
    model = DDP(_HookedOutput(seen))
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the output already holds a hook
    out = model(x)
    out.register_hook(lambda g: seen.append("after"))  # a hook added after the forward
    out.sum().backward()
    plain = DDP(nn.Linear(4, 2))
    out = plain(x)
    out.register_hook(lambda g: seen.append("plain"))
    out.sum().backward()
    assert seen == ["model", "model", "after", "plain"]
    phases = mon._phases.unread()
    backward = phases["t1"][phases["phase"] == PH["backward"]]
    assert len(backward) == 3
