"""Functional collectives (``torch.distributed._functional_collectives``), as tensor
parallelism issues them.

DTensor's redistributions — ``ColwiseParallel``/``RowwiseParallel``'s all-reduce of a
partial sum, sequence parallelism's all-gather and reduce-scatter, in forward and in
backward — do not call ``torch.distributed.all_reduce``: they call the functional
collectives, which run the C++ op and return at once with an ``AsyncCollectiveTensor``. The
training thread blocks only when it first uses the result (``wait_tensor``). So a row here
has its entry at the call and its exit at the end of that first wait: what the thread
waited for, which is the collective's completion or later (a result used long after it
arrived reads as a longer collective; tensor parallelism uses it at the next operation).
A call that returns a plain tensor (torch waited inside: tracing, a torch that has no
async wrapper) ends where the call returns.

Only the module attributes are wrapped (``funcol.all_reduce``...), which is how DTensor
calls them. Not seen: the collectives that autograd runs for the backward of a functional
collective called directly with ``requires_grad`` (``all_gather_single``'s reduce-scatter;
torch registers those on the C++ op), and any inside a ``torch.compile``d region (the
graph's, as for every wrapper).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from rankscope.collector import schema
from rankscope.collector.pump import FLAG_PENDING
from rankscope.collector.torch_collectives import _group_id, _state, compiling_check

MODULE = "torch.distributed._functional_collectives"

FUNCTIONS: dict[str, str] = {
    # wrapped name: schema op (the first parameter, ``self``, is the input: a tensor, or
    # a list of tensors for the coalesced forms)
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
"""Every wrapped function. In torch 2.13 ``all_gather_tensor`` calls ``all_gather_single``
(in earlier versions the reverse holds): a call inside another wrapped call is not
recorded again, so either way one call is one row."""

MAX_PENDING = 4096
"""Launched collectives whose result was not waited for yet; past this the oldest ships
without an exit time (a program that never uses its results cannot grow the table)."""

_ASYNC = schema.FLAG_ASYNC
NO_TIME = schema.NO_TIME


class _Inside(threading.local):
    on = False
    """True while this thread is inside a wrapped call (a class default: reading a
    thread-local attribute that was never set raises and catches, ~0.8 µs)."""


class _Funcol:
    def __init__(self) -> None:
        self.pending: dict[int, tuple[Any, list[int]]] = {}
        """id(result tensor) -> (weak reference to it, [ring row, results not waited])."""
        self.inside = _Inside()
        self.names: dict[str, int] = {}
        """Group name -> group id."""
        self.patched = False


_fc = _Funcol()


def _gid(funcol: Any, group: Any, tag: str) -> int:
    """Group id of any form a functional collective accepts (process group, mesh, mesh
    and dimension, group name, list of ranks); -1 when unknown or not a member."""
    gids = _state.gids
    key = ("ranks", tuple(group), tag) if type(group) is list else group
    gid = gids.get(key)
    if gid is not None:
        return gid
    with warnings.catch_warnings():
        # A list of ranks is deprecated: torch has told the program once already.
        warnings.simplefilter("ignore", FutureWarning)
        resolved = funcol._resolve_group(group, tag)
    if isinstance(resolved, str):
        gid = _fc.names.get(resolved)
        if gid is None:
            c10d = sys.modules["torch.distributed.distributed_c10d"]
            gid = _group_id(c10d._resolve_process_group(resolved))
            _fc.names[resolved] = gid
    else:
        gid = _group_id(resolved)
    gids[key] = gid
    return gid


def _wrap(funcol: Any, fn: Any, op: str) -> Any:
    params = list(inspect.signature(fn).parameters)
    g_pos = params.index("group")
    t_pos = params.index("tag") if "tag" in params else -1
    op_i = schema.OP_INDEX[op]
    mono = time.monotonic_ns
    compiling = compiling_check()
    tracing = getattr(funcol, "_are_we_tracing", lambda: False)
    async_type = getattr(funcol, "AsyncCollectiveTensor", None)
    inside = _fc.inside
    pending = _fc.pending

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mon = _state.mon
        if mon is None or inside.on or compiling():
            return fn(*args, **kwargs)
        inside.on = True
        try:
            t0 = mono()
            out = fn(*args, **kwargs)
            t1 = mono()
        finally:
            inside.on = False
        try:
            if type(out) is async_type:
                waits = [out]
            elif isinstance(out, list):
                waits = [r for r in out if type(r) is async_type]
            else:
                waits = []
            # An async result is made only when torch is not tracing; a plain one may be
            # a traced call's (make_fx, export), which is not a collective that ran.
            if not waits and tracing():
                return out
            group = kwargs["group"] if "group" in kwargs else args[g_pos]
            gid = _state.gids.get(group) if type(group) is not list else None
            if gid is None:  # first use of this group, or a list of ranks
                tag = kwargs.get("tag", args[t_pos] if 0 <= t_pos < len(args) else "")
                gid = _gid(funcol, group, tag)
            if gid < 0:
                return out
            x = kwargs["self"] if "self" in kwargs else args[0]
            nbytes = x.nbytes if type(x) is not list else sum(t.nbytes for t in x)
            if not waits:
                mon._rec_coll(op_i, gid, nbytes, t0, t1, 0)
                return out
            row = mon._rec_coll(op_i, gid, nbytes, t0, NO_TIME, _ASYNC | FLAG_PENDING)
            if row < 0:
                return out
            # Coalesced results are waited one by one: the row ends with the last.
            cell = [row, len(waits)]
            for r in waits:
                if len(pending) >= MAX_PENDING:
                    _, (_, old) = _oldest(pending)
                    if old[1] > 0:
                        old[1] = 0
                        mon._colls.complete(old[0], "t_exit", NO_TIME, FLAG_PENDING)
                elem = r.elem
                pending[id(elem)] = (weakref.ref(elem), cell)
        except Exception as exc:  # never let bookkeeping break the training step
            mon._error("funcol_wrapper", exc)
        return out

    wrapper.__rankscope_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _oldest(pending: dict[int, tuple[Any, list[int]]]) -> tuple[int, tuple[Any, list[int]]]:
    key = next(iter(pending))
    return key, pending.pop(key)


def _wrap_wait(fn: Any) -> Any:
    mono = time.monotonic_ns
    pending = _fc.pending

    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        out = fn(tensor)
        if pending:
            entry = pending.pop(id(tensor), None)
            mon = _state.mon
            if entry is not None and mon is not None and entry[0]() is tensor:
                cell = entry[1]
                cell[1] -= 1
                if cell[1] == 0:
                    mon._colls.complete(cell[0], "t_exit", mono(), FLAG_PENDING)
        return out

    wait_tensor.__rankscope_original__ = fn  # type: ignore[attr-defined]
    return wait_tensor


def patched() -> bool:
    """Whether the functional collectives are wrapped."""
    return _fc.patched


def install(patch: Any) -> bool:
    """Wrap the functional collectives once the program has imported them (DTensor and
    tensor parallelism do; checked at install and at step boundaries, as the pipelining
    patch is): a program that never uses them does not load them for rankscope's sake.
    ``patch(owner, name, new)`` records the original for ``uninstall``. Returns whether
    they are wrapped."""
    if _fc.patched:
        return True
    funcol = sys.modules.get(MODULE)
    if funcol is None:
        return False
    mon = _state.mon
    for name, op in FUNCTIONS.items():
        fn = getattr(funcol, name, None)
        if fn is None or hasattr(fn, "__rankscope_original__"):
            continue
        try:
            patch(funcol, name, _wrap(funcol, fn, op))
        except (ValueError, TypeError) as exc:  # a signature this version does not have
            if mon is not None:
                mon._error("wrap_funcol_" + name, exc)
    wait = getattr(funcol, "wait_tensor", None)
    if wait is not None and not hasattr(wait, "__rankscope_original__"):
        patch(funcol, "wait_tensor", _wrap_wait(wait))
    _fc.patched = True
    return True


def uninstall() -> None:
    """Forget pending rows and names (the originals are restored by the caller)."""
    _fc.pending.clear()
    _fc.names.clear()
    _fc.patched = False
