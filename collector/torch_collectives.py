"""Wrappers of the ``torch.distributed`` Python collectives, and process-group ids.

Each wrapped function (``COLLECTIVES``) stamps entry and exit around the original call and
writes one ring row: op, group id, per-group sequence number, the rank's input bytes.
Asynchronous calls (``async_op=True``, ``isend``/``irecv``) get their exit time from the
``Work``'s future. Only the package attributes (``torch.distributed.all_reduce``...) are
wrapped, so explicit calls and FSDP2 are seen while calls torch makes internally
(``send`` → ``isend``) are not: one row per user-visible call. C++ collectives (DDP's
built-in path) are not seen here; the functional collectives are (``torch_funcol``).

Group ids are the same on every rank (see `_group_id`); point-to-point traffic gets
virtual groups per direction (`p2p_group_id`).
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
from rankscope.collector.torch_mesh import state as _mesh

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


_ALL_REDUCE = schema.OP_INDEX["all_reduce"]
_ASYNC = schema.FLAG_ASYNC
_BUCKET = schema.FLAG_DDP_BUCKET
_DEV = FLAG_PENDING
_WAIT = schema.PHASE_INDEX["pp_wait"]


class _State:
    """Module state: the monitor, group ids, originals to restore."""

    def __init__(self) -> None:
        self.mon: Monitor | None = None
        self.gids: dict[Any, int] = {None: 0}
        self.originals: list[tuple[Any, str, Any]] = []
        self.handles: list[Any] = []
        self.step_optimizer: int | None = None
        self.opt_t0 = 0
        self.opt_c0 = -1
        """Thread CPU clock when the step optimizer's step began."""
        self.timer: Any = None
        self.cuda = False
        self.lock = threading.Lock()
        self.orig_all_reduce: Any = None
        self.engine: Any = None
        """torch's autograd engine (end-of-backward callbacks)."""
        self.tensor_type: Any = None
        """``torch.Tensor`` (a subclass's outputs take the public hook path)."""
        self.backend = ""
        self.generation = 1
        """Bumped by ``uninstall``: models instrumented before get their hooks again."""
        self.links: dict[int, list[int]] = {}
        """Point-to-point group -> [step, messages so far in it] (explicit pipelines)."""
        self.routed: dict[Any, list[int]] = {}
        """Group -> the split sizes this rank last received on it (all-to-all)."""
        self.setup = True
        """Look for new meshes, groups and a pipelining import at the next step boundary."""


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


def _never() -> bool:
    return False


def compiling_check() -> Any:
    """A function that says True while ``torch.compile`` traces its caller:
    ``torch.compiler.is_dynamo_compiling`` (a plain ``return False`` when run, 30 ns;
    ``is_compiling`` checks TorchScript first, 120 ns, on every collective), else
    ``is_compiling``, else one that always says False (a torch without either)."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    for name in ("is_dynamo_compiling", "is_compiling"):
        check = getattr(compiler, name, None)
        if callable(check):
            return check
    return _never


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
    compiling = compiling_check()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mon = state.mon
        if mon is None or compiling():
            # Inside a region torch.compile traces, the call is the graph's: traced as if
            # rankscope were not there (a full graph stays whole), and not recorded.
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
            pp = 0
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
                if peer in _mesh.pp_ranks:
                    pp = _pipeline_flags(mon, gid)
                    if out is None or type(out) is int:
                        mon._rec_phase(_WAIT, t0, t1, -1)  # blocked on the next stage
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
                    mon._rec_coll(op_i, gid, nbytes, t0, t1, pp)
                else:
                    row = mon._rec_coll(op_i, gid, nbytes, t0, t1, _DEV | pp)
                    if row >= 0:
                        state.timer.track(row, ev0, state.timer.event())
            else:
                row = mon._rec_coll(op_i, gid, nbytes, t0, NO_TIME, _ASYNC | _DEV | pp)
                if row >= 0:
                    _on_done(mon, out, row, ev0)
        except Exception as exc:  # never let bookkeeping break the training step
            mon._error("collective_wrapper", exc)
        return out

    wrapper.__rankscope_original__ = fn  # type: ignore[attr-defined]
    if op == "all_to_all":
        return _route(fn.__name__, fn, wrapper)
    if kind != _T or p2p:
        return wrapper
    general = wrapper

    @functools.wraps(fn)
    def tensor_wrapper(*args: Any, **kwargs: Any) -> Any:
        # The common case, one input tensor on the host and no peer: the general wrapper's
        # steps less the branches that cannot apply (it runs on every collective).
        mon = state.mon
        if mon is None or state.cuda or compiling():
            return general(*args, **kwargs)
        t0 = mono()
        out = fn(*args, **kwargs)
        t1 = mono()
        try:
            if kwargs:
                group = (
                    kwargs["group"]
                    if "group" in kwargs
                    else (args[g_pos] if len(args) > g_pos else None)
                )
                x = kwargs[in_name] if in_name in kwargs else args[in_pos]
            else:
                group = args[g_pos] if len(args) > g_pos else None
                x = args[in_pos]
            gid = gids.get(group)
            if gid is None:
                gid = _group_id(group)
            if gid >= 0:
                if out is None or type(out) is int:
                    mon._rec_coll(op_i, gid, x.nbytes, t0, t1, 0)
                else:
                    row = mon._rec_coll(op_i, gid, x.nbytes, t0, NO_TIME, _ASYNC | _DEV)
                    if row >= 0:
                        _on_done(mon, out, row, None)
        except Exception as exc:  # never let bookkeeping break the training step
            mon._error("collective_wrapper", exc)
        return out

    tensor_wrapper.__rankscope_original__ = fn  # type: ignore[attr-defined]
    return tensor_wrapper


def _pipeline_flags(mon: Monitor, gid: int) -> int:
    """Stage (this rank's ``pp`` coordinate) and micro-batch (the message's index on this
    link within the step) of an explicit pipeline send/recv, as flag bits."""
    step = mon._step
    link = _state.links.get(gid)
    if link is None or link[0] != step:
        link = _state.links[gid] = [step, 0]
    micro = link[1]
    link[1] = micro + 1
    return schema.pp_flags(mon.identity.mesh.get("pp", -1), micro)


def _split_sizes(sizes: Any, tensors: Any) -> list[int] | None:
    if sizes is not None:
        return [int(n) for n in sizes]
    if tensors is not None and isinstance(tensors, (list, tuple)):
        return [int(t.shape[0]) if t.dim() else 1 for t in tensors]
    return None


def _route(name: str, fn: Any, inner: Any) -> Any:
    """An all-to-all wrapper that also counts the rows this rank receives as
    ``expert_tokens``: with per-destination split sizes (``all_to_all_single``'s
    ``output_split_sizes``, or the sizes of ``all_to_all``'s output tensors) the rows each
    rank's experts get. The reverse exchange that returns expert outputs (its input splits
    are the splits received before on the same group) is not counted again."""
    params = list(inspect.signature(fn).parameters)
    if name == "all_to_all_single":
        out_name, in_name, tensors = "output_split_sizes", "input_split_sizes", False
    else:
        out_name, in_name, tensors = "output_tensor_list", "input_tensor_list", True
    out_pos, in_pos = params.index(out_name), params.index(in_name)
    g_pos = params.index("group")

    def arg(args: tuple, kwargs: dict, key: str, pos: int) -> Any:
        return kwargs[key] if key in kwargs else (args[pos] if len(args) > pos else None)

    compiling = compiling_check()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        mon = _state.mon
        if mon is None or compiling():
            return out
        try:
            got_raw = arg(args, kwargs, out_name, out_pos)
            sent_raw = arg(args, kwargs, in_name, in_pos)
            got = _split_sizes(None, got_raw) if tensors else _split_sizes(got_raw, None)
            if got is not None:
                sent = _split_sizes(None, sent_raw) if tensors else _split_sizes(sent_raw, None)
                group = arg(args, kwargs, "group", g_pos)
                if sent is not None and _state.routed.get(group) == sent:
                    _state.routed.pop(group, None)  # the combine: these rows came back
                else:
                    _state.routed[group] = got
                    mon.work(expert_tokens=sum(got))
        except Exception as exc:
            mon._error("all_to_all_splits", exc)
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
