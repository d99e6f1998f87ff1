"""The manifest a rank sends with its hello: what software, hardware and configuration it
runs, so that two runs can be diffed field by field (ARCHITECTURE §3)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from rankscope.collector import nvml
from rankscope.version import __version__

ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "RANKSCOPE_", "TORCHELASTIC_", "GLOO_", "UCX_", "FI_")
ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
)
"""Launcher and library variables worth diffing between runs."""

_SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|AUTH", re.IGNORECASE)
MAX_VALUE_LEN = 1024


def filtered_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that shape a distributed run, secrets redacted.

    Args:
        env: environment (``os.environ`` by default).

    Returns:
        Name -> value for ``ENV_PREFIXES``/``ENV_NAMES``; values of names that look like
        credentials are replaced by ``"<redacted>"``, long values are truncated.
    """
    env = os.environ if env is None else env
    out = {}
    for name in sorted(env):
        if not (name.startswith(ENV_PREFIXES) or name in ENV_NAMES):
            continue
        value = env[name]
        if _SECRET.search(name):
            value = "<redacted>"
        out[name] = value[:MAX_VALUE_LEN]
    return out


def git_commit(env: Mapping[str, str] | None = None, timeout_s: float = 1.0) -> str | None:
    """The source commit: ``RANKSCOPE_GIT_COMMIT`` or ``git rev-parse HEAD`` in the cwd.

    Args:
        env: environment (``os.environ`` by default).
        timeout_s: bound on the git call.

    Returns:
        The commit hash, or None when unknown.
    """
    env = os.environ if env is None else env
    if env.get("RANKSCOPE_GIT_COMMIT"):
        return env["RANKSCOPE_GIT_COMMIT"][:64]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,64}", commit) else None


def _torch_facts() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    out: dict[str, Any] = {"torch": str(torch.__version__)}
    try:
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_initialized():
            out["backend"] = str(dist.get_backend())
    except Exception:
        pass
    return out


def _plain(value: Any, depth: int = 0) -> Any:
    """Reduce a job-config value to msgpack-safe plain data (dicts, lists, scalars)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value[:MAX_VALUE_LEN] if isinstance(value, str) else value
    if depth > 6:
        return repr(value)[:MAX_VALUE_LEN]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value[:1000]]
    return repr(value)[:MAX_VALUE_LEN]


def build_manifest(
    job_config: Mapping[str, Any] | None = None,
    gpu_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Collect the manifest.

    Args:
        job_config: the user's job configuration (model, global batch, micro batch,
            sequence length, precision, checkpoint policy, quality target...).
        gpu_index: physical GPU index, for model, clocks and power limit.
        env: environment (``os.environ`` by default).

    Returns:
        A plain map: ``python``, ``rankscope``, ``platform``, ``torch``/``cuda``/``nccl``/
        ``backend`` when torch is loaded, ``driver``/``gpu_model``/clock and power facts
        when NVML works, ``env``, ``argv``, ``executable``, ``git_commit``, ``job_config``.
    """
    man: dict[str, Any] = {
        "python": platform.python_version(),
        "rankscope": __version__,
        "platform": platform.platform(),
        "executable": sys.executable,
        "argv": [str(a)[:MAX_VALUE_LEN] for a in sys.argv[:200]],
    }
    man.update(_torch_facts())
    if gpu_index is not None:
        info = nvml.device_info(gpu_index)
        for key in (
            "gpu_model",
            "driver",
            "cuda_driver",
            "sm_clock_max_mhz",
            "mem_clock_max_mhz",
            "sm_clock_app_mhz",
            "power_limit_w",
        ):
            if key in info:
                man[key] = info[key]
    man["env"] = filtered_env(env)
    man["git_commit"] = git_commit(env)
    man["job_config"] = _plain(dict(job_config or {}))
    return man
