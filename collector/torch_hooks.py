"""Automatic instrumentation of a torch training job.

What is captured, and how (torch is imported only when this module is used):

- ``torch.distributed`` Python collectives: wrapped by ``torch_collectives``.
- DDP gradient buckets: a comm hook equivalent to DDP's default all-reduce, registered at
  the model's first forward unless the user registered their own (then the collectives
  inside theirs are seen through the wrappers instead). ``Monitor.ddp_buckets`` chooses
  every step, one step in N, or no hook at all (``monitor.DDP_BUCKET_MODES``).
- Step boundaries: torch's global optimizer step hooks (the first optimizer that steps
  is the step clock); the optimizer itself is the ``optimizer`` phase.
- Input waits: the DataLoader iterator's ``__next__`` is the ``input`` phase.
- Forward: DDP's ``forward`` (patched on the class, so the module keeps torch's fast call
  path), or forward pre/post hooks on other ``instrument``-ed models.
- Process groups and their ranks; mesh coordinates from ``init_device_mesh``.
- On CUDA: device times from CUDA events (``cuda_events``) and per-step memory figures.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

from rankscope.collector import schema
from rankscope.collector.monitor import Monitor
from rankscope.collector.torch_collectives import (
    _ALL_REDUCE,
    _ASYNC,
    _BUCKET,
    _DEV,
    COLLECTIVES,
    NO_TIME,
    _group_id,
    _name_group,
    _state,
    _wrap,
)

MESH_ALIASES = {
    "dp_replicate": "dp",
    "dp_shard": "dp",
    "data": "dp",
    "tensor": "tp",
    "pipeline": "pp",
    "context": "cp",
    "expert": "ep",
}
"""DeviceMesh dimension names mapped onto ``schema.MESH_DIMS``."""


class _BucketDone:
    """Completion callback of one DDP bucket's all-reduce: stamps the row's exit and hands
    DDP the reduced tensor. One per bucket index, reused every step (a bucket's previous
    all-reduce has completed before DDP runs its hook again), so timing a bucket allocates
    no closure."""

    __slots__ = ("ev0", "row")

    def __init__(self) -> None:
        self.row = -1
        self.ev0: Any = None

    def __call__(self, fut: Any) -> Any:
        t = time.monotonic_ns()
        mon = _state.mon
        if mon is not None:
            try:
                if self.ev0 is None:
                    mon._colls.complete(self.row, "t_exit", t, _DEV)
                elif mon._colls.set_field(self.row, "t_exit", t):
                    _state.timer.track(self.row, self.ev0, _state.timer.event())
            except Exception as exc:
                mon._error("ddp_bucket_done", exc)
        return fut.value()[0]


class _BucketHookState:
    """Per-model state of the DDP comm hook: the group and what is constant about it,
    looked up once instead of per bucket.

    Attributes:
        pg: the process group DDP was given (None: the default group).
        group: the process group DDP reduces over.
        size: its size (the gradient divisor).
        gid: its rankscope group id (-1: this rank is not a member).
        every: record buckets on steps whose number is a multiple of this (1: all).
        done: the reusable completion callback per bucket index.
        generation: ``_state.generation`` when ``gid`` was looked up.
    """

    __slots__ = ("done", "every", "generation", "gid", "group", "pg", "size")

    def __init__(self, group: Any, every: int) -> None:
        dist = sys.modules["torch.distributed"]
        self.pg = group
        self.group = group if group is not None else dist.group.WORLD
        self.size = self.group.size()
        self.gid = _group_id(group)
        self.generation = _state.generation
        self.every = every
        self.done: dict[int, _BucketDone] = {}

    def refresh(self) -> None:
        """Monitoring was restarted: look the group up (and register it) again."""
        self.gid = _group_id(self.pg)
        self.generation = _state.generation


def _ddp_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's default gradient all-reduce, timed: entry when the bucket is ready, exit when
    its future completes. (Left unannotated: DDP refuses a hook whose ``bucket``
    annotation is not ``dist.GradBucket``.)

    It calls the process group directly, as DDP's built-in C++ path does, instead of
    ``dist.all_reduce``, whose Python argument handling would cost more than the timing.
    """
    t0 = time.monotonic_ns()
    tensor = bucket.buffer()
    tensor.div_(state.size)
    mon = _state.mon
    ev0 = None
    if mon is not None and _state.cuda and tensor.is_cuda:
        ev0 = _state.timer.event()
    if tensor.is_complex():
        work = _state.orig_all_reduce(tensor, group=state.group, async_op=True)
    else:
        work = state.group.allreduce([tensor])
    fut = work.get_future()
    if mon is None:
        return fut.then(_bucket_value)
    if state.generation != _state.generation:
        state.refresh()
    if state.gid < 0:
        return fut.then(_bucket_value)
    if state.every > 1 and mon._step % state.every:
        # Not a sampled step: keep the group's sequence in issue order, record nothing.
        seqs = mon._seq
        seqs[state.gid] = seqs.get(state.gid, 0) + 1
        return fut.then(_bucket_value)
    try:
        row = mon._rec_coll(
            _ALL_REDUCE, state.gid, tensor.nbytes, t0, NO_TIME, _ASYNC | _BUCKET | _DEV
        )
    except Exception as exc:
        mon._error("ddp_hook", exc)
        row = -1
    if row < 0:
        return fut.then(_bucket_value)
    index = bucket.index()
    done = state.done.get(index)
    if done is None:
        done = state.done[index] = _BucketDone()
    done.row = row
    done.ev0 = ev0
    return fut.then(done)


def _bucket_value(f: Any) -> Any:
    return f.value()[0]


_BACKWARD = schema.PHASE_INDEX["backward"]


def _backward_end(t0: int) -> Any:
    def end() -> None:
        mon = _state.mon
        if mon is not None:
            mon._rec_phase(_BACKWARD, t0, time.monotonic_ns())

    return end


def _backward_start(_grad: Any) -> None:
    """Gradient hook on a forward's output: backward has reached the model. The phase
    ends when autograd finishes the pass (a callback queued now runs then, before DDP's
    own end-of-backward callback waits for the last buckets: that wait is collective
    time, not compute)."""
    try:
        _state.engine.queue_callback(_backward_end(time.monotonic_ns()))
    except Exception as exc:
        if _state.mon is not None:
            _state.mon._error("backward_hook", exc)


def _watch_backward(mon: Monitor, out: Any) -> None:
    """Time the backward pass through ``out`` (the model's output) unless the program
    marks ``backward`` itself, or ``out`` holds no tensor that needs a gradient."""
    if mon.user_backward:
        return
    t = out
    if not getattr(t, "requires_grad", False):
        if isinstance(out, dict):
            items: Any = out.values()
        elif isinstance(out, (tuple, list)):
            items = out
        else:
            return
        t = next((v for v in items if getattr(v, "requires_grad", False)), None)
        if t is None:
            return
    try:
        # The node's pre-hook: a C++ binding, cheaper than Tensor.register_hook's
        # Python bookkeeping (a leaf output has no node and takes the tensor hook).
        node = t.grad_fn
        if node is not None:
            node.register_prehook(_backward_start)
        else:
            t.register_hook(_backward_start)
    except Exception as exc:
        mon._error("backward_hook", exc)


def _forward_hooks(model: Any) -> None:
    """Forward phase of a model that is not DDP (DDP's forward is timed by a class patch:
    module hooks would move every call of the model off torch's fast path, ~10 µs)."""
    fwd = schema.PHASE_INDEX["forward"]
    box = [0]

    def pre(_module: Any, _inputs: Any) -> None:
        box[0] = time.monotonic_ns()
        if not getattr(model, "_rankscope_hook_set", True):
            _register_ddp_hook(model)

    def post(_module: Any, _inputs: Any, output: Any) -> None:
        mon = _state.mon
        if mon is not None:
            mon._rec_phase(fwd, box[0], time.monotonic_ns())
            _watch_backward(mon, output)

    _state.handles.append(model.register_forward_pre_hook(pre))
    _state.handles.append(model.register_forward_hook(post))


def _register_ddp_hook(model: Any) -> None:
    model._rankscope_hook_set = True
    if getattr(model, "_comm_hooks", None) or getattr(model, "_rankscope_user_hook", False):
        return
    mon = _state.mon
    mode, every = (mon.ddp_buckets, mon.ddp_sample_every) if mon is not None else ("off", 1)
    if mode == "off":
        return  # DDP keeps its built-in C++ all-reduce
    try:
        state = _BucketHookState(model.process_group, every if mode == "sampled" else 1)
        model.register_comm_hook(state, _ddp_allreduce_hook)
    except Exception as exc:  # e.g. a built-in hook registered through another path
        if mon is not None:
            mon._error("ddp_comm_hook", exc)


def instrument(model: Any, monitor: Monitor | None = None) -> Any:
    """Instrument a model: forward phase, and DDP gradient buckets when it is a DDP model.

    The DDP comm hook is registered at the first forward, so a comm hook the user
    registers before that wins (its collectives are then seen through the wrappers).

    Args:
        model: a ``torch.nn.Module``, typically ``DistributedDataParallel``.
        monitor: the monitor (the active one by default; instruments nothing if none).

    Returns:
        The model, for chaining.
    """
    from rankscope.collector import runtime

    mon = monitor or runtime.current()
    if mon is None or not mon.enabled:
        return model
    if _state.mon is None:
        install(mon)
    if getattr(model, "_rankscope_instrumented", 0) == _state.generation:
        return model
    model._rankscope_instrumented = _state.generation
    ddp = sys.modules.get("torch.nn.parallel")
    if ddp is None or not isinstance(model, ddp.DistributedDataParallel):
        _forward_hooks(model)
    if (
        hasattr(model, "reducer")
        and hasattr(model, "register_comm_hook")
        and not hasattr(model, "_rankscope_hook_set")
    ):
        model._rankscope_hook_set = False
        if getattr(model, "process_group", None) is not None:
            _group_id(model.process_group)
    return model


# -- install --------------------------------------------------------------------------
def _patch(owner: Any, name: str, new: Any) -> None:
    _state.originals.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _optimizer_hooks(torch: Any) -> None:
    opt_phase = schema.PHASE_INDEX["optimizer"]

    def pre(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        mon = _state.mon
        if mon is None:
            return
        if _state.step_optimizer is None:
            _state.step_optimizer = id(optimizer)
        if id(optimizer) == _state.step_optimizer:
            _state.opt_t0 = time.monotonic_ns()
            mon._auto_touch()

    def post(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        mon = _state.mon
        if mon is None or id(optimizer) != _state.step_optimizer:
            return
        try:
            mon._rec_phase(opt_phase, _state.opt_t0, time.monotonic_ns())
            mon._auto_step_boundary()
        except Exception as exc:
            mon._error("optimizer_hook", exc)

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    _state.handles.append(register_optimizer_step_pre_hook(pre))
    _state.handles.append(register_optimizer_step_post_hook(post))


def _dataloader_hook(torch: Any) -> None:
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    orig = cls.__next__
    inp = schema.PHASE_INDEX["input"]
    mono = time.monotonic_ns

    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        mon = _state.mon
        if mon is None:
            return orig(self)
        t0 = mono()
        out = orig(self)  # StopIteration passes through unrecorded
        mon._rec_phase(inp, t0, mono())
        return out

    _patch(cls, "__next__", __next__)


def _ddp_patches(torch: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_init = DDP.__init__
    orig_register = DDP.register_comm_hook
    orig_builtin = DDP._register_builtin_comm_hook
    orig_forward = DDP.forward
    fwd = schema.PHASE_INDEX["forward"]
    mono = time.monotonic_ns

    @functools.wraps(orig_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        mon = _state.mon
        if mon is None:
            return orig_forward(self, *args, **kwargs)
        if self.__dict__.get("_rankscope_hook_set", True) is False:
            _register_ddp_hook(self)  # the first forward of an instrumented model
        t0 = mono()
        out = orig_forward(self, *args, **kwargs)
        mon._rec_phase(fwd, t0, mono())
        _watch_backward(mon, out)
        return out

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if _state.mon is not None:
            try:
                instrument(self, _state.mon)
            except Exception as exc:
                _state.mon._error("ddp_instrument", exc)

    @functools.wraps(orig_register)
    def register_comm_hook(self: Any, state: Any, hook: Any) -> None:
        if hook is not _ddp_allreduce_hook:
            self._rankscope_user_hook = True
        return orig_register(self, state, hook)

    @functools.wraps(orig_builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._rankscope_user_hook = True
        return orig_builtin(self, comm_hook_type)

    _patch(DDP, "__init__", __init__)
    _patch(DDP, "forward", forward)
    _patch(DDP, "register_comm_hook", register_comm_hook)
    _patch(DDP, "_register_builtin_comm_hook", _register_builtin_comm_hook)


def _mesh_patch(torch: Any) -> None:
    try:
        from torch.distributed import device_mesh
    except Exception:
        return
    orig = device_mesh.init_device_mesh

    @functools.wraps(orig)
    def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
        mesh = orig(*args, **kwargs)
        try:
            note_device_mesh(mesh)
        except Exception as exc:
            if _state.mon is not None:
                _state.mon._error("device_mesh", exc)
        return mesh

    _patch(device_mesh, "init_device_mesh", init_device_mesh)
    dist = sys.modules["torch.distributed"]
    if getattr(dist, "init_device_mesh", None) is orig:
        _patch(dist, "init_device_mesh", init_device_mesh)


def note_device_mesh(mesh: Any) -> None:
    """Take mesh coordinates and per-dimension groups from a ``DeviceMesh``.

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh``.
    """
    mon = _state.mon
    if mon is None:
        return
    names = mesh.mesh_dim_names or ()
    coord = mesh.get_coordinate()
    if coord is None:
        return
    coords = dict(mon.identity.mesh)
    for i, name in enumerate(names):
        dim = name if name in schema.MESH_DIMS else MESH_ALIASES.get(name)
        if dim is not None and dim not in coords:
            coords[dim] = int(coord[i])
        try:
            _name_group(mesh.get_group(name), name)
        except Exception as exc:
            mon._error("device_mesh", exc)
    mon.update_identity(mesh=coords)


def _memory_probe(torch: Any) -> Any:
    cuda = torch.cuda
    calls = [0, -1]

    def probe() -> tuple[int, int, int, int]:
        if not cuda.is_initialized():
            return (-1, -1, -1, -1)
        calls[0] += 1
        # memory_stats() builds a large dict: sample allocator retries every 10 steps.
        if calls[0] % 10 == 1:
            calls[1] = int(cuda.memory_stats().get("num_alloc_retries", -1))
        return (
            int(cuda.memory_allocated()),
            int(cuda.memory_reserved()),
            int(cuda.max_memory_allocated()),
            calls[1],
        )

    return probe


def install(monitor: Monitor) -> None:
    """Install every hook for ``monitor`` (idempotent; ``uninstall`` undoes it).

    Steps become automatic (optimizer hooks) unless the program already marks them.

    Args:
        monitor: the active monitor.
    """
    import torch
    import torch.distributed as dist

    with _state.lock:
        if _state.mon is not None:
            _state.mon = monitor
            return
        _state.mon = monitor
    if monitor._steps.head == 0 and not monitor._open:
        monitor._auto = True
    _state.orig_all_reduce = dist.all_reduce
    for name, (op, in_name, kind) in COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__rankscope_original__"):
            continue
        try:
            _patch(dist, name, _wrap(fn, op, in_name, kind))
        except (ValueError, TypeError) as exc:  # a signature this version does not have
            monitor._error("wrap_" + name, exc)
    if dist.is_initialized():
        _state.backend = str(dist.get_backend())
        world = dist.group.WORLD
        if world is not None:
            _state.gids[world] = 0
            try:
                monitor.register_group(
                    0,
                    "world",
                    range(dist.get_world_size()),
                    backend=str(dist.get_backend()),
                    desc=str(getattr(world, "group_desc", "") or ""),
                )
            except Exception as exc:
                monitor._error("group", exc)
    _state.engine = torch.autograd.Variable._execution_engine
    _optimizer_hooks(torch)
    _dataloader_hook(torch)
    _ddp_patches(torch)
    _mesh_patch(torch)
    try:
        if torch.cuda.is_available():
            from rankscope.collector.cuda_events import DeviceTimer

            _state.timer = DeviceTimer(monitor, torch)
            _state.cuda = True
            monitor.pump.tasks.append(_state.timer.resolve)
            monitor.memory_probe = _memory_probe(torch)
    except Exception as exc:
        monitor._error("cuda", exc)


def uninstall() -> None:
    """Remove every patch and hook (tests, or a program that stops monitoring)."""
    with _state.lock:
        for owner, name, orig in reversed(_state.originals):
            setattr(owner, name, orig)
        for h in _state.handles:
            try:
                h.remove()
            except Exception:
                pass
        _state.originals.clear()
        _state.handles.clear()
        _state.mon = None
        _state.gids.clear()
        _state.gids[None] = 0
        _state.step_optimizer = None
        _state.timer = None
        _state.cuda = False
        _state.generation += 1
