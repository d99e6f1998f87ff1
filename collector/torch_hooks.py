"""Automatic instrumentation of a torch training job.

What is captured, and how (torch is imported only when this module is used):

- ``torch.distributed`` Python collectives: wrapped by ``torch_collectives``; the
  functional collectives of tensor parallelism (DTensor) by ``torch_funcol``.
- DDP's gradient all-reduce: per bucket through a comm hook, or as the all-reduce's tail
  with no hook (``torch_ddp``; ``Monitor.ddp_buckets`` chooses), set up at the model's
  first forward unless the user registered a comm hook of their own (then the
  collectives inside theirs are seen through the wrappers instead).
- Step boundaries: torch's global optimizer step hooks (the first optimizer that steps
  is the step clock); the optimizer itself is the ``optimizer`` phase.
- Input waits: the DataLoader iterator's ``__next__`` is the ``input`` phase.
- Forward: DDP's ``forward`` (patched on the class, so the module keeps torch's fast call
  path), or forward pre/post hooks on other ``instrument``-ed models.
- Process groups and their ranks, however they were made, and mesh coordinates, however
  the mesh was built (``torch_mesh``); read at install and at step boundaries.
- Pipeline schedules (``torch.distributed.pipelining``) and explicit pipelines: stage and
  micro-batch ids, per-micro-batch phases, ``pp_wait`` bubbles (``torch_pipeline``).
- All-to-all split sizes as ``expert_tokens`` (``torch_collectives``).
- The CPU time of the thread running each of these phases (``cpu_ns``), from
  ``time.thread_time_ns`` at both ends; a backward that ends on another thread than it
  began (autograd's device threads) reports it unknown.
- On CUDA: device times from CUDA events (``cuda_events``) and per-step memory figures.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from time import thread_time_ns
from typing import Any

from rankscope.collector import schema, torch_ddp, torch_funcol, torch_mesh, torch_pipeline
from rankscope.collector.monitor import Monitor
from rankscope.collector.torch_collectives import (
    COLLECTIVES,
    _group_id,
    _state,
    _wrap,
    compiling_check,
)

MESH_ALIASES = torch_mesh.MESH_ALIASES


_BACKWARD = schema.PHASE_INDEX["backward"]
_HOOK_KEY = -1
"""Key of rankscope's entry in a tensor's hook dict: torch's handles count up from 0."""


def _backward_end(t0: int, c0: int, thread: int) -> Any:
    def end() -> None:
        mon = _state.mon
        if mon is not None:
            cpu = thread_time_ns() - c0 if threading.get_ident() == thread else -1
            mon._rec_phase(_BACKWARD, t0, time.monotonic_ns(), cpu)

    return end


def _backward_start(_grad: Any) -> None:
    """Gradient hook on a forward's output: backward has reached the model. The phase
    ends when autograd finishes the pass (a callback queued now runs then, before DDP's
    own end-of-backward callback waits for the last buckets: that wait is collective
    time, not compute)."""
    try:
        _state.engine.queue_callback(
            _backward_end(time.monotonic_ns(), thread_time_ns(), threading.get_ident())
        )
    except Exception as exc:
        if _state.mon is not None:
            _state.mon._error("backward_hook", exc)


def _watch_backward(mon: Monitor, out: Any, tail: torch_ddp.DDPTail | None = None) -> None:
    """Time the backward pass through ``out`` (the model's output) unless the program
    marks ``backward`` itself, or ``out`` holds no tensor that needs a gradient; with
    ``tail``, the DDP all-reduce tail of that backward too (it times the phase then)."""
    if tail is not None:
        tail.phase = not mon.user_backward
    elif mon.user_backward:
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
        _on_backward(t, _backward_start if tail is None else tail.started)
    except Exception as exc:
        mon._error("backward_hook", exc)


class _HookDict(dict):
    """A tensor's hook dict: a plain dict that can be weakly referenced, as a handle from
    ``Tensor.register_hook`` does to it. (torch's own is an ``OrderedDict``: building one
    cost ~1.6 µs more per step, measured at world size 1.)"""

    __slots__ = ("__weakref__",)


def _on_backward(t: Any, hook: Any) -> None:
    """Call ``hook(grad)`` when backward reaches ``t``, once: the tensor's hook, put in
    place directly when ``t`` is a plain tensor with no hooks yet. That is what
    ``Tensor.register_hook`` does, without the handle and ordered dict it builds in Python,
    and what ``Node.register_prehook`` does through a Python helper of its own: both cost
    several µs a step, and this runs on every forward."""
    node = t.grad_fn
    if node is not None and type(t) is _state.tensor_type and t._backward_hooks is None:
        hooks = _HookDict()
        hooks[_HOOK_KEY] = hook
        try:
            t._backward_hooks = hooks
            node._register_hook_dict(t)
            return
        except AttributeError:  # a torch without these internals: the public path
            t._backward_hooks = None
    t.register_hook(hook)


def _forward_hooks(model: Any) -> None:
    """Forward phase of a model that is not DDP (DDP's forward is timed by a class patch:
    module hooks would move every call of the model off torch's fast path, ~10 µs)."""
    fwd = schema.PHASE_INDEX["forward"]
    box = [0, 0]
    compiling = compiling_check()

    # A module that torch.compile compiles takes its hooks into the graph: there they do
    # nothing (a full graph stays whole; the forward of a compiled plain module is then
    # not timed, its steps and other phases are).
    def pre(_module: Any, _inputs: Any) -> None:
        if compiling():
            return
        box[0] = time.monotonic_ns()
        box[1] = thread_time_ns()
        if not getattr(model, "_rankscope_hook_set", True):
            torch_ddp.register(model)

    def post(_module: Any, _inputs: Any, output: Any) -> None:
        mon = _state.mon
        if mon is not None and not compiling():
            cpu = thread_time_ns() - box[1]
            mon._rec_phase(fwd, box[0], time.monotonic_ns(), cpu)
            _watch_backward(mon, output)

    _state.handles.append(model.register_forward_pre_hook(pre))
    _state.handles.append(model.register_forward_hook(post))


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
def _eager(torch: Any, fn: Any) -> Any:
    """``fn`` run as Python, never traced by ``torch.compile``, while what it calls is
    still compiled (``recursive=False``). For the DDP forward: torch's own is skipped by
    the compiler (it runs eagerly and its module is compiled inside), and a wrapper that
    the compiler traced instead would take the timing and the backward hook into the
    graph, which it cannot do."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return fn
    try:
        return disable(fn, recursive=False)
    except TypeError:  # a torch whose disable takes no ``recursive``
        return fn


def _patch(owner: Any, name: str, new: Any) -> None:
    _state.originals.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _optimizer_hooks(torch: Any) -> None:
    opt_phase = schema.PHASE_INDEX["optimizer"]

    mono = time.monotonic_ns
    state = _state

    def pre(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        mon = state.mon
        if mon is None:
            return
        if id(optimizer) != state.step_optimizer:
            if state.step_optimizer is not None:
                return
            state.step_optimizer = id(optimizer)
        if state.setup:
            state.setup = False
            try:
                _step_boundary(mon)
            except Exception as exc:
                mon._error("step_boundary", exc)
        state.opt_t0 = mono()
        state.opt_c0 = thread_time_ns()
        if not mon._open:
            mon._auto_touch()

    def post(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        mon = state.mon
        if mon is None or id(optimizer) != state.step_optimizer:
            return
        try:
            c = thread_time_ns()
            mon._optimizer_end(opt_phase, state.opt_t0, mono(), state.opt_c0, c)
        except Exception as exc:
            mon._error("optimizer_hook", exc)
        state.setup = (
            torch_mesh.dirty()
            or not torch_pipeline.pipe.schedules_patched
            or not torch_funcol.patched()
        )

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
        c0 = thread_time_ns()
        out = orig(self)  # StopIteration passes through unrecorded
        c = thread_time_ns() - c0
        mon._rec_phase(inp, t0, mono(), c)
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
    grad_enabled = torch.is_grad_enabled

    @functools.wraps(orig_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        mon = _state.mon
        if mon is None:
            return orig_forward(self, *args, **kwargs)
        if self.__dict__.get("_rankscope_hook_set", True) is False:
            torch_ddp.register(self)  # the first forward of an instrumented model
        t0 = mono()
        c0 = thread_time_ns()
        out = orig_forward(self, *args, **kwargs)
        c = thread_time_ns() - c0
        mon._rec_phase(fwd, t0, mono(), c)
        tail = self.__dict__.get("_rankscope_tail")
        if tail is not None and not (self.require_backward_grad_sync and grad_enabled()):
            tail = None  # no_sync() or no gradient: DDP reduces nothing after this forward
        _watch_backward(mon, out, tail)
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
        if hook is not torch_ddp._ddp_allreduce_hook:
            self._rankscope_user_hook = True
        return orig_register(self, state, hook)

    @functools.wraps(orig_builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._rankscope_user_hook = True
        return orig_builtin(self, comm_hook_type)

    _patch(DDP, "__init__", __init__)
    _patch(DDP, "forward", _eager(torch, forward))
    _patch(DDP, "register_comm_hook", register_comm_hook)
    _patch(DDP, "_register_builtin_comm_hook", _register_builtin_comm_hook)


def note_device_mesh(mesh: Any) -> None:
    """Take mesh coordinates and per-dimension groups from a ``DeviceMesh`` now (meshes
    built while the hooks are installed, or after the zero-code bootstrap, are taken at
    the next step boundary without this call).

    Args:
        mesh: a ``torch.distributed.device_mesh.DeviceMesh``.
    """
    mon = _state.mon
    if mon is None:
        return
    torch_mesh.state.pending.append(mesh)
    torch_mesh.refresh(mon)


def _step_boundary(mon: Monitor) -> None:
    """Set-up the program did since the last step: meshes, groups, a pipelining or tensor
    parallelism (functional collectives) import."""
    if torch_mesh.dirty():
        torch_mesh.refresh(mon)
    if not torch_pipeline.pipe.schedules_patched:
        torch_pipeline.maybe_patch_schedules()
    if not torch_funcol.patched():
        torch_funcol.install(_patch)


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
    try:
        torch_funcol.install(_patch)
    except Exception as exc:
        monitor._error("funcol_install", exc)
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
    _state.tensor_type = torch.Tensor
    _optimizer_hooks(torch)
    _dataloader_hook(torch)
    _ddp_patches(torch)
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is not None:
        torch_mesh.watch(device_mesh)
    try:
        torch_pipeline.install(dist)
    except Exception as exc:
        monitor._error("pipeline_install", exc)
    torch_mesh.refresh(monitor)
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
        _state.setup = True
        _state.links.clear()
        _state.routed.clear()
    torch_mesh.reset()
    torch_pipeline.reset()
    torch_funcol.uninstall()
