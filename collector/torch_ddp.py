"""How DDP's gradient all-reduce is timed (``Monitor.ddp_buckets``, ``monitor.DDP_BUCKET_MODES``).

Two mechanisms, chosen per model at its first forward:

- **The comm hook** (``every``, ``sampled``): a hook equivalent to DDP's default all-reduce
  times every bucket, entry when the bucket is ready, exit when its future completes
  (device times from CUDA events on a GPU). Per-bucket arrival and transfer, at the price
  of a Python call per bucket and, since any comm hook receives the bucket undivided, a
  division pass over the gradients that DDP's built-in path folds into its copy.
- **The tail** (``tail``, and ``auto`` on CPU): no hook, DDP keeps its built-in C++ path.
  One row per synchronising backward, from the moment autograd has finished this rank's
  backward (its last bucket is launched: the rank *arrives*) to the moment DDP's own
  end-of-backward callback has waited for every bucket (exit). Its arrival skew is the
  skew of the ranks' backward passes, its transfer the communication left when the last
  rank arrived: the part of the all-reduce the step waits for. Both ends are host times
  read inside autograd's final callbacks, so the tail is exact where the host waits for
  the reduction (gloo) and meaningless where it only queues it (NCCL): a CUDA model gets
  the hook instead.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from rankscope.collector import schema
from rankscope.collector.monitor import Monitor
from rankscope.collector.torch_collectives import (
    _ALL_REDUCE,
    _ASYNC,
    _BUCKET,
    _DEV,
    NO_TIME,
    _group_id,
    _state,
)

_TAIL = schema.FLAG_DDP_TAIL
_BACKWARD = schema.PHASE_INDEX["backward"]


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


class DDPTail:
    """The all-reduce tail of one DDP model (see the module docstring).

    The forward of a backward that will synchronise puts `started` as a gradient pre-hook
    on its output (``torch_hooks._watch_backward``); when backward reaches it, a final callback is queued ahead of DDP's own (DDP
    queues its callback at the first parameter's gradient, later). That callback runs once
    autograd has finished: this rank's backward is over, and it queues a second one, which
    runs after DDP's callback has waited for every bucket.

    Attributes:
        pg: the process group DDP reduces over (None: the default group).
        gid: its rankscope group id (-1: this rank is not a member).
        nbytes: bytes of the gradients reduced (parameters that require a gradient).
        phase: whether the backward phase is timed here too (the program does not mark it).
    """

    __slots__ = ("c0", "generation", "gid", "nbytes", "pg", "phase", "t0", "t_enter", "thread")

    def __init__(self, model: Any) -> None:
        self.pg = getattr(model, "process_group", None)
        self.gid = _group_id(self.pg)
        self.generation = _state.generation
        self.nbytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        )
        self.phase = True
        self.t0 = 0
        self.c0 = 0
        self.thread = 0
        self.t_enter = 0

    def started(self, _grad: Any) -> None:
        """Gradient pre-hook on the forward's output: backward has reached the model."""
        self.t0 = time.monotonic_ns()
        self.c0 = time.thread_time_ns()
        self.thread = threading.get_ident()
        try:
            _state.engine.queue_callback(self.computed)
        except Exception as exc:
            if _state.mon is not None:
                _state.mon._error("ddp_tail", exc)

    def computed(self) -> None:
        """Autograd has finished this rank's backward: the rank arrives."""
        t = time.monotonic_ns()
        mon = _state.mon
        if mon is None:
            return
        try:
            if self.phase:
                same = threading.get_ident() == self.thread
                cpu = time.thread_time_ns() - self.c0 if same else -1
                mon._rec_phase(_BACKWARD, self.t0, t, cpu)
            self.t_enter = t
            _state.engine.queue_callback(self.reduced)
        except Exception as exc:
            mon._error("ddp_tail", exc)

    def reduced(self) -> None:
        """DDP has waited for every bucket: the rank leaves the all-reduce."""
        t = time.monotonic_ns()
        mon = _state.mon
        if mon is None:
            return
        try:
            if self.generation != _state.generation:
                self.gid = _group_id(self.pg)
                self.generation = _state.generation
            if self.gid >= 0:
                mon._rec_coll(_ALL_REDUCE, self.gid, self.nbytes, self.t_enter, t, _TAIL)
        except Exception as exc:
            mon._error("ddp_tail", exc)


def _on_cpu(model: Any) -> bool:
    kind = getattr(model, "device_type", None)
    if kind is None:
        p = next(iter(model.parameters()), None)
        kind = p.device.type if p is not None else "cpu"
    return str(kind) == "cpu"


def resolve_mode(mode: str, model: Any) -> str:
    """The mechanism ``mode`` means for ``model``: ``auto`` is ``tail`` on CPU and
    ``every`` elsewhere; ``tail`` on a device model is ``every`` (see the module
    docstring)."""
    if mode in ("auto", "tail"):
        return "tail" if _on_cpu(model) else "every"
    return mode


def register(model: Any) -> None:
    """Set up the timing of ``model``'s all-reduce at its first forward, unless the program
    registered a comm hook of its own (its collectives are then seen through the wrappers)."""
    model._rankscope_hook_set = True
    if getattr(model, "_comm_hooks", None) or getattr(model, "_rankscope_user_hook", False):
        return
    mon: Monitor | None = _state.mon
    if mon is None or mon.ddp_buckets == "off":
        return  # DDP keeps its built-in C++ all-reduce
    try:
        mode = resolve_mode(mon.ddp_buckets, model)
        if mode == "tail":
            model._rankscope_tail = DDPTail(model)
            return
        every = mon.ddp_sample_every if mode == "sampled" else 1
        model.register_comm_hook(_BucketHookState(model.process_group, every), _ddp_allreduce_hook)
    except Exception as exc:  # e.g. a built-in hook registered through another path
        mon._error("ddp_comm_hook", exc)
