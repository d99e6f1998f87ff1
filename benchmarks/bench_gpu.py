"""The collector's real GPU paths, on a machine with an NVIDIA GPU.

    python benchmarks/run.py gpu        # on the GPU machine; elsewhere its section is kept

One run measures what the CPU machine cannot: the ``gpu``-marked tests
(`tests/test_torch_gpu.py`: CUDA-event times resolved by the background thread without a
synchronize, the NCCL job, NVML samples), and the collector's cost in an NCCL DDP job, step
by step against the built-in step of the same round (`collector_jobs.in_job_steps` with
``device="cuda"``: one GPU a rank, at most two, each step ending with the device's work
done). It names the GPUs, the driver and NCCL, and whether the NCCL Inspector plugin
(``libnccl-profiler-inspector.so``) or NCCL's headers to build it are on the machine.
Without a CUDA device it measures nothing and says why; ``run.py`` then keeps the section
as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_collector import steps_table  # noqa: E402
from collector_jobs import LARGE, TINY, in_job_steps  # noqa: E402

PLUGIN = "libnccl-profiler-inspector.so"
SEARCH = ("/usr/lib", "/usr/local/lib", "/usr/local/cuda", "/opt", str(Path.home()))
"""Where the Inspector plugin and NCCL's headers are looked for (besides torch's own)."""


def _find(name: str, extra: tuple[str, ...] = ()) -> str | None:
    """The first file called ``name`` under the search roots (None: not found)."""
    for root in (*extra, *SEARCH):
        if not os.path.isdir(root):
            continue
        for dirpath, _dirs, files in os.walk(root):
            if name in files:
                return os.path.join(dirpath, name)
    return None


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # reported, not raised
        return f"unknown ({type(e).__name__}: {e})"


def gpu_tests() -> tuple[int, str]:
    """Run the ``gpu`` tests in a subprocess: (return code, pytest's summary lines)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "tests/test_torch_gpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = [ln for ln in done.stdout.splitlines() if ln.strip()][-8:]
    return done.returncode, "\n".join(tail)


def run(quick: bool) -> str | None:
    """Measure and return the Markdown section; None where there is no CUDA device."""
    try:
        import torch
    except ImportError:
        print("gpu: torch is not installed; nothing measured", flush=True)
        return None
    if not torch.cuda.is_available():
        print("gpu: no CUDA device (torch.cuda.is_available() is False); nothing measured")
        return None
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    nproc = min(2, n)
    code, summary = gpu_tests()
    pairs = 50 if quick else 200
    steps: list[dict[str, Any]] = [
        in_job_steps(nproc, pairs, LARGE, warm=20, device="cuda"),
        in_job_steps(nproc, pairs, TINY, warm=20, device="cuda"),
    ]
    torch_include = str(Path(torch.__file__).parent / "include")
    header = _find("nccl.h", (torch_include,))
    plugin = os.environ.get("NCCL_PROFILER_PLUGIN") or _find(PLUGIN)
    lines = [
        "## GPU paths",
        "",
        f"GPUs: {n} × {', '.join(names)}; driver {_driver()}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), NCCL {nccl}.",
        "",
        f"`python -m pytest tests/test_torch_gpu.py` (exit {code}):",
        "",
        "```",
        summary,
        "```",
        "",
        f"The collector in an NCCL DDP job of {nproc} rank(s), one GPU each: every round "
        "runs, in shuffled order (the same on every rank), a step with DDP's built-in "
        "all-reduce, one with a Python comm hook and no rankscope, and one instrumented "
        "step per `ddp_buckets` setting, each arm on its own copy of the model; each step "
        "ends with `torch.cuda.synchronize()`, so its wall time includes the device's work. "
        f"{pairs} timed rounds. *Large*: eight 512×512 layers, batch 512; *small*: MLP "
        "16-256-4, batch 8. Medians (IQR) over rounds and ranks.",
        "",
        *steps_table(steps),
        "",
        "Background thread CPU per instrumented step: "
        + "; ".join(
            f"{'large' if j['model']['layers'] else 'small'} {j['pump_us_per_step']:.0f} µs"
            for j in steps
        )
        + f". Dropped: {sum(j['dropped'] for j in steps)}.",
        "",
        "NCCL Inspector: "
        + (f"plugin at `{plugin}`" if plugin else f"no `{PLUGIN}` found")
        + "; "
        + (f"NCCL headers at `{header}`" if header else "no `nccl.h` found")
        + " (building the plugin needs NCCL's `ext-profiler/inspector` sources as well).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv) or "")
