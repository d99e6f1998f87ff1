"""The GPT example instrumented both ways: zero-code (``rankscope run -- torchrun ...``)
and with the explicit API (``--rankscope``), each reporting to a real hub.

The explicit-API run is the packing incident's healthy baseline (``conftest.py``), shared
with ``test_real_incidents.py`` rather than launched again."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

pytest.importorskip("torch")
if shutil.which("torchrun") is None:
    pytest.skip("torchrun is not installed", allow_module_level=True)

import incidents  # noqa: E402

# Two instrumented 2-rank jobs (~27 s alone): the slow tier. The default tier keeps a
# zero-code job (test_zero_code) and an explicit-API job (test_torch_e2e).
pytestmark = [pytest.mark.torch, pytest.mark.slow]

FLAGS = ("--tokens-per-rank=512", "--len-max=256")


@pytest.fixture(scope="module")
def runs(real_hub):
    zero = incidents.RunSpec("zero-code", FLAGS, nproc=2, steps=10, explicit=False)
    incidents.run_local(
        real_hub.endpoint, zero, prefix=[sys.executable, "-m", "rankscope", "run", "--"]
    )
    incidents.settled_window(real_hub.store, zero, warmup=0)
    # The explicit API on the packing incident's healthy flags, for as many steps as the
    # assertions need (the incident's own run is the slow tier's).
    explicit = replace(incidents.PACKING.spec("baseline", steps=8), run="explicit-api")
    incidents.run_local(real_hub.endpoint, explicit)
    return {
        # Under auto-instrumentation the teardown barrier after the loop opens one more
        # (partial) step; keep the training steps.
        "zero": real_hub.store.window(zero.run),
        "explicit": incidents.settled_window(real_hub.store, explicit, warmup=0),
    }


def test_zero_code_run_reports_steps_phases_and_ddp_buckets(runs):
    w = runs["zero"]
    train = w.steps < 10
    assert w.world_size == 2 and w.present[:, train].all()
    assert train.sum() == 10
    # The torch hooks see the DataLoader, the DDP model's forward and the optimizer ...
    for phase in ("input", "forward", "optimizer"):
        assert (w.phase_ns[phase][:, train] > 0).all(), phase
    # ... and the gradient all-reduce of every step (one DDP bucket for this model).
    assert (w.coll["n"][:, train] >= 1).all()
    # The script was not changed, so nothing reported its work.
    assert not (w.work["attn_cost"][:, train] > 0).any()
    assert w.manifest["argv"][0].endswith("gpt_packing.py")


def test_explicit_api_adds_backward_work_and_job_config(runs):
    w = runs["explicit"]
    assert w.world_size == 2 and w.present.all()
    assert (w.phase_ns["backward"] > 0).all()
    # Work per rank and step: tokens, valid tokens, sequences and Σseq².
    assert (w.work["valid_tokens"] > 0).all() and (w.work["samples"] > 0).all()
    assert (w.work["attn_cost"] >= w.work["tokens"]).all()  # Σ L² >= Σ L
    # The example's defaults: 2048 tokens per rank, attention packer.
    np.testing.assert_array_equal(w.work["valid_tokens"].sum(axis=0), 4096)
    cfg = w.manifest["job_config"]
    assert cfg["model"] == "tinygpt-64x2" and cfg["packer"] == "attn"
    assert cfg["global_batch"] == 4096 and cfg["micro_batch"] == 2048
