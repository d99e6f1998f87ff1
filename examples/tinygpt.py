"""A small GPT for packed variable-length sequences.

Linear layers run once over the whole packed buffer; attention runs per packed sequence
(causal within it, never across a boundary), so a rank's attention work is Σ L² over its
sequences, not the square of its buffer length. That is what makes the packer matter.

``attn="math"`` computes softmax(QKᵀ/√d)V with the L×L score matrix materialised, the
textbook implementation whose time and memory both grow as L²; ``attn="sdpa"`` uses
``torch.nn.functional.scaled_dot_product_attention`` (also quadratic in time, smaller
constant).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = ("math", "sdpa")


@dataclass(frozen=True)
class GPTConfig:
    """Model shape.

    Attributes:
        name: the model's name as it appears in the job config (unchanged by sequence knobs).
        vocab: vocabulary size.
        d_model: width.
        n_layer: transformer blocks.
        n_head: attention heads.
        mlp_ratio: MLP hidden width over ``d_model``.
        attn: ``"math"`` or ``"sdpa"``.
    """

    name: str = "tinygpt-64x2"
    vocab: int = 256
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    mlp_ratio: int = 4
    attn: str = "math"

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.attn not in ATTENTION:
            raise ValueError(f"unknown attention {self.attn!r}; choose one of {ATTENTION}")
        for field in ("vocab", "d_model", "n_layer", "n_head", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")


def positions(lengths: list[int], d_model: int) -> torch.Tensor:
    """Sinusoidal encodings restarting at 0 for each packed sequence.

    Fixed, not learned, so the parameter count does not depend on the longest sequence:
    ``--seq-scale`` changes the work, not the model.
    """
    pos = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])
    half = d_model // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / half))
    ang = pos[:, None] * freq[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=1)


class Block(nn.Module):
    """Pre-norm transformer block with per-sequence causal attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self._masks: dict[int, torch.Tensor] = {}

    def _mask(self, n: int, device: torch.device) -> torch.Tensor:
        m = self._masks.get(n)
        if m is None or m.device != device:
            m = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
            # Lengths repeat a lot in short sequences; keep the cache small all the same.
            if len(self._masks) > 256:
                self._masks.clear()
            self._masks[n] = m
        return m

    def attend(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        t, d = x.shape
        h = self.cfg.n_head
        qkv = self.qkv(x).view(t, 3, h, d // h).permute(1, 2, 0, 3)  # (3, H, T, dh)
        outs = []
        scale = 1.0 / math.sqrt(d // h)
        for q, k, v in zip(
            qkv[0].split(lengths, dim=1), qkv[1].split(lengths, dim=1), qkv[2].split(lengths, 1)
        ):
            if self.cfg.attn == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-1, -2)) * scale
                s = s.masked_fill(self._mask(q.shape[1], q.device), float("-inf"))
                o = s.softmax(-1) @ v
            outs.append(o)
        y = torch.cat(outs, dim=1).permute(1, 0, 2).reshape(t, d)
        return self.proj(y)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attend(self.ln1(x), lengths)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token embedding, ``n_layer`` blocks, tied output head.

    ``slow``, when given, runs inside every forward pass: the slow-rank fault is extra
    compute in the model itself, where a slower device would spend it.
    """

    def __init__(self, cfg: GPTConfig, slow: ExtraCompute | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.slow = slow
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Small init as in GPT-2: the tied head would otherwise start with huge logits.
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(
        self,
        tokens: torch.Tensor,
        lengths: list[int],
        targets: torch.Tensor | None = None,
        norm: float = 1.0,
    ) -> torch.Tensor:
        """Logits (T, vocab) for a packed buffer of sequences with the given lengths, or,
        with ``targets``, the summed cross-entropy divided by ``norm`` (targets of -100 are
        ignored)."""
        x = self.embed(tokens) + positions(lengths, self.cfg.d_model).to(tokens.device)
        for block in self.blocks:
            x = block(x, lengths)
        logits = self.ln_f(x) @ self.embed.weight.T
        if self.slow is not None and self.slow.iters:
            self.slow()
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        return loss / norm


def linear_weight(cfg: GPTConfig) -> float:
    """Per-token linear work in units of one attention score pair (one of L² per layer).

    Per layer and token, the linear layers cost ``(4 + 2·mlp_ratio)·d²`` multiply-adds and
    the output head ``vocab·d`` once; one (query, key) pair costs ``2·d`` (scores and
    values). The attention packer balances ``L² + w·L`` with this ``w``, per the flop
    count; the textbook attention's extra memory traffic makes the true ratio smaller, which
    only makes the estimate err towards balancing tokens.
    """
    d = cfg.d_model
    per_token = cfg.n_layer * (4 + 2 * cfg.mlp_ratio) * d * d + cfg.vocab * d
    per_pair = cfg.n_layer * 2 * d
    return per_token / per_pair


class ExtraCompute:
    """Real extra work for the slow-rank fault: a loop of square matmuls sized by a
    one-time calibration to cost about ``ms`` milliseconds of CPU time.

    The calibration measures process CPU time, not wall time, so ranks starting together
    on shared cores still size the same amount of work.
    """

    SIZE = 128
    _calibrated_ms: float | None = None
    """Milliseconds per iteration, measured once per process."""

    def __init__(self, ms: float) -> None:
        if ms < 0:
            raise ValueError(f"slow-ms must be >= 0, got {ms}")
        self.ms = ms
        self.a = torch.randn(self.SIZE, self.SIZE)
        self.b = torch.randn(self.SIZE, self.SIZE)
        self.iters = 0
        if ms > 0:
            if ExtraCompute._calibrated_ms is None:
                ExtraCompute._calibrated_ms = self._ms_per_iter()
            self.iters = max(1, round(ms / ExtraCompute._calibrated_ms))

    def _loop(self, n: int) -> torch.Tensor:
        acc = self.a
        for _ in range(n):
            acc = torch.tanh(torch.mm(acc, self.b))
        return acc

    def _ms_per_iter(self) -> float:
        n = 50
        best = float("inf")
        for _ in range(5):
            t = time.process_time()
            self._loop(n)
            best = min(best, (time.process_time() - t) * 1e3 / n)
        return best

    def __call__(self) -> float:
        """Run the loop; returns a value that depends on the result, so nothing is elided."""
        return float(self._loop(self.iters)[0, 0])
