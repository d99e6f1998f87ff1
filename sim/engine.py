"""The simulated cluster: one step at a time, every rank at once.

Each rank keeps its own clock. A step walks the step program (`rankscope.sim.program`) and
applies each operation to all ranks of a pipeline stage as numpy arrays over ``(dp, tp)``:

- compute spans advance each rank's clock by ``FLOPs / (peak * mfu * speed)``, where the
  FLOPs come from the rank's packed tokens and Σ seq² and the speed from its GPU;
- a collective cannot finish before its last member arrives: every member leaves at
  ``max(enter) + transfer``, the transfer priced by the ring model over the slowest link
  the group crosses (``2 log2(n) α + f(n) S / bw``);
- gradient buckets are asynchronous: they queue on the group's communication stream and
  the rank waits for them only before the optimizer;
- in a mixture-of-experts layer, the expert compute of a rank follows the tokens routed to
  its experts, and the all-to-all that brings them back waits for the busiest one;
- before each phase the host spends its gap (Python, garbage collection, blocking calls:
  `rankscope.sim.host`), outside every recorded phase;
- the first ``warmup_steps`` steps run slower on every rank (communicators are set up on
  the first collective of each group, compilation and the allocator warm up), and rare
  heavy-tailed spikes slow single compute spans.

Faults only change inputs (speeds, bandwidths, input delays, the packer, the workload, the
layer split, the routing, the host's gaps and CPU share), so their signatures appear
exactly where their mechanisms reach.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rankscope.collector import schema
from rankscope.sim import program as P
from rankscope.sim.hardware import Hardware, build_hardware
from rankscope.sim.host import LAUNCH_CPU, OPTIMIZER_LAUNCH_CPU, HostModel, fill_columns
from rankscope.sim.identity import identities, manifest, truth
from rankscope.sim.spec import Scenario
from rankscope.sim.tables import StepTables, assemble
from rankscope.sim.topology import ScopeSpec, build_layout, group_links
from rankscope.sim.workload import Work, effective_workload, pack_step

_PH = schema.PHASE_INDEX
_OP_AR, _OP_SEND, _OP_RECV, _OP_BARRIER, _OP_A2A = (
    schema.OP_INDEX[k] for k in ("all_reduce", "send", "recv", "barrier", "all_to_all")
)
_TIMED = schema.FLAG_DEVICE_TIMED
_BUCKET_FLAGS = schema.FLAG_ASYNC | schema.FLAG_DDP_BUCKET | schema.FLAG_DEVICE_TIMED
NOTICE_NS = 2_000.0
"""Mean delay between a collective's completion and the host noticing it."""
ISSUE_NS = 3_000.0
"""Host cost of issuing an asynchronous bucket (the DDP comm hook)."""
STEP_GAP_NS = 40_000.0
"""Host time between one step's end and the next step's start."""
COMM_SETUP_MS = 30.0
"""Communicator set-up on a group's first collective, per doubling of its size (warm-up)."""
ROUTING_SIGMA = 0.08
"""Spread of the routing weight of each expert-parallel rank from step to step (a
load-balancing loss keeps it small)."""
SPIKE_CAP = 100.0
"""Largest spike, in multiples of ``noise.spike_ms``."""


class _Records:
    """Rows of one stage in issue order; each value broadcasts to ``(dp, tp)``."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.rows: list[tuple[Any, ...]] = []

    def add(self, *values: Any) -> None:
        self.rows.append(values)

    def stack(self, shape: tuple[int, int], dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
        """Columns as ``(n_ranks_of_stage * rows,)`` arrays, rank-major."""
        k = len(self.rows)
        n = shape[0] * shape[1]
        out = {}
        for i, name in enumerate(self.names):
            arr = np.empty((k, *shape), dtype=np.float64 if name[0] == "t" else dtypes[name])
            for j, row in enumerate(self.rows):
                arr[j] = row[i]
            out[name] = arr.reshape(k, n).T.ravel()
        return out


def _log2_hops(n: int) -> float:
    return 2.0 * math.ceil(math.log2(n)) if n > 1 else 0.0


class Cluster:
    """A simulated training job at one scope; `step` advances every rank by one step.

    Attributes:
        scenario, layout, hardware: what is simulated.
        identities: hello identity per rank.
        groups: process-group table rows.
        manifest: the run's manifest (with ``sim.truth``).
        truth: ``manifest["sim"]["truth"]``.
        next_step: the step `step` produces next.
    """

    def __init__(
        self,
        scenario: Scenario,
        scope: ScopeSpec | str | None = None,
        *,
        t0_ns: int = 0,
        argv: list[str] | None = None,
    ) -> None:
        """Build the job.

        Args:
            scenario: the resolved scenario.
            scope: which part of the cluster runs (default: full).
            t0_ns: hub-clock instant of relative time 0.
            argv: command line recorded in the manifest.

        Raises:
            ValueError: a bad scope.
        """
        self.scenario = scenario
        self.layout = lay = build_layout(scenario, scope)
        self.hardware = hw = build_hardware(scenario)
        self.workload = wl = effective_workload(scenario)
        self.t0_ns = int(t0_ns)
        self.identities = identities(scenario, lay)
        self.groups = list(lay.groups)
        self.manifest = manifest(scenario, lay, argv)
        self.truth = truth(scenario, lay)
        topo, model = scenario.topology, scenario.model
        # Local shapes come from the full layout: a reduced run keeps each rank's shard.
        tp0, pp0 = scenario.layout.tp, scenario.layout.pp
        self.layers = max(1, model.layers // pp0)
        f = scenario.fault
        heavy = f.stage if f.mechanism == "pipeline_imbalance" else -1
        # A reduced run's stage s holds the layers of the full job's stage s.
        self.stage_layers = P.split_layers(model.layers, pp0, heavy, f.magnitude)[: lay.pp]
        stage_share = np.array(self.stage_layers, dtype=np.float64) / self.layers
        p_rank = model.params_b * 1e9 / (tp0 * pp0)
        self.flops_token = 2.0 * p_rank
        self.flops_attn = 2.0 * self.layers * model.hidden / tp0
        self.attn_weight = self.flops_attn / self.flops_token
        self.ns_per_flop = 1.0 / (topo.peak_tflops * model.mfu * 1e3)
        self.act_bytes_per_token = 2.0 * model.hidden
        self.grad_bytes = 2.0 * p_rank / model.grad_buckets
        self.stage_grad_bytes = self.grad_bytes * stage_share
        self.stage_share = stage_share
        self.static_bytes = 16.0 * p_rank
        self.moe = model.experts > 0 and lay.ep > 1
        self.program = P.build_program(
            lay.pp,
            lay.tp,
            lay.dp,
            tuple(self.stage_layers),
            wl.grad_accum,
            model.grad_buckets,
            share=self.layers,
            moe=self.moe,
        )
        shape = (lay.pp, lay.dp, lay.tp)
        self.shape = shape
        self.rank_host = lay.host.reshape(shape)
        slots = [
            sum(1 for op in self.program.ops if op.stage == s and op.kind in P.BOUNDARIES)
            for s in range(lay.pp)
        ]
        self.host_model = HostModel(scenario, lay, min(slots), shape)
        self._physics(hw)
        # A fault with an onset: the steps before it run on the same cluster, healthy.
        self._onset = scenario.fault.onset
        self._states = {True: self._state()}
        if self._onset > 0:
            from rankscope.sim.spec import healthy_twin

            self._physics(build_hardware(healthy_twin(scenario)))
            self._states[False] = self._state()
        self.any_crossing = len(lay.hosts) > 1
        # each rank's expert-parallel group id, per stage (dp, tp)
        self._ep_gid_rank = [
            np.repeat(lay.ep_gid[s].T, lay.ep, axis=0) if self.moe else None for s in range(lay.pp)
        ]
        rng = np.random.default_rng([scenario.seed & 0xFFFFFFFF, 0x5E55, lay.world_size])
        # Residual clock-alignment error: constant per rank, never larger than reported.
        err = scenario.noise.clock_error_us * 1e3
        self.clock_offset = np.clip(rng.normal(0.0, err / 2, lay.world_size), -err, err).astype(
            np.int64
        )
        self.clock_error_ns = err
        self._t = rng.uniform(0.0, 2e6, shape)
        self._ckpt_count = 0
        self.reserved_bytes = np.zeros(lay.world_size)
        """Allocator reserve of each rank so far (it only grows)."""
        self.next_step = 0

    def _physics(self, hw: Hardware) -> None:
        """Derive what the steps read (device speed, group links) from the hardware."""
        lay, topo, shape = self.layout, self.scenario.topology, self.shape
        self.hardware = hw
        self.speed = hw.speed[lay.device].reshape(shape)
        nic = hw.nic_gbps[lay.device].reshape(shape)
        a_in, a_x = topo.alpha_intra_us * 1e3, topo.alpha_inter_us * 1e3
        self.tp_links = group_links(self.rank_host, nic, hw.intra_gbps, a_in, a_x)
        self.dp_links = group_links(
            self.rank_host.transpose(0, 2, 1), nic.transpose(0, 2, 1), hw.intra_gbps, a_in, a_x
        )
        pairs_h = np.stack([self.rank_host[:-1], self.rank_host[1:]], axis=-1)
        pairs_n = np.stack([nic[:-1], nic[1:]], axis=-1)
        self.pp_links = group_links(pairs_h, pairs_n, hw.intra_gbps, a_in, a_x)
        self.world_links = group_links(
            lay.host[None], hw.nic_gbps[lay.device][None], hw.intra_gbps, a_in, a_x
        )
        ep = max(lay.ep, 1)
        blocks = (shape[0], shape[2], shape[1] // ep, ep)
        self.ep_links = group_links(
            self.rank_host.transpose(0, 2, 1).reshape(blocks),
            nic.transpose(0, 2, 1).reshape(blocks),
            hw.intra_gbps,
            a_in,
            a_x,
        )

    _PHYSICS = (
        "hardware",
        "speed",
        "tp_links",
        "dp_links",
        "pp_links",
        "world_links",
        "ep_links",
    )
    """What `_physics` derives and a fault's onset switches."""

    def _state(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._PHYSICS)

    def _fault_acts(self, k: int) -> None:
        """Put the cluster in the state of step ``k``: faulty from the onset on."""
        for name, value in zip(self._PHYSICS, self._states[k >= self._onset], strict=True):
            setattr(self, name, value)

    # -- per-step inputs --------------------------------------------------------------

    def _congestion(self, rng: np.random.Generator) -> float:
        """Cross-host bandwidth factor of this step (a burst or not). The draw happens for
        every scenario so that the random streams stay aligned with the healthy case."""
        f = self.scenario.fault
        burst = rng.random()
        if f.mechanism != "intermittent_congestion" or not self.any_crossing:
            return 1.0
        return f.magnitude if burst < f.prob else 1.0

    def _is_checkpoint(self, k: int) -> bool:
        every = self.workload.checkpoint_every
        return every > 0 and (k + 1) % every == 0

    def step(self, k: int | None = None) -> StepTables:
        """Simulate the next step of every rank.

        Args:
            k: the step to produce; must be `next_step` (steps run in order, since each
                rank's clock carries over).

        Returns:
            The step's tables.

        Raises:
            ValueError: when ``k`` is not the next step.
        """
        if k is None:
            k = self.next_step
        if k != self.next_step:
            raise ValueError(f"steps run in order: next is {self.next_step}, asked for {k}")
        if self._onset > 0:
            self._fault_acts(k)
        sc, lay, wl, prog = self.scenario, self.layout, self.workload, self.program
        noise = sc.noise
        pp, dp, tp = self.shape
        seed = sc.seed & 0xFFFFFFFF
        work = pack_step(wl, np.random.default_rng([seed, k, 1]), dp, self.attn_weight)
        perm = lay.shard_of_dp
        if perm.size and (perm != np.arange(dp)).any():
            # A shard swap: data-parallel index d reads the shard d' = perm[d] would have.
            work = Work(*(getattr(work, f.name)[perm] for f in dataclasses.fields(Work)))
        rng = np.random.default_rng([seed, k, 2])
        speed = self.speed * (1.0 + noise.step_sigma * rng.standard_normal(self.shape))
        jit = 1.0 + noise.chunk_sigma * rng.standard_normal((prog.n_compute, pp, dp, tp))
        np.maximum(jit, 0.5, out=jit)
        # OS hiccups: a few ranks lose some milliseconds inside one compute span.
        hiccup = rng.random(self.shape) < noise.hiccup_prob
        h_span = rng.integers(0, max(prog.n_compute, 1), self.shape)
        h_ns = 1e6 * rng.uniform(noise.hiccup_ms_min, noise.hiccup_ms_max, self.shape)
        hiccups: dict[int, list[tuple[int, int, int, float]]] = {}
        for s_i, d_i, t_i in zip(*np.nonzero(hiccup)):
            span = int(h_span[s_i, d_i, t_i])
            hiccups.setdefault(span, []).append((s_i, d_i, t_i, h_ns[s_i, d_i, t_i]))
        cong = self._congestion(rng)
        tokens, attn = work.tokens, work.attn_cost
        # Streams of their own, so that the draws above stay those of a run without them.
        vrng = np.random.default_rng([seed, k, 4])
        warm = self._warmup(k, vrng)
        if not isinstance(warm, float):
            speed = speed / warm
        spikes: dict[int, list[tuple[int, int, int, float]]] = {}
        for s_i, d_i, t_i, span, extra in self._spikes(vrng):
            spikes.setdefault(span, []).append((s_i, d_i, t_i, extra))
        setup = k == 0 and noise.warmup_steps > 0
        host = self.host_model.step(k, warm)
        gaps, n_slots = host.gaps, host.gaps.shape[0]
        slow_host = bool((host.cap < 1.0).any())
        inv_cap = 1.0 / host.cap
        launch = np.maximum(1.0, LAUNCH_CPU * inv_cap)
        recv = self._routing(tokens, seed, k) if self.moe else tokens
        T = self._t
        t_start = T.copy()
        compute = np.zeros(self.shape)
        coll_names = (
            "op",
            "group",
            "seq",
            "nbytes",
            "t_enter",
            "t_start",
            "t_end",
            "t_exit",
            "flags",
        )
        colls = [_Records(coll_names) for _ in range(pp)]
        phases = [_Records(("phase", "t0", "t1")) for _ in range(pp)]
        begin: dict[tuple[int, str], np.ndarray] = {}
        pending: dict[tuple[int, bool, int], np.ndarray] = {}
        tp_bw = self.tp_links.bandwidth(cong)
        dp_bw = self.dp_links.bandwidth(cong)
        pp_bw = self.pp_links.bandwidth(cong)
        ep_bw = self.ep_links.bandwidth(cong) if self.moe else None
        stream_free = np.zeros((pp, tp))
        bucket_exit = np.zeros(self.shape)
        ts = noise.transfer_sigma

        def notice(s: int) -> np.ndarray:
            out = rng.exponential(NOTICE_NS, (dp, tp))
            return out * inv_cap[s] if slow_host else out

        def setup_ns(n: int, shape: tuple[int, ...]) -> np.ndarray | float:
            """Communicator set-up on a group's first collective of the run."""
            if not setup:
                return 0.0
            size = 1e6 * COMM_SETUP_MS * math.log2(2 * n)
            return size * np.exp(0.2 * vrng.standard_normal(shape))

        for op in prog.ops:
            kind, s = op.kind, op.stage
            if kind in P.BOUNDARIES and op.index < n_slots:
                T[s] += gaps[op.index, s]  # host gap before the phase: outside every phase
            if kind == P.COMPUTE:
                m = op.micro
                if op.expert:  # experts compute on the tokens routed to them
                    flops = op.linear * self.flops_token * recv[:, m]
                else:
                    flops = (
                        op.linear * self.flops_token * tokens[:, m]
                        + op.attn * self.flops_attn * attn[:, m]
                    )
                dur = (self.ns_per_flop * flops)[:, None] / speed[s] * jit[op.index, s]
                for hs, hd, ht, extra in spikes.get(op.index, ()):
                    if hs == s:  # a slow kernel: the GPU is busy longer
                        dur[hd, ht] += extra
                compute[s] += dur
                if slow_host:  # launch-bound: the GPU waits for the starved host thread
                    dur = dur * launch[s]
                for hs, hd, ht, extra in hiccups.get(op.index, ()):
                    if hs == s:  # the host stalls; the GPU idles, so it is not compute
                        dur[hd, ht] += extra
                T[s] += dur
            elif kind == P.TP_ALLREDUCE:
                enter = T[s].copy()
                nbytes = tokens[:, op.micro] * self.act_bytes_per_token
                cost = (
                    self.tp_links.alpha_ns[s] * _log2_hops(tp)
                    + 2.0 * (tp - 1) / tp * nbytes / tp_bw[s]
                ) * np.exp(ts * rng.standard_normal(dp))
                if op.index == 0:
                    cost = cost + setup_ns(tp, (dp,))
                end = enter.max(axis=1) + cost
                T[s] = end[:, None] + notice(s)
                colls[s].add(
                    _OP_AR,
                    lay.tp_gid[s][:, None],
                    k * prog.n_tp_stage[s] + op.index,
                    nbytes[:, None],
                    enter,
                    enter,
                    end[:, None],
                    T[s].copy(),
                    _TIMED,
                )
            elif kind == P.BUCKET:
                T[s] += ISSUE_NS * inv_cap[s] if slow_host else ISSUE_NS
                enter = T[s].copy()
                grad_bytes = self.stage_grad_bytes[s]
                cost = (
                    self.dp_links.alpha_ns[s] * _log2_hops(dp)
                    + 2.0 * (dp - 1) / dp * grad_bytes / dp_bw[s]
                ) * np.exp(ts * rng.standard_normal(tp))
                if op.index == 0:
                    cost = cost + setup_ns(dp, (tp,))
                dev_start = np.maximum(enter, stream_free[s][None, :])
                start = np.maximum(enter.max(axis=0), stream_free[s])
                end = start + cost
                stream_free[s] = end
                bucket_exit[s] = end[None, :] + notice(s)
                colls[s].add(
                    _OP_AR,
                    lay.dp_gid[s][None, :],
                    k * prog.n_buckets + op.index,
                    grad_bytes,
                    enter,
                    dev_start,
                    end[None, :],
                    bucket_exit[s].copy(),
                    _BUCKET_FLAGS,
                )
            elif kind == P.WAIT_BUCKETS:
                np.maximum(T[s], bucket_exit[s], out=T[s])
            elif kind == P.SEND:
                pending[(op.boundary, op.backward, op.micro)] = T[s].copy()
            elif kind == P.RECV:
                b = op.boundary
                sender = b + 1 if op.backward else b
                enter_send = pending.pop((b, op.backward, op.micro))
                enter = T[s].copy()
                nbytes = tokens[:, op.micro] * self.act_bytes_per_token / sc.layout.tp
                cost = (self.pp_links.alpha_ns[b] + nbytes[:, None] / pp_bw[b]) * np.exp(
                    ts * rng.standard_normal((dp, tp))
                )
                if op.index == 0:
                    cost = cost + setup_ns(2, (dp, tp))
                end = np.maximum(enter_send, enter) + cost
                T[sender] = end + notice(sender)
                T[s] = end + notice(s)
                seq = k * prog.n_p2p + op.index
                colls[sender].add(
                    _OP_SEND,
                    lay.pp_gid[b],
                    seq,
                    nbytes[:, None],
                    enter_send,
                    enter_send,
                    end,
                    T[sender].copy(),
                    _TIMED,
                )
                colls[s].add(
                    _OP_RECV,
                    lay.pp_gid[b],
                    seq,
                    nbytes[:, None],
                    enter,
                    enter,
                    end,
                    T[s].copy(),
                    _TIMED,
                )
                phases[s].add(_PH["pp_wait"], enter, T[s].copy())
            elif kind == P.ALL_TO_ALL:
                assert ep_bw is not None
                enter = T[s].copy()
                end, nbytes = self._all_to_all(op, enter, tokens, recv, ep_bw[s], rng)
                if op.index == 0 and setup:
                    end = end + np.repeat(setup_ns(lay.ep, (dp // lay.ep, 1)), lay.ep, axis=0)
                T[s] = end + notice(s)
                colls[s].add(
                    _OP_A2A,
                    self._ep_gid_rank[s],
                    k * prog.n_a2a_stage[s] + op.index,
                    nbytes[:, None],
                    enter,
                    enter,
                    end,
                    T[s].copy(),
                    _TIMED,
                )
            elif kind == P.BEGIN:
                begin[(s, op.phase)] = T[s].copy()
            elif kind == P.END:
                phases[s].add(_PH[op.phase], begin.pop((s, op.phase)), T[s].copy())
            else:
                dur = self._host_phase(kind, s, k, speed, rng, warm)
                if dur is not None and slow_host and kind == P.OPTIMIZER:
                    dur = dur * np.maximum(1.0, OPTIMIZER_LAUNCH_CPU * inv_cap[s])
                if dur is not None:
                    t0 = T[s].copy()
                    T[s] += dur
                    phases[s].add(_PH[_HOST_PHASES[kind]], t0, T[s].copy())
        if self._is_checkpoint(k):
            self._checkpoint(phases, colls, rng)
        t_end = T.copy()
        step_gap = STEP_GAP_NS * (1.0 + 0.2 * rng.standard_normal(self.shape)).clip(0.2)
        self._t = T + (step_gap * inv_cap if slow_host else step_gap)
        self.next_step = k + 1
        tables = assemble(self, k, t_start, t_end, compute, work, colls, phases)
        self._work_columns(tables, work, recv)
        expert_tokens = None
        if self.moe:
            expert_tokens = np.broadcast_to(recv.sum(axis=1)[None, :, None], self.shape).ravel()
        contended = (host.cap < 1.0).ravel()
        fill_columns(tables, host, expert_tokens, contended, sc.seed, k)
        return tables

    def _warmup(self, k: int, rng: np.random.Generator) -> np.ndarray | float:
        """Slowdown of step ``k`` during the warm-up: ``warmup_factor`` at step 0, decaying
        to 1 at ``warmup_steps`` (each rank a little differently); 1.0 after it."""
        noise = self.scenario.noise
        n = noise.warmup_steps
        if k >= n:
            return 1.0
        excess = (noise.warmup_factor - 1.0) * ((n - k) / n) ** 2
        jitter = np.exp(0.1 * rng.standard_normal(self.shape))
        return 1.0 + excess * jitter

    def _spikes(self, rng: np.random.Generator) -> list[tuple[int, int, int, int, float]]:
        """This step's heavy-tailed compute spikes: ``(stage, dp, tp, span, ns)``."""
        noise = self.scenario.noise
        if noise.spike_prob <= 0.0:
            return []
        hit = rng.random(self.shape) < noise.spike_prob
        idx = np.nonzero(hit)
        n = int(hit.sum())
        size = np.minimum(1.0 + rng.pareto(noise.spike_alpha, n), SPIKE_CAP)
        span = rng.integers(0, max(self.program.n_compute, 1), n)
        ns = 1e6 * noise.spike_ms * size
        return [
            (int(a), int(b), int(c), int(d), float(e))
            for a, b, c, d, e in zip(*idx, span, ns, strict=True)
        ]

    def _routing(self, tokens: np.ndarray, seed: int, k: int) -> np.ndarray:
        """Tokens routed to each rank's experts, ``(dp, grad_accum)``: each expert-parallel
        block's tokens shared out by routing weights that wander a little from step to
        step; an expert imbalance makes one coordinate's weight ``magnitude`` times larger."""
        lay, f = self.layout, self.scenario.fault
        ep = lay.ep
        dp, accum = tokens.shape
        rng = np.random.default_rng([seed, k, 7])
        w = np.exp(ROUTING_SIGMA * rng.standard_normal((dp // ep, ep, accum)))
        if f.mechanism == "expert_imbalance" and f.ep_rank < ep:
            w[:, f.ep_rank, :] *= f.magnitude * np.exp(0.1 * rng.standard_normal((dp // ep, accum)))
        share = w / w.sum(axis=1, keepdims=True)
        total = tokens.reshape(dp // ep, ep, accum).sum(axis=1, keepdims=True)
        return (total * share).reshape(dp, accum)

    def _all_to_all(
        self,
        op: P.Op,
        enter: np.ndarray,
        tokens: np.ndarray,
        recv: np.ndarray,
        bw: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray]:
        """One expert all-to-all of a stage: every member of a block leaves when the last
        arrives plus the exchange, bounded by the member that sends or receives the most.

        Returns:
            ``(end, nbytes)``: device end ``(dp, tp)`` and each rank's bytes sent ``(dp,)``.
        """
        lay, s = self.layout, op.stage
        ep = lay.ep
        dp, tp = enter.shape
        m = op.micro
        per_token = self.act_bytes_per_token / self.scenario.layout.tp
        # Dispatch (and the gradient of the combine) send own tokens and receive the routed
        # ones; the combine (and the gradient of the dispatch) the other way round.
        out, into = (recv[:, m], tokens[:, m]) if op.combine else (tokens[:, m], recv[:, m])
        load = np.maximum(out, into).reshape(dp // ep, ep).max(axis=1) * per_token
        alpha = self.ep_links.alpha_ns[s].T  # (blocks, tp)
        cost = (alpha * (ep - 1) + (ep - 1) / ep * load[:, None] / bw.T) * np.exp(
            self.scenario.noise.transfer_sigma * rng.standard_normal((dp // ep, tp))
        )
        end = enter.reshape(dp // ep, ep, tp).max(axis=1) + cost
        return np.repeat(end, ep, axis=0), out * per_token

    def _work_columns(self, tables: StepTables, work: Any, recv: np.ndarray) -> None:
        """Executed FLOPs per rank where stages or experts make them differ from the dense,
        even split `assemble` assumes."""
        if not self.moe and np.all(self.stage_share == 1.0):
            return
        tokens, attn = work.tokens.sum(axis=1), work.attn_cost.sum(axis=1)
        mlp = 1.0 - P.FWD_LINEAR_ATTN_BLOCK
        routed = recv.sum(axis=1) if self.moe else tokens
        linear = P.FWD_LINEAR_ATTN_BLOCK * tokens + mlp * routed
        per_dp = 3.0 * (self.flops_token * linear + self.flops_attn * attn)
        flops = self.stage_share[:, None, None] * per_dp[None, :, None]
        tables.steps["flops"][:] = np.broadcast_to(flops, self.shape).ravel()

    def _host_phase(
        self,
        kind: int,
        s: int,
        k: int,
        speed: np.ndarray,
        rng: np.random.Generator,
        warm: np.ndarray | float = 1.0,
    ) -> np.ndarray | float | None:
        wl, f = self.workload, self.scenario.fault
        shape = self.shape[1:]
        if kind == P.INPUT:
            extra = self.hardware.input_extra_ms[self.rank_host[s]]
            base = wl.input_ms * np.exp(0.35 * rng.standard_normal(shape))
            if not isinstance(warm, float):  # the loader's workers start and prefetch
                base = base * warm[s]
            return 1e6 * (base + extra * np.exp(0.1 * rng.standard_normal(shape)))
        if kind == P.OPTIMIZER:
            return 1e6 * wl.optimizer_ms * (1.0 + 0.02 * rng.standard_normal(shape)) / speed[s]
        if kind == P.MEMORY:
            if f.mechanism != "allocator_growth":
                return None
            # Fragmentation grows with steps: more allocator retries, longer each step.
            return 1e6 * f.magnitude * (k + 1) * np.exp(0.1 * rng.standard_normal(shape))
        raise ValueError(f"unknown operation kind {kind}")

    def _checkpoint(
        self, phases: list[_Records], colls: list[_Records], rng: np.random.Generator
    ) -> None:
        """Every rank writes its shard (time set by its host's storage), then all ranks meet
        at a barrier on the world group."""
        T, lay = self._t, self.layout
        pp = self.shape[0]
        storage = self.hardware.storage_factor[self.rank_host]
        dur = (
            1e9
            * self.workload.checkpoint_s
            * storage
            * (1.0 + 0.05 * rng.standard_normal(self.shape))
        )
        t0 = T.copy()
        T += dur
        for s in range(pp):
            phases[s].add(_PH["checkpoint"], t0[s], T[s].copy())
        if lay.world_gid < 0:
            self._ckpt_count += 1
            return
        enter = T.copy()
        alpha = float(self.world_links.alpha_ns[0])
        end = enter.max() + alpha * _log2_hops(lay.world_size)
        T[:] = end + rng.exponential(NOTICE_NS, self.shape)
        for s in range(pp):
            colls[s].add(
                _OP_BARRIER,
                lay.world_gid,
                self._ckpt_count,
                0,
                enter[s],
                enter[s],
                end,
                T[s].copy(),
                _TIMED,
            )
        self._ckpt_count += 1


_HOST_PHASES = {P.INPUT: "input", P.OPTIMIZER: "optimizer", P.MEMORY: "memory"}
