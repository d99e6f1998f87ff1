"""Pipeline parallelism: ``torch.distributed.pipelining`` schedules and explicit send/recv.

What is recorded, for GPipe, 1F1B, interleaved and the other schedules of
``torch.distributed.pipelining`` (all run their stages through the same stage methods and
point-to-point helpers, patched here on the class and module, so names a script bound
early do not matter):

- one ``forward`` phase per micro-batch a stage computes (``forward_one_chunk``) and one
  ``backward`` phase per backward chunk (input and weight gradients);
- one ``send``/``recv`` collective row per ``P2POp`` the schedule issues, with its stage
  and micro-batch id in the flag bits (``schema.pp_flags``), the peer's point-to-point
  group, and its exit when the ``Work`` completes;
- one ``pp_wait`` phase per wait on those operations (``_wait_batch_p2p``): the pipeline
  bubbles, measured where the stage sits idle.

A rank with no ``pp`` mesh coordinate takes its stage's rank in the pipeline group as one.
Explicit pipelines (blocking ``send``/``recv`` between the ranks of the ``pp`` mesh
group) get ``pp_wait`` spans and stage ids from `torch_collectives`; their micro-batch id
is the message's index on that link within the step.

``P2POp`` is made to hold torch's own ``isend``/``irecv`` even when built from the wrapped
ones, because ``batch_isend_irecv`` tells the two apart by identity.
"""

from __future__ import annotations

import functools
import sys
import time
from time import thread_time_ns
from typing import Any

from rankscope.collector import schema, torch_mesh
from rankscope.collector.torch_collectives import NO_TIME, _on_done, _p2p_group, _state

_SEND = schema.OP_INDEX["send"]
_RECV = schema.OP_INDEX["recv"]
_ASYNC = schema.FLAG_ASYNC
_FWD = schema.PHASE_INDEX["forward"]
_BWD = schema.PHASE_INDEX["backward"]
_WAIT = schema.PHASE_INDEX["pp_wait"]
_TAG = "_rankscope_pp"
"""Attribute of a ``P2POp`` holding ``(stage, micro-batch)``."""


class _PipeState:
    def __init__(self) -> None:
        self.schedules_patched = False
        self.in_batch = False
        """Inside a schedule's batch: ``batch_isend_irecv`` rows are the batch's."""
        self.stage_noted = False


pipe = _PipeState()


def _patch(owner: Any, name: str, new: Any) -> None:
    _state.originals.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _record_ops(mon: Any, ops: list, works: Any, t0: int) -> None:
    """One async row per point-to-point op; exits from the works (one per op, or one for
    a coalesced batch)."""
    me = mon.identity.rank
    backend = _state.backend
    works = list(works or [])
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    for i, p in enumerate(ops):
        is_send = p.op is c10d.isend
        peer = int(p.peer)
        src, dst = (me, peer) if is_send else (peer, me)
        gid = _state.gids.get(("p2p", src, dst)) or _p2p_group(src, dst, backend)
        if gid < 0:
            continue
        tag = getattr(p, _TAG, None)
        flags = _ASYNC | (schema.pp_flags(*tag) if tag is not None else 0)
        row = mon._rec_coll(_SEND if is_send else _RECV, gid, p.tensor.nbytes, t0, NO_TIME, flags)
        if row < 0:
            continue
        work = works[i] if len(works) == len(ops) else (works[-1] if works else None)
        if work is None:
            mon._colls.complete(row, "t_exit", NO_TIME, 0)
        else:
            _on_done(mon, work, row, None)


def _p2pop_patch(c10d: Any) -> None:
    cls = c10d.P2POp
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self: Any, op: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, getattr(op, "__rankscope_original__", op), *args, **kwargs)

    _patch(cls, "__init__", __init__)
    orig_new = cls.__dict__.get("__new__")
    if isinstance(orig_new, staticmethod):
        orig_new = orig_new.__func__
    if orig_new is not None:

        def __new__(klass: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return orig_new(klass, getattr(op, "__rankscope_original__", op), *args, **kwargs)

        _patch(cls, "__new__", staticmethod(__new__))


def _batch_patch(dist: Any) -> None:
    orig = dist.batch_isend_irecv
    if hasattr(orig, "__rankscope_original__"):
        return
    mono = time.monotonic_ns

    @functools.wraps(orig)
    def batch_isend_irecv(p2p_op_list: list) -> Any:
        mon = _state.mon
        if mon is None or pipe.in_batch:
            return orig(p2p_op_list)
        t0 = mono()
        works = orig(p2p_op_list)
        try:
            _record_ops(mon, p2p_op_list, works, t0)
        except Exception as exc:
            mon._error("batch_p2p", exc)
        return works

    batch_isend_irecv.__rankscope_original__ = orig  # type: ignore[attr-defined]
    _patch(dist, "batch_isend_irecv", batch_isend_irecv)


def _note_stage(mon: Any, stage: Any) -> None:
    """A rank with no ``pp`` coordinate takes its rank in the stage's pipeline group."""
    pipe.stage_noted = True
    if "pp" in mon.identity.mesh:
        return
    try:
        coords = dict(mon.identity.mesh)
        coords["pp"] = int(stage.group_rank)
        torch_mesh.state.from_groups["pp"] = coords["pp"]
        dist = sys.modules["torch.distributed"]
        torch_mesh.state.pp_ranks = frozenset(dist.get_process_group_ranks(stage.group))
        mon.update_identity(mesh=coords)
    except Exception as exc:
        mon._error("pipeline_stage", exc)


def _phase_method(cls: Any, name: str, phase: int) -> None:
    orig = getattr(cls, name)
    mono = time.monotonic_ns

    @functools.wraps(orig)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        mon = _state.mon
        if mon is None:
            return orig(self, *args, **kwargs)
        if not pipe.stage_noted:
            _note_stage(mon, self)
        t0, c0 = mono(), thread_time_ns()
        out = orig(self, *args, **kwargs)
        mon._rec_phase(phase, t0, mono(), thread_time_ns() - c0)
        return out

    _patch(cls, name, method)


def _ops_method(cls: Any, name: str) -> None:
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def method(self: Any, chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        ops = orig(self, chunk_id, *args, **kwargs)
        if _state.mon is not None:
            tag = (int(self.stage_index), int(chunk_id))
            for p in ops:
                try:
                    setattr(p, _TAG, tag)
                except Exception:
                    pass
        return ops

    _patch(cls, name, method)


def _schedule_patches(schedules: Any, stage_mod: Any) -> None:
    orig_batch = schedules._batch_p2p
    orig_wait = schedules._wait_batch_p2p
    mono = time.monotonic_ns

    @functools.wraps(orig_batch)
    def _batch_p2p(p2p_ops: list, desc: str | None = None) -> Any:
        mon = _state.mon
        if mon is None or not p2p_ops:
            return orig_batch(p2p_ops, desc)
        t0 = mono()
        pipe.in_batch = True
        try:
            works = orig_batch(p2p_ops, desc)
        finally:
            pipe.in_batch = False
        try:
            _record_ops(mon, p2p_ops, works, t0)
        except Exception as exc:
            mon._error("pipeline_p2p", exc)
        return works

    @functools.wraps(orig_wait)
    def _wait_batch_p2p(work: Any) -> Any:
        mon = _state.mon
        if mon is None:
            return orig_wait(work)
        t0, c0 = mono(), thread_time_ns()
        out = orig_wait(work)
        mon._rec_phase(_WAIT, t0, mono(), thread_time_ns() - c0)
        return out

    _patch(schedules, "_batch_p2p", _batch_p2p)
    _patch(schedules, "_wait_batch_p2p", _wait_batch_p2p)
    base = stage_mod._PipelineStageBase
    _phase_method(base, "forward_one_chunk", _FWD)
    _phase_method(base, "backward_one_chunk", _BWD)
    if hasattr(base, "backward_weight_one_chunk"):
        _phase_method(base, "backward_weight_one_chunk", _BWD)
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        if hasattr(base, name):
            _ops_method(base, name)
    pipe.schedules_patched = True


def maybe_patch_schedules() -> None:
    """Patch ``torch.distributed.pipelining`` once the program has imported it (checked at
    install and at step boundaries, so the collector never imports it itself)."""
    if pipe.schedules_patched:
        return
    schedules = sys.modules.get("torch.distributed.pipelining.schedules")
    stage_mod = sys.modules.get("torch.distributed.pipelining.stage")
    if schedules is None or stage_mod is None:
        return
    try:
        _schedule_patches(schedules, stage_mod)
    except Exception as exc:  # another torch's internals: pipelines go unseen, training runs
        pipe.schedules_patched = True
        if _state.mon is not None:
            _state.mon._error("pipeline_patch", exc)


def install(dist: Any) -> None:
    """Install the point-to-point patches (and the schedules', when imported).

    Args:
        dist: ``torch.distributed``.
    """
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    _p2pop_patch(c10d)
    _batch_patch(dist)
    maybe_patch_schedules()


def reset() -> None:
    """After ``uninstall`` restored the originals."""
    pipe.schedules_patched = False
    pipe.in_batch = False
    pipe.stage_noted = False
