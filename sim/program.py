"""The per-step program every rank runs, and the order the simulator executes it in.

One step of one pipeline stage is a fixed list of operations: the input wait; for each micro
batch a forward pass (per layer: attention block, tensor-parallel all-reduce, MLP block,
all-reduce); the backward passes in reverse, the last one issuing the data-parallel gradient
buckets asynchronously as layers finish (like DDP); waiting for the buckets; the optimizer.
Pipeline stages exchange activations and gradients with send/recv (a GPipe schedule: all
forwards, then all backwards).

The program is the same for every rank of a stage, so the simulator walks it once per step
and applies each operation to all ranks of the stage at once (numpy over ``(dp, tp)``).
The execution order interleaves stages so that a receive is always processed after the
matching send and before the sender's next operation.
"""

from __future__ import annotations

from dataclasses import dataclass

# Operation kinds.
INPUT, BEGIN, END, COMPUTE, TP_ALLREDUCE, BUCKET, WAIT_BUCKETS, SEND, RECV, MEMORY, OPTIMIZER = (
    range(11)
)
CHECKPOINT, BARRIER = 11, 12

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
    For ``BEGIN``/``END``: ``phase`` names the span.
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


@dataclass(frozen=True)
class Program:
    """The execution order of one step, and counts the executor needs."""

    ops: tuple[Op, ...]
    n_compute: int
    """Compute spans per stage and step."""
    n_tp: int
    """Tensor-parallel all-reduces per stage and step."""
    n_buckets: int
    n_p2p: int
    """Send/recv instances per pipeline boundary and step."""


def _stage_forward(s: int, m: int, layers: int, tp: int, counters: dict[str, int]) -> list[Op]:
    ops = [Op(BEGIN, s, phase="forward")]
    for _ in range(layers):
        for lin, attn in ((FWD_LINEAR_ATTN_BLOCK, 1.0), (1.0 - FWD_LINEAR_ATTN_BLOCK, 0.0)):
            ops.append(Op(COMPUTE, s, micro=m, linear=lin / layers, attn=attn / layers))
            if tp > 1:
                ops.append(Op(TP_ALLREDUCE, s, micro=m, index=counters["tp"]))
                counters["tp"] += 1
    ops.append(Op(END, s, phase="forward"))
    return ops


def _stage_backward(
    s: int, m: int, layers: int, tp: int, buckets: int, last: bool, counters: dict[str, int]
) -> list[Op]:
    ops = [Op(BEGIN, s, phase="backward")]
    # Bucket b is full once the backward pass has covered its share of the layers.
    due = [round(layers * (b + 1) / buckets) for b in range(buckets)]
    issued = 0
    for done in range(1, layers + 1):
        for lin, attn in ((1.0 - FWD_LINEAR_ATTN_BLOCK, 0.0), (FWD_LINEAR_ATTN_BLOCK, 1.0)):
            # backward costs twice the forward
            ops.append(Op(COMPUTE, s, micro=m, linear=2 * lin / layers, attn=2 * attn / layers))
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
        ):
            out[-1] = Op(
                COMPUTE,
                op.stage,
                micro=op.micro,
                linear=prev.linear + op.linear,
                attn=prev.attn + op.attn,
            )
        else:
            out.append(op)
    return out


def _pipeline(
    pp: int, tp: int, layers: int, accum: int, n_buckets: int, counters: list[dict[str, int]]
) -> list[Op]:
    """GPipe: every micro batch forward through the stages, then every one backward."""
    ops: list[Op] = []
    for m in range(accum):
        for s in range(pp):
            if s > 0:
                ops.append(Op(RECV, s, micro=m, boundary=s - 1, index=m))
            ops += _stage_forward(s, m, layers, tp, counters[s])
            if s < pp - 1:
                ops.append(Op(SEND, s, micro=m, boundary=s, index=m))
    for m in range(accum):
        for s in reversed(range(pp)):
            if s < pp - 1:
                ops.append(Op(RECV, s, micro=m, boundary=s, backward=True, index=accum + m))
            last = m == accum - 1
            ops += _stage_backward(s, m, layers, tp, n_buckets, last, counters[s])
            if s > 0:
                ops.append(Op(SEND, s, micro=m, boundary=s - 1, backward=True, index=accum + m))
    return ops


def build_program(
    pp: int, tp: int, dp: int, layers_per_stage: int, accum: int, buckets: int
) -> Program:
    """Build the step program of a layout.

    Args:
        pp: pipeline stages.
        tp: tensor-parallel degree (1: no tensor-parallel collectives).
        dp: data-parallel degree (1: no gradient all-reduce).
        layers_per_stage: transformer layers on each stage.
        accum: micro batches per step.
        buckets: gradient buckets per step.

    Returns:
        The program in execution order.
    """
    n_buckets = buckets if dp > 1 else 0
    ops: list[Op] = [Op(INPUT, s) for s in range(pp)]
    counters = [{"tp": 0} for _ in range(pp)]
    if pp == 1:
        # Without a pipeline each micro batch runs forward then backward (gradient
        # accumulation); buckets go out during the last backward.
        for m in range(accum):
            ops += _stage_forward(0, m, layers_per_stage, tp, counters[0])
            last = m == accum - 1
            ops += _stage_backward(0, m, layers_per_stage, tp, n_buckets, last, counters[0])
    else:
        ops += _pipeline(pp, tp, layers_per_stage, accum, n_buckets, counters)
    for s in range(pp):
        if n_buckets:
            ops.append(Op(WAIT_BUCKETS, s))
        ops += [Op(MEMORY, s), Op(OPTIMIZER, s)]
    ops = _merge_compute(ops)
    numbered = []
    per_stage = [0] * pp
    for op in ops:
        if op.kind == COMPUTE:
            op = Op(
                COMPUTE,
                op.stage,
                micro=op.micro,
                linear=op.linear,
                attn=op.attn,
                index=per_stage[op.stage],
            )
            per_stage[op.stage] += 1
        numbered.append(op)
    n_compute = per_stage[0]
    return Program(
        ops=tuple(numbered),
        n_compute=n_compute,
        n_tp=counters[0]["tp"],
        n_buckets=n_buckets,
        n_p2p=2 * accum if pp > 1 else 0,
    )
