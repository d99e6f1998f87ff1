"""The GPT packing example itself: the packers, the packed model, and a torchrun smoke run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import seqpack  # noqa: E402

try:
    import tinygpt
    import torch
except ImportError:  # the packers need only numpy; the model tests need torch
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _batches(n: int, world: int = 2, tokens: int = 4096, **dist_kw):
    dist = seqpack.LengthDist(**dist_kw)
    return [seqpack.global_batch(dist, tokens, seed=3, step=s) for s in range(n)]


def test_global_batch_carries_exact_valid_tokens_and_respects_bounds() -> None:
    dist = seqpack.LengthDist(median=64, sigma=1.5, min_len=16, max_len=1024)
    for step in range(50):
        lengths = seqpack.global_batch(dist, 4096, seed=1, step=step)
        assert lengths.sum() == 4096
        # Only the last sequence may be cut below the minimum.
        assert lengths[:-1].min() >= 16 and lengths.max() <= 1024 and lengths[-1] >= 1
    again = seqpack.global_batch(dist, 4096, seed=1, step=7)
    np.testing.assert_array_equal(again, seqpack.global_batch(dist, 4096, seed=1, step=7))


def test_length_distribution_is_long_tailed() -> None:
    lengths = seqpack.LengthDist().sample(np.random.default_rng(0), 20000)
    median = np.median(lengths)
    # A few sequences are an order of magnitude longer than the typical one ...
    assert np.mean(lengths > 10 * median) > 0.02
    # ... and they carry most of the attention work.
    top = np.sort(lengths)[-len(lengths) // 20 :]
    assert (top.astype(float) ** 2).sum() > 0.5 * (lengths.astype(float) ** 2).sum()


def test_seq_scale_and_padding_raise_executed_work() -> None:
    base = seqpack.LengthDist()
    longer = seqpack.LengthDist(scale=2.0)
    a = seqpack.global_batch(base, 8192, seed=0, step=0)
    b = seqpack.global_batch(longer, 8192, seed=0, step=0)
    assert a.sum() == b.sum() == 8192
    # Same valid tokens per step, about twice the attention work on average.
    cost_a = [seqpack.attention_cost(seqpack.global_batch(base, 8192, 0, s)) for s in range(100)]
    cost_b = [seqpack.attention_cost(seqpack.global_batch(longer, 8192, 0, s)) for s in range(100)]
    assert np.mean(cost_b) > 1.5 * np.mean(cost_a)
    padded = seqpack.pad_lengths(a, 128)
    assert np.all(padded % 128 == 0) and np.all(padded >= a) and np.all(padded - a < 128)
    np.testing.assert_array_equal(seqpack.pad_lengths(a, 0), a)


def _per_rank(lengths, owner, world):
    tokens = np.bincount(owner, weights=lengths, minlength=world)
    cost = np.bincount(owner, weights=lengths.astype(float) ** 2, minlength=world)
    return tokens, cost


def test_token_packer_balances_tokens_but_not_attention() -> None:
    world = 2
    tok_spread, tok_cost_spread, attn_tok_spread, attn_cost_spread = [], [], [], []
    slowest = []
    for step, lengths in enumerate(_batches(60, world)):
        own = seqpack.pack("token", lengths, world, seed=3, step=step, linear_weight=400.0)
        tokens, cost = _per_rank(lengths, own, world)
        tok_spread.append(np.ptp(tokens) / tokens.mean())
        tok_cost_spread.append(np.ptp(cost) / cost.mean())
        slowest.append(int(np.argmax(cost)))
        own = seqpack.pack("attn", lengths, world, seed=3, step=step, linear_weight=400.0)
        tokens, cost = _per_rank(lengths, own, world)
        attn_tok_spread.append(np.ptp(tokens) / tokens.mean())
        attn_cost_spread.append(np.ptp(cost + 400.0 * tokens) / (cost + 400.0 * tokens).mean())
    assert np.median(tok_spread) < 0.01  # tokens balanced to within 1 %
    assert np.median(attn_tok_spread) > 5 * np.median(tok_spread)
    assert np.median(tok_cost_spread) > 0.5  # Σ L² far apart under the token packer
    assert np.median(attn_cost_spread) < 0.1  # balanced under the attention packer
    # The rank with the most attention work changes from batch to batch.
    counts = np.bincount(slowest, minlength=world)
    assert counts.min() >= 10


def test_packers_assign_every_sequence_once_and_reject_unknown() -> None:
    lengths = _batches(1, 4)[0]
    for packer in seqpack.PACKERS:
        own = seqpack.pack(packer, lengths, 4, seed=0, step=0, linear_weight=400.0)
        assert own.shape == lengths.shape and own.min() >= 0 and own.max() < 4
    with pytest.raises(ValueError, match="unknown packer 'fifo'"):
        seqpack.pack("fifo", lengths, 4, seed=0, step=0, linear_weight=1.0)
    with pytest.raises(ValueError, match="median"):
        seqpack.LengthDist(median=0)


def test_rank_batches_partition_the_global_batch() -> None:
    world = 3
    valid = seqpack.global_batch(seqpack.LengthDist(), 3000, seed=0, step=4)
    executed = seqpack.pad_lengths(valid, 64)
    owner = seqpack.pack("attn", executed, world, seed=0, step=4, linear_weight=400.0)
    parts = [seqpack.rank_batch(valid, executed, owner, r, 256, 0, 4) for r in range(world)]
    assert sum(p.valid_tokens for p in parts) == 3000
    assert sum(p.tokens.shape[0] for p in parts) == executed.sum()
    assert sum(int((p.targets >= 0).sum()) for p in parts) == parts[0].global_targets
    for p in parts:
        assert p.tokens.shape == p.targets.shape and p.tokens.shape[0] == p.lengths.sum()
        # Padding is token 0 with no target.
        assert np.all(p.targets[p.tokens.shape[0] :] == -100)
    # Targets continue each sequence's progression: target[i] is a later token of the same
    # sequence wherever both are valid.
    p = parts[0]
    first = int(p.lengths[0])
    ok = p.targets[: first - 1] >= 0
    np.testing.assert_array_equal(p.targets[: first - 1][ok], p.tokens[1:first][ok])


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("attn", ["math", "sdpa"])
def test_packed_forward_equals_separate_sequences(attn: str) -> None:
    torch.manual_seed(0)
    model = tinygpt.TinyGPT(tinygpt.GPTConfig(attn=attn)).eval()
    a = torch.randint(0, 256, (37,))
    b = torch.randint(0, 256, (80,))
    with torch.no_grad():
        packed = model(torch.cat([a, b]), [37, 80])
        alone = torch.cat([model(a, [37]), model(b, [80])])
    # Attention never crosses a sequence boundary and positions restart per sequence.
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.torch
@needs_torch
def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = tinygpt.TinyGPT(tinygpt.GPTConfig()).eval()
    x = torch.randint(0, 256, (50,))
    y = x.clone()
    y[30:] = (y[30:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(x, [50])[:30], model(y, [50])[:30])
        assert not torch.allclose(model(x, [50])[30:], model(y, [50])[30:])


@pytest.mark.torch
@needs_torch
def test_extra_compute_scales_with_requested_time() -> None:
    assert tinygpt.ExtraCompute(0).iters == 0
    tinygpt.ExtraCompute(1.0)  # calibrates once per process
    # Requests of several iterations each: an iteration's cost is the machine's (a busy
    # core makes it several ms), and below one iteration the count is clamped to 1.
    per_iter = tinygpt.ExtraCompute._calibrated_ms
    small, large = tinygpt.ExtraCompute(4 * per_iter), tinygpt.ExtraCompute(40 * per_iter)
    # One calibration per process: iterations are proportional to the requested time.
    assert small.iters >= 1
    # (each count is rounded, so they agree with 10x to within 10 x 0.5 + 0.5)
    assert abs(large.iters - 10 * small.iters) <= 6, (small.iters, large.iters)
    assert np.isfinite(large())
    with pytest.raises(ValueError, match="slow-ms"):
        tinygpt.ExtraCompute(-1)


@pytest.mark.torch
@needs_torch
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
# One torchrun each: DDP in the default tier, the hierarchical and FSDP syncs in the slow one.
@pytest.mark.parametrize(
    "grad_sync",
    [
        # Each is one torchrun (~11 s in a busy suite): the slow tier. The default tier
        # tests this workload's parts above and runs DDP jobs in test_real_faults.
        pytest.param("ddp", marks=pytest.mark.slow),
        pytest.param("hier", marks=pytest.mark.slow),
        pytest.param("fsdp", marks=pytest.mark.slow),
    ],
)
def test_torchrun_two_ranks_runs_and_writes_timings(tmp_path: Path, grad_sync: str) -> None:
    env = dict(os.environ, LOCAL_WORLD_SIZE="2")
    out = subprocess.run(
        [
            "torchrun",
            "--nproc_per_node=2",
            "--standalone",
            str(EXAMPLES / "gpt_packing.py"),
            "--steps=3",
            "--tokens-per-rank=256",
            "--len-max=128",
            f"--grad-sync={grad_sync}",
            "--slow-rank=1",
            "--slow-ms=2",
            "--log-every=1",
            f"--timings={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 3/3" in out.stdout
    for r in range(2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["world"] == 2 and len(rec["step_ns"]) == 3 and min(rec["step_ns"]) > 0


@needs_torch
def test_job_config_names_every_knob() -> None:
    import gpt_packing

    args = gpt_packing.build_parser().parse_args(
        ["--packer", "token", "--seq-scale", "2", "--pad", "64", "--ckpt-every", "5"]
    )
    cfg = gpt_packing.job_config(args, world=4)
    assert cfg["model"] == "tinygpt-64x2"
    assert cfg["packer"] == "token"
    # Names the rerun planner reads: global batch, micro batch, gradient accumulation.
    assert cfg["global_batch"] == 4 * 2048 and cfg["batch_unit"] == "tokens"
    assert cfg["micro_batch"] == 2048 and cfg["grad_accum"] == 1
    assert cfg["seq_len"]["median"] == 128 and cfg["seq_len"]["pad_multiple"] == 64
    assert cfg["checkpoint_every"] == 5 and cfg["precision"] == "fp32"
    json.dumps(cfg)  # plain values only: it travels in the manifest
