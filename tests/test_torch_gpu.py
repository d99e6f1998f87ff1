"""The collector's real CUDA and NVML paths, on a machine with an NVIDIA GPU.

Everywhere else these paths run against fakes; here a real NCCL job (one rank per GPU, at
most two) trains a DDP model and calls explicit collectives with the collector reporting
to a bare PULL socket. Checked: collective rows get device times from CUDA events,
resolved later by the background thread (the collector never synchronizes a stream or an
event), consistent with the host times around them; step rows carry allocator figures;
NVML samples are present and in physical ranges. Without CUDA, NCCL or NVML the tests skip
and say which is missing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

torch = pytest.importorskip("torch", reason="torch is not installed")
import torch.distributed as dist  # noqa: E402

from rankscope.collector import nvml, schema  # noqa: E402

CUDA = torch.cuda.is_available()
NCCL = dist.is_available() and dist.is_nccl_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.torch,
    pytest.mark.skipif(not CUDA, reason="no CUDA device: torch.cuda.is_available() is False"),
    pytest.mark.skipif(not NCCL, reason="this torch build has no NCCL backend"),
]

STEPS = 30
MS = 1_000_000

JOB = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Count the synchronizations rankscope's code makes: it must resolve events without any.
syncs = []
for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                    (torch.cuda.Event, "wait"), (torch.cuda.Stream, "synchronize")):
    orig = getattr(owner, name)
    def counted(*a, _orig=orig, _name=name, **k):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("rankscope"):
            syncs.append(_name)
        return _orig(*a, **k)
    setattr(owner, name, counted)

import rankscope

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
mon = rankscope.start(job="gpu", hub=sys.argv[1], flush_interval_s=0.2,
                      sample_interval_s=0.2, clock_sync=False)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda()
model = DDP(net, device_ids=[local], bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 1024, device="cuda")
metric = torch.ones(1 << 20, device="cuda")
for _ in range(int(sys.argv[2])):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.all_reduce(metric)
    dist.all_reduce(metric, async_op=True).wait()
n_syncs = len(syncs)
time.sleep(2.0)  # the background thread resolves the last events and samples the GPU
timer = sys.modules["rankscope.collector.torch_collectives"]._state.timer
resolved = timer.resolved if timer is not None else -1
rankscope.close()
with open(sys.argv[3] + f".{dist.get_rank()}", "w") as f:
    json.dump({"syncs": n_syncs, "resolved": resolved}, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tables(msgs: list[schema.Message], table: str) -> dict[str, np.ndarray]:
    parts = [m.tables[table] for m in msgs if table in m.tables]
    assert parts, f"no {table} rows arrived"
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[schema.Message], list[dict]]:
    """Run the NCCL job once; every message the ranks sent, and what each rank wrote."""
    tmp = tmp_path_factory.mktemp("gpu")
    script = tmp / "job.py"
    script.write_text(JOB)
    nproc = min(2, torch.cuda.device_count())
    port = _free_port()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        f"tcp://127.0.0.1:{port}",
        str(STEPS),
        str(tmp / "out.json"),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    msgs: list[schema.Message] = []
    try:
        while proc.poll() is None:
            if sock.poll(100):
                msgs.append(schema.decode(sock.recv()))
        while sock.poll(500):
            msgs.append(schema.decode(sock.recv()))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{err.decode()[-4000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
        ctx.term()
    outs = [json.loads(Path(f"{tmp / 'out.json'}.{r}").read_text()) for r in range(nproc)]
    return msgs, outs


def test_device_times_resolved_lazily_and_consistent(job) -> None:
    msgs, outs = job
    for out in outs:
        assert out["syncs"] == 0, "the collector synchronized the device"
        assert out["resolved"] > 0
    coll = _tables(msgs, "colls")
    timed = (coll["flags"] & schema.FLAG_DEVICE_TIMED) != 0
    bucket = (coll["flags"] & schema.FLAG_DDP_BUCKET) != 0
    # DDP buckets (comm hook) and explicit calls, synchronous and asynchronous, on CUDA.
    assert np.any(timed & bucket) and np.any(timed & ~bucket)
    assert np.any(timed & ((coll["flags"] & schema.FLAG_ASYNC) != 0) & ~bucket)
    # All but the collectives of the last steps were resolved before the job ended.
    settled = coll["step"] < STEPS - 3
    assert timed[settled].mean() >= 0.95, f"{timed[settled].mean():.0%} of rows device-timed"
    t = {k: coll[k][timed] for k in ("t_enter", "t_start", "t_end")}
    assert np.all(t["t_start"] > 0) and np.all(t["t_end"] >= t["t_start"])
    # The device reaches a collective after the host issued it (the start event is
    # recorded just before the host's entry stamp; the anchor's error is microseconds),
    # and a 4 MiB all-reduce on one node takes far less than a second.
    assert np.all(t["t_start"] >= t["t_enter"] - 1 * MS)
    assert np.all(t["t_end"] - t["t_start"] < 1_000 * MS)


def test_step_memory_figures(job) -> None:
    steps = _tables(job[0], "steps")
    after_first = steps["step"] >= 1  # CUDA is initialised once the first step ran
    alloc, reserved, peak = (
        steps[k][after_first] for k in ("mem_allocated", "mem_reserved", "mem_peak")
    )
    assert len(alloc) >= STEPS - 2
    assert np.all(alloc > 0)
    assert np.all(reserved >= alloc) and np.all(peak >= alloc)


@pytest.mark.skipif(nvml.nvml() is None, reason="NVML is not available (pynvml or driver)")
def test_nvml_samples_in_physical_ranges(job) -> None:
    s = _tables(job[0], "samples")
    assert len(s["t"]) >= 2
    for col, lo, hi in (
        ("sm_clock_mhz", 100, 5_000),
        ("mem_clock_mhz", 100, 20_000),
        ("power_w", 1, 2_000),
        ("temp_c", 5, 120),
        ("gpu_util", 0, 100),
    ):
        v = s[col][~np.isnan(s[col])]
        assert len(v) >= 1, f"no {col} values"
        assert np.all((v >= lo) & (v <= hi)), f"{col} outside [{lo}, {hi}]: {v[:8]}"
    assert np.all(s["throttle"] >= 0)
