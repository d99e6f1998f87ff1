"""The per-step program every rank runs, and the order the simulator executes it in.

One step of one pipeline stage is a fixed list of operations: the input wait; for each micro
batch a forward pass (per layer: attention block, tensor-parallel all-reduce, MLP block,
all-reduce; in a mixture-of-experts layer the MLP block is an all-to-all that dispatches
tokens to the expert-parallel ranks holding their experts, the experts' compute on the
tokens each rank received, and an all-to-all that brings the results back); the backward
passes in reverse, the last one issuing the data-parallel gradient
buckets asynchronously as layers finish (like DDP); waiting for the buckets; the optimizer.
Pipeline stages exchange activations and gradients with send/recv (a GPipe schedule: all
forwards, then all backwards).

The program is the same for every rank of a stage, so the simulator walks it once per step
and applies each operation to all ranks of the stage at once (numpy over ``(dp, tp)``).
The execution order interleaves stages so that a receive is always processed after the
matching send and before the sender's next operation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Operation kinds.
INPUT, BEGIN, END, COMPUTE, TP_ALLREDUCE, BUCKET, WAIT_BUCKETS, SEND, RECV, MEMORY, OPTIMIZER = (
    range(11)
)
CHECKPOINT, BARRIER, ALL_TO_ALL = 11, 12, 13
BOUNDARIES = (BEGIN, INPUT, MEMORY, OPTIMIZER)
"""Operations that start a recorded phase; host time between phases is spent before them,
and their ``index`` numbers them per stage (the boundary's slot)."""

FWD_LINEAR_ATTN_BLOCK = 1.0 / 3.0
"""Share of a layer's linear FLOPs in the attention block (QKV and output projections);
the MLP block holds the rest."""


@dataclass(frozen=True)
class Op:
    """One operation of the step program.

    ``stage`` is the pipeline stage that runs it (-1: all stages, e.g. the world barrier).
    For ``COMPUTE``: ``micro``, ``linear`` and ``attn`` (multiples of one micro batch's
    forward linear FLOPs and attention FLOPs), ``index`` (compute-span counter, for noise).
    For collectives: ``index`` counts the op's kind in the stage's step (its ``seq`` offset);
    ``boundary`` is the pipeline boundary of a send/recv, ``backward`` its direction.
    For ``BEGIN``/``END``: ``phase`` names the span. ``expert``: a compute span priced on
    the tokens routed to the rank's experts instead of its own tokens. For ``ALL_TO_ALL``:
    ``backward`` and ``combine`` say which of the four exchanges of a layer it is.
    """

    kind: int
    stage: int
    micro: int = -1
    linear: float = 0.0
    attn: float = 0.0
    index: int = 0
    boundary: int = -1
    backward: bool = False
    phase: str = ""
    expert: bool = False
    combine: bool = False


@dataclass(frozen=True)
class Program:
    """The execution order of one step, and counts the executor needs."""

    ops: tuple[Op, ...]
    n_compute: int
    """Compute spans per stage and step."""
    n_tp: int
    """Tensor-parallel all-reduces per step on stage 0."""
    n_buckets: int
    n_p2p: int
    """Send/recv instances per pipeline boundary and step."""
    n_tp_stage: tuple[int, ...] = ()
    """Tensor-parallel all-reduces per step on each stage (stages may hold unequal layers)."""
    n_a2a_stage: tuple[int, ...] = ()
    """Expert all-to-alls per step on each stage."""
    n_slots: int = 0
    """Phase boundaries (host gap slots) per step on the stage with the most."""


def _stage_forward(
    s: int, m: int, layers: int, share: int, tp: int, moe: bool, counters: dict[str, int]
) -> list[Op]:
    """``layers`` on this stage; each costs ``1 / share`` of an even stage's work."""
    ops = [Op(BEGIN, s, phase="forward")]
    for _ in range(layers):
        lin, attn = FWD_LINEAR_ATTN_BLOCK, 1.0
        ops.append(Op(COMPUTE, s, micro=m, linear=lin / share, attn=attn / share))
        if tp > 1:
            ops.append(Op(TP_ALLREDUCE, s, micro=m, index=counters["tp"]))
            counters["tp"] += 1
        lin = 1.0 - FWD_LINEAR_ATTN_BLOCK
        if moe:
            ops += _a2a(s, m, False, False, counters)
            ops.append(Op(COMPUTE, s, micro=m, linear=lin / share, expert=True))
            ops += _a2a(s, m, False, True, counters)
            continue
        ops.append(Op(COMPUTE, s, micro=m, linear=lin / share))
        if tp > 1:
            ops.append(Op(TP_ALLREDUCE, s, micro=m, index=counters["tp"]))
            counters["tp"] += 1
    ops.append(Op(END, s, phase="forward"))
    return ops


def _a2a(s: int, m: int, backward: bool, combine: bool, counters: dict[str, int]) -> list[Op]:
    op = Op(ALL_TO_ALL, s, micro=m, index=counters["a2a"], backward=backward, combine=combine)
    counters["a2a"] += 1
    return [op]


def _stage_backward(
    s: int,
    m: int,
    layers: int,
    share: int,
    tp: int,
    moe: bool,
    buckets: int,
    last: bool,
    counters: dict[str, int],
) -> list[Op]:
    ops = [Op(BEGIN, s, phase="backward")]
    # Bucket b is full once the backward pass has covered its share of the layers.
    due = [round(layers * (b + 1) / buckets) for b in range(buckets)]
    issued = 0
    for done in range(1, layers + 1):
        # backward costs twice the forward
        lin = 2 * (1.0 - FWD_LINEAR_ATTN_BLOCK) / share
        if moe:
            ops += _a2a(s, m, True, False, counters)
            ops.append(Op(COMPUTE, s, micro=m, linear=lin, expert=True))
            ops += _a2a(s, m, True, True, counters)
        else:
            ops.append(Op(COMPUTE, s, micro=m, linear=lin))
            if tp > 1:
                ops.append(Op(TP_ALLREDUCE, s, micro=m, index=counters["tp"]))
                counters["tp"] += 1
        lin, attn = 2 * FWD_LINEAR_ATTN_BLOCK / share, 2.0 / share
        ops.append(Op(COMPUTE, s, micro=m, linear=lin, attn=attn))
        if tp > 1:
            ops.append(Op(TP_ALLREDUCE, s, micro=m, index=counters["tp"]))
            counters["tp"] += 1
        while last and issued < buckets and due[issued] <= done:
            ops.append(Op(BUCKET, s, index=issued))
            issued += 1
    ops.append(Op(END, s, phase="backward"))
    return ops


def _merge_compute(ops: list[Op]) -> list[Op]:
    """Adjacent compute spans of one stage and micro batch become one (nothing happens
    between them that another rank could see)."""
    out: list[Op] = []
    for op in ops:
        prev = out[-1] if out else None
        if (
            op.kind == COMPUTE
            and prev is not None
            and prev.kind == COMPUTE
            and prev.stage == op.stage
            and prev.micro == op.micro
            and prev.expert == op.expert
        ):
            out[-1] = Op(
                COMPUTE,
                op.stage,
                micro=op.micro,
                linear=prev.linear + op.linear,
                attn=prev.attn + op.attn,
                expert=op.expert,
            )
        else:
            out.append(op)
    return out


def _pipeline(
    layers: tuple[int, ...],
    share: int,
    tp: int,
    moe: bool,
    accum: int,
    n_buckets: int,
    counters: list[dict[str, int]],
) -> list[Op]:
    """GPipe: every micro batch forward through the stages, then every one backward."""
    pp = len(layers)
    ops: list[Op] = []
    for m in range(accum):
        for s in range(pp):
            if s > 0:
                ops.append(Op(RECV, s, micro=m, boundary=s - 1, index=m))
            ops += _stage_forward(s, m, layers[s], share, tp, moe, counters[s])
            if s < pp - 1:
                ops.append(Op(SEND, s, micro=m, boundary=s, index=m))
    for m in range(accum):
        for s in reversed(range(pp)):
            if s < pp - 1:
                ops.append(Op(RECV, s, micro=m, boundary=s, backward=True, index=accum + m))
            last = m == accum - 1
            ops += _stage_backward(s, m, layers[s], share, tp, moe, n_buckets, last, counters[s])
            if s > 0:
                ops.append(Op(SEND, s, micro=m, boundary=s - 1, backward=True, index=accum + m))
    return ops


def split_layers(layers: int, pp: int, heavy: int = -1, ratio: float = 1.0) -> tuple[int, ...]:
    """Layers per pipeline stage.

    Args:
        layers: the model's layers.
        pp: stages.
        heavy: a stage that holds more than its share (-1: an even split).
        ratio: its layers over the mean of the other stages' (before rounding).

    Returns:
        Layers of each stage: ``layers // pp`` each for an even split; otherwise the same
        total with ``heavy`` holding more and the rest spread as evenly as whole layers go.
    """
    share = max(1, layers // pp)
    if heavy < 0 or pp < 2:
        return (share,) * pp
    total = share * pp
    h = round(ratio * total / (pp - 1 + ratio))
    h = min(max(h, share + 1), total - (pp - 1))
    rest, extra = divmod(total - h, pp - 1)
    others = [rest + (1 if i < extra else 0) for i in range(pp - 1)]
    return (*others[:heavy], h, *others[heavy:])


def build_program(
    pp: int,
    tp: int,
    dp: int,
    layers_per_stage: int | tuple[int, ...],
    accum: int,
    buckets: int,
    *,
    share: int | None = None,
    moe: bool = False,
) -> Program:
    """Build the step program of a layout.

    Args:
        pp: pipeline stages.
        tp: tensor-parallel degree (1: no tensor-parallel collectives).
        dp: data-parallel degree (1: no gradient all-reduce).
        layers_per_stage: transformer layers on each stage (one number: the same on all).
        accum: micro batches per step.
        buckets: gradient buckets per step.
        share: layers of an even split (a layer costs ``1 / share`` of an even stage's
            work; default: ``layers_per_stage`` of stage 0).
        moe: the MLP blocks are experts behind all-to-all exchanges.

    Returns:
        The program in execution order.
    """
    layers = (
        tuple(layers_per_stage) if isinstance(layers_per_stage, tuple) else (layers_per_stage,) * pp
    )
    share = share or layers[0]
    n_buckets = buckets if dp > 1 else 0
    ops: list[Op] = [Op(INPUT, s) for s in range(pp)]
    counters = [{"tp": 0, "a2a": 0} for _ in range(pp)]
    if pp == 1:
        # Without a pipeline each micro batch runs forward then backward (gradient
        # accumulation); buckets go out during the last backward.
        for m in range(accum):
            ops += _stage_forward(0, m, layers[0], share, tp, moe, counters[0])
            last = m == accum - 1
            ops += _stage_backward(0, m, layers[0], share, tp, moe, n_buckets, last, counters[0])
    else:
        ops += _pipeline(layers, share, tp, moe, accum, n_buckets, counters)
    for s in range(pp):
        if n_buckets:
            ops.append(Op(WAIT_BUCKETS, s))
        ops += [Op(MEMORY, s), Op(OPTIMIZER, s)]
    ops = _merge_compute(ops)
    numbered = []
    per_stage = [0] * pp
    slots = [0] * pp
    for op in ops:
        if op.kind == COMPUTE:
            op = dataclasses.replace(op, index=per_stage[op.stage])
            per_stage[op.stage] += 1
        elif op.kind in BOUNDARIES:
            op = dataclasses.replace(op, index=slots[op.stage])
            slots[op.stage] += 1
        numbered.append(op)
    return Program(
        ops=tuple(numbered),
        n_compute=max(per_stage),
        n_tp=counters[0]["tp"],
        n_buckets=n_buckets,
        n_p2p=2 * accum if pp > 1 else 0,
        n_tp_stage=tuple(c["tp"] for c in counters),
        n_a2a_stage=tuple(c["a2a"] for c in counters),
        n_slots=max(slots),
    )
