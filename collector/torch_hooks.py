"""Automatic instrumentation of a torch training job.

What is captured, and how (torch is imported only when this module is used):

- ``torch.distributed`` Python collectives (``all_reduce``, ``all_gather``,
  ``all_gather_into_tensor``, ``reduce_scatter(_tensor)``, ``broadcast``, ``reduce``,
  ``all_to_all(_single)``, ``barrier``, ``send``/``recv``/``isend``/``irecv``, ``gather``,
  ``scatter``): the package attributes are wrapped, so explicit calls and FSDP2 are seen;
  calls torch makes internally (``send`` → ``isend``) and C++ collectives are not, which
  keeps one row per user-visible call. Asynchronous calls get their exit time from the
  ``Work``'s future.
- DDP gradient buckets: a comm hook equivalent to DDP's default all-reduce, registered at
  the model's first forward unless the user registered their own (then the collectives
  inside theirs are seen through the wrappers instead).
- Step boundaries: torch's global optimizer step hooks (the first optimizer that steps
  is the step clock); the optimizer itself is the ``optimizer`` phase.
- Input waits: the DataLoader iterator's ``__next__`` is the ``input`` phase.
- Forward: forward pre/post hooks on DDP-wrapped (or ``instrument``-ed) models.
- Process groups and their ranks; mesh coordinates from ``init_device_mesh``.
- On CUDA: device times from CUDA events (``cuda_events``) and per-step memory figures.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import zlib
from typing import Any

from rankscope.collector import schema
from rankscope.collector.monitor import Monitor
from rankscope.collector.pump import FLAG_PENDING

NO_TIME = schema.NO_TIME
_T, _LIST, _NONE = 0, 1, 2

COLLECTIVES: dict[str, tuple[str, str | None, int]] = {
    # wrapped name: (schema op, input parameter, input kind)
    "all_reduce": ("all_reduce", "tensor", _T),
    "all_gather": ("all_gather", "tensor", _T),
    "all_gather_into_tensor": ("all_gather", "input_tensor", _T),
    "all_gather_single": ("all_gather", "input_tensor", _T),
    "reduce_scatter": ("reduce_scatter", "input_list", _LIST),
    "reduce_scatter_tensor": ("reduce_scatter", "input", _T),
    "reduce_scatter_single": ("reduce_scatter", "input", _T),
    "broadcast": ("broadcast", "tensor", _T),
    "reduce": ("reduce", "tensor", _T),
    "all_to_all": ("all_to_all", "input_tensor_list", _LIST),
    "all_to_all_single": ("all_to_all", "input", _T),
    "barrier": ("barrier", None, _NONE),
    "send": ("send", "tensor", _T),
    "recv": ("recv", "tensor", _T),
    "isend": ("send", "tensor", _T),
    "irecv": ("recv", "tensor", _T),
    "gather": ("gather", "tensor", _T),
    "scatter": ("scatter", "tensor", _T),
}
"""Every wrapped function; ``nbytes`` is the rank's input (for scatter/recv: its chunk)."""

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

_ALL_REDUCE = schema.OP_INDEX["all_reduce"]
_ASYNC = schema.FLAG_ASYNC
_BUCKET = schema.FLAG_DDP_BUCKET
_DEV = FLAG_PENDING


class _State:
    """Module state: the monitor, group ids, originals to restore."""

    def __init__(self) -> None:
        self.mon: Monitor | None = None
        self.gids: dict[Any, int] = {None: 0}
        self.originals: list[tuple[Any, str, Any]] = []
        self.handles: list[Any] = []
        self.step_optimizer: int | None = None
        self.opt_t0 = 0
        self.timer: Any = None
        self.cuda = False
        self.lock = threading.Lock()
        self.orig_all_reduce: Any = None
        self.backend = ""
        self.generation = 1
        """Bumped by ``uninstall``: models instrumented before get their hooks again."""


_state = _State()

HASHED_GROUP_BASE = 1 << 29
"""Groups with hashed names get ids in [2**29, 2**30); creation-counter names stay small."""
P2P_GROUP_BASE = 1 << 30
"""Point-to-point traffic src -> dst is its own virtual group ``2**30 + src * world + dst``
with its own sequence, so a send/recv pair matches as one instance and the ranks that
take no part keep their sequence numbers on the real group aligned."""


def p2p_group_id(src: int, dst: int, world: int) -> int:
    """Virtual group id of point-to-point messages from global rank ``src`` to ``dst``."""
    return P2P_GROUP_BASE + src * world + dst


def _p2p_group(src: int, dst: int, backend: str) -> int:
    mon = _state.mon
    world = mon.identity.world_size if mon is not None else 1
    gid = p2p_group_id(src, dst, world)
    if gid >= 1 << 31:
        return -1
    key = ("p2p", src, dst)
    if key not in _state.gids:
        _state.gids[key] = gid
        if mon is not None:
            mon.register_group(gid, f"p2p {src}->{dst}", [src, dst], backend, "point-to-point")
    return gid


def _group_id(group: Any) -> int:
    """Stable id of a process group, the same on every rank; -1 when this rank is not a
    member. The id derives from torch's group name: a creation counter that every rank
    advances identically, or a hash of the ranks for locally synchronised groups."""
    mon = _state.mon
    dist = sys.modules["torch.distributed"]
    with _state.lock:
        gid = _state.gids.get(group)
        if gid is not None:
            return gid
        try:
            ranks = list(dist.get_process_group_ranks(group))
            if dist.get_rank() not in ranks:
                gid = -1
            else:
                name = str(getattr(group, "group_name", "") or "")
                gid = (
                    int(name)
                    if name.isdigit() and int(name) < HASHED_GROUP_BASE
                    else HASHED_GROUP_BASE | (zlib.crc32(name.encode()) & (HASHED_GROUP_BASE - 1))
                )
                desc = str(getattr(group, "group_desc", "") or "")
                backend = str(dist.get_backend(group))
                name = desc if desc and desc != "undefined" else f"group{gid}"
                if mon is not None:
                    mon.register_group(gid, name, ranks, backend, desc)
        except Exception as exc:
            if mon is not None:
                mon._error("group", exc)
            gid = -1
        _state.gids[group] = gid
        return gid


def _name_group(group: Any, name: str) -> None:
    """Give a known group a readable name (e.g. a mesh dimension)."""
    gid = _group_id(group)
    mon = _state.mon
    if gid < 0 or mon is None:
        return
    with mon._lock:
        entry = mon._groups.get(gid)
        if entry is not None and entry["name"] != name:
            entry["name"] = name
            mon._groups_version += 1


def _complete(row: int, ev0: Any) -> Any:
    """Future callback of an async collective: stamp its exit and, on CUDA, record the end
    event on the callback's stream (which torch makes wait for the collective)."""

    def done(_fut: Any) -> None:
        t = time.monotonic_ns()
        mon = _state.mon
        if mon is None:
            return
        if ev0 is None:
            mon._colls.complete(row, "t_exit", t, FLAG_PENDING)
        elif mon._colls.set_field(row, "t_exit", t):
            _state.timer.track(row, ev0, _state.timer.event())

    return done


def _p2p_peer(
    fn_is_send: bool,
    args: tuple,
    kwargs: dict,
    peer_pos: int,
    gpeer_pos: int,
    group: Any,
    out: Any,
) -> int | None:
    """Global rank of the other side of a send/recv, None when unknown (any-source irecv)."""
    peer_name, gpeer_name = ("dst", "group_dst") if fn_is_send else ("src", "group_src")
    peer = (
        kwargs[peer_name]
        if peer_name in kwargs
        else (args[peer_pos] if len(args) > peer_pos else None)
    )
    if peer is not None:
        return int(peer)
    gpeer = (
        kwargs[gpeer_name]
        if gpeer_name in kwargs
        else (args[gpeer_pos] if 0 <= gpeer_pos < len(args) else None)
    )
    dist = sys.modules["torch.distributed"]
    if gpeer is not None:
        return int(dist.get_global_rank(group if group is not None else dist.group.WORLD, gpeer))
    if not fn_is_send and type(out) is int and out >= 0:
        return out  # a blocking recv returns the sender's global rank
    return None


def _wrap(fn: Any, op: str, in_name: str | None, kind: int) -> Any:
    params = list(inspect.signature(fn).parameters)
    g_pos = params.index("group")
    in_pos = params.index(in_name) if in_name is not None else -1
    op_i = schema.OP_INDEX[op]
    p2p = op in ("send", "recv")
    is_send = op == "send"
    peer_pos = params.index("dst" if is_send else "src") if p2p else -1
    gpeer_name = "group_dst" if is_send else "group_src"
    gpeer_pos = params.index(gpeer_name) if p2p and gpeer_name in params else -1
    mono = time.monotonic_ns
    state = _state
    gids = state.gids

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mon = state.mon
        if mon is None:
            return fn(*args, **kwargs)
        ev0 = None
        if state.cuda:
            ev0 = _device_start(args, kwargs, in_pos, in_name, kind)
        t0 = mono()
        out = fn(*args, **kwargs)
        t1 = mono()
        try:
            group = (
                kwargs["group"]
                if "group" in kwargs
                else (args[g_pos] if len(args) > g_pos else None)
            )
            gid = gids.get(group)
            if gid is None:
                gid = _group_id(group)
            if gid < 0:
                return out
            if p2p:
                peer = _p2p_peer(is_send, args, kwargs, peer_pos, gpeer_pos, group, out)
                if peer is None:
                    mon._error("p2p_unknown_peer", ValueError(f"{op} with no known peer"))
                    return out
                me = mon.identity.rank
                src, dst = (me, peer) if is_send else (peer, me)
                gid = gids.get(("p2p", src, dst)) or _p2p_group(src, dst, state.backend)
                if gid < 0:
                    return out
            if kind == _T:
                x = kwargs[in_name] if in_name in kwargs else args[in_pos]
                nbytes = x.nbytes
            elif kind == _LIST:
                xs = kwargs[in_name] if in_name in kwargs else args[in_pos]
                nbytes = sum(x.nbytes for x in xs)
            else:
                nbytes = 0
            if out is None or type(out) is int:
                if ev0 is None:
                    mon._rec_coll(op_i, gid, nbytes, t0, t1, 0)
                else:
                    row = mon._rec_coll(op_i, gid, nbytes, t0, t1, _DEV)
                    if row >= 0:
                        state.timer.track(row, ev0, state.timer.event())
            else:
                row = mon._rec_coll(op_i, gid, nbytes, t0, NO_TIME, _ASYNC | _DEV)
                if row >= 0:
                    _on_done(mon, out, row, ev0)
        except Exception as exc:  # never let bookkeeping break the training step
            mon._error("collective_wrapper", exc)
        return out

    wrapper.__rankscope_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _on_done(mon: Monitor, work: Any, row: int, ev0: Any) -> None:
    try:
        fut = work.get_future()
    except Exception:
        fut = None
    if fut is None:
        # No completion signal for this Work: ship the row without an exit time.
        mon._colls.complete(row, "t_exit", NO_TIME, FLAG_PENDING)
        return
    fut.add_done_callback(_complete(row, ev0))


def _device_start(args: tuple, kwargs: dict, in_pos: int, in_name: str | None, kind: int) -> Any:
    try:
        if kind == _T:
            x = kwargs[in_name] if in_name in kwargs else args[in_pos]
        elif kind == _LIST:
            xs = kwargs[in_name] if in_name in kwargs else args[in_pos]
            x = xs[0] if xs else None
        else:
            return None
        if x is None or not x.is_cuda:
            return None
        return _state.timer.event()
    except Exception:
        return None


# -- DDP ------------------------------------------------------------------------------
def _ddp_allreduce_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP's default gradient all-reduce, timed: entry when the bucket is ready, exit when
    its future completes. (Left unannotated: DDP refuses a hook whose ``bucket``
    annotation is not ``dist.GradBucket``.)

    It calls the process group directly, as DDP's built-in C++ path does, instead of
    ``dist.all_reduce``, whose Python argument handling would cost more than the timing.
    """
    dist = sys.modules["torch.distributed"]
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    t0 = time.monotonic_ns()
    tensor.div_(group.size())
    ev0 = _state.timer.event() if (_state.cuda and tensor.is_cuda) else None
    if tensor.is_complex():
        work = _state.orig_all_reduce(tensor, group=group, async_op=True)
    else:
        work = group.allreduce([tensor])
    fut = work.get_future()
    mon = _state.mon
    row = -1
    if mon is not None:
        try:
            gid = _state.gids.get(process_group)
            if gid is None:
                gid = _group_id(process_group)
            if gid >= 0:
                row = mon._rec_coll(
                    _ALL_REDUCE, gid, tensor.nbytes, t0, NO_TIME, _ASYNC | _BUCKET | _DEV
                )
        except Exception as exc:
            mon._error("ddp_hook", exc)
    if row < 0:
        return fut.then(_bucket_value)
    stamp = _complete(row, ev0)

    def done(f: Any) -> Any:
        stamp(f)
        return f.value()[0]

    return fut.then(done)


def _bucket_value(f: Any) -> Any:
    return f.value()[0]


def _forward_hooks(model: Any) -> None:
    fwd = schema.PHASE_INDEX["forward"]
    box = [0]

    def pre(_module: Any, _inputs: Any) -> None:
        box[0] = time.monotonic_ns()
        if not getattr(model, "_rankscope_hook_set", True):
            _register_ddp_hook(model)

    def post(_module: Any, _inputs: Any, _output: Any) -> None:
        mon = _state.mon
        if mon is not None:
            mon._rec_phase(fwd, box[0], time.monotonic_ns())

    _state.handles.append(model.register_forward_pre_hook(pre))
    _state.handles.append(model.register_forward_hook(post))


def _register_ddp_hook(model: Any) -> None:
    model._rankscope_hook_set = True
    if getattr(model, "_comm_hooks", None) or getattr(model, "_rankscope_user_hook", False):
        return
    try:
        model.register_comm_hook(model.process_group, _ddp_allreduce_hook)
    except Exception as exc:  # e.g. a built-in hook registered through another path
        if _state.mon is not None:
            _state.mon._error("ddp_comm_hook", exc)


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
