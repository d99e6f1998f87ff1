"""``rankscope.start``: resolve settings, build the process's one active ``Monitor``.

Explicit arguments are checked strictly (a typo in code is a bug to show at once);
values read from the environment are untrusted and fall back with a warning. A rank whose
identity cannot be determined gets an inert monitor and a warning: it trains unobserved
rather than reporting under a wrong rank.

The connection to the hub uses CURVE when this process finds keys (``RANKSCOPE_KEYS``,
``RANKSCOPE_CLIENT_KEY``, else ``~/.config/rankscope/keys``; `rankscope.collector.security`)
and plain ZeroMQ otherwise. Keys never stop a rank from training: unusable ones are reported
once, and a hub that refuses this rank's handshake simply receives nothing from it.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rankscope.collector import schema
from rankscope.collector.clock import clock_endpoint
from rankscope.collector.identity import Identity, IdentityError, resolve_identity
from rankscope.collector.identity import parse_label as _parse_label
from rankscope.collector.monitor import DDP_BUCKET_MODES, DDP_SAMPLE_EVERY, Monitor
from rankscope.collector.security import client_curve_from_env
from rankscope.collector.sender import DEFAULT_HWM, check_endpoint

log = logging.getLogger("rankscope")

DEFAULT_HUB = "tcp://127.0.0.1:5555"
"""Hub address when neither ``hub=`` nor ``RANKSCOPE_HUB`` says otherwise."""

RUN_KEY = "rankscope/run_id"

_lock = threading.Lock()
_active: Monitor | None = None


def current() -> Monitor | None:
    """The process's active monitor, if one was started and not closed."""
    return _active


def new_run_id(job: str) -> str:
    """A fresh run id: job, UTC time and random suffix (``train-20250101T120000-3fa9``)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{job}-{stamp}-{secrets.token_hex(2)}"


def _check_label(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    label = _parse_label(value, what)
    if label is None:
        raise ValueError(f"{what} must not be empty")
    return label


def _env_label(env: Mapping[str, str], name: str) -> str | None:
    try:
        return _parse_label(env.get(name), name)
    except ValueError as exc:
        log.warning("rankscope: ignoring %s", exc)
        return None


def _ddp_settings(env: Mapping[str, str], mode: str | None, every: int | None) -> tuple[str, int]:
    """DDP bucket timing from the arguments (strict) or the environment (a bad value is
    ignored with a warning)."""
    if mode is None:
        raw = env.get("RANKSCOPE_DDP_BUCKETS", "").strip().lower()
        mode = raw or "auto"
        if mode not in DDP_BUCKET_MODES:
            log.warning(
                "rankscope: ignoring RANKSCOPE_DDP_BUCKETS=%r (not one of %s)",
                raw,
                ", ".join(DDP_BUCKET_MODES),
            )
            mode = "auto"
    elif mode not in DDP_BUCKET_MODES:
        raise ValueError(f"ddp_buckets {mode!r} is not one of {', '.join(DDP_BUCKET_MODES)}")
    if every is None:
        raw = env.get("RANKSCOPE_DDP_SAMPLE_EVERY", "").strip()
        every = DDP_SAMPLE_EVERY
        if raw:
            try:
                every = int(raw)
                if every < 1:
                    raise ValueError
            except ValueError:
                log.warning(
                    "rankscope: ignoring RANKSCOPE_DDP_SAMPLE_EVERY=%r (not an int >= 1)", raw
                )
                every = DDP_SAMPLE_EVERY
    elif not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"ddp_sample_every must be an int >= 1, got {every!r}")
    return mode, every


def _inspector_plugin(env: Mapping[str, str], path: str | None) -> str | None:
    """The NCCL Inspector plugin from the argument (strict) or ``RANKSCOPE_NCCL_INSPECTOR``
    (a bad one is ignored with a warning)."""
    from rankscope.collector.inspector_tail import ENV_PLUGIN, check_plugin

    if path is not None:
        return check_plugin(path)
    raw = env.get(ENV_PLUGIN, "").strip()
    if not raw:
        return None
    try:
        return check_plugin(raw)
    except ValueError as exc:
        log.warning("rankscope: ignoring %s: %s", ENV_PLUGIN, exc)
        return None


def _agree_run_id(job: str) -> str:
    """One run id for every rank, through the process group's store: each rank proposes
    a fresh id with compare-and-set and the first proposal wins. A store operation is not
    a collective, so it neither shifts collective sequence numbers nor waits for a rank
    that never arrives."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_initialized():
                store = dist.distributed_c10d._get_default_store()
                got = store.compare_set(RUN_KEY, "", new_run_id(job))
                run = got.decode() if isinstance(got, bytes) else str(got)
                label = _env_label({"R": run}, "R")
                if label:
                    return label
        except Exception as exc:
            log.warning("rankscope: could not agree on a run id through the store: %s", exc)
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        label = _env_label({"R": f"{job}-{elastic}"}, "R")
        if label:
            return label
    return new_run_id(job)


def start(
    job: str | None = None,
    run: str | None = None,
    scope: str | None = None,
    hub: str | None = None,
    job_config: Mapping[str, Any] | None = None,
    parent_run: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    node_rank: int | None = None,
    host: str | None = None,
    mesh: Mapping[str, int] | None = None,
    shard: int | None = None,
    topology: str | None = None,
    capacity: int = 1 << 16,
    hwm: int = DEFAULT_HWM,
    flush_interval_s: float = 0.5,
    sample_interval_s: float = 1.0,
    clock_sync: bool = True,
    instrument_torch: bool | None = None,
    ddp_buckets: str | None = None,
    ddp_sample_every: int | None = None,
    nccl_inspector: str | None = None,
) -> Monitor:
    """Start monitoring this rank (or return the monitor already running).

    Args:
        job: job name (``RANKSCOPE_JOB``, else the script name).
        run: run id shared by every rank (``RANKSCOPE_RUN``, else agreed through the
            torch process group's store, else fresh).
        scope: one of ``full``, ``two-node``, ``one-node``, ``one-rank``, ``custom``
            (``RANKSCOPE_SCOPE``, else ``full``).
        hub: hub data address (``RANKSCOPE_HUB``, else ``tcp://127.0.0.1:5555``); the
            connection uses the CURVE keys the environment names (module docstring).
        job_config: model, global batch, micro batch, sequence length, precision,
            checkpoint policy, quality target... (sent in the manifest).
        parent_run: the run this one is a reduced rerun of (``RANKSCOPE_PARENT_RUN``).
        rank, world_size, local_rank, node_rank, host, mesh, shard, topology: identity
            overrides (see ``rankscope.collector.identity``).
        capacity: rows buffered per ring before new ones are dropped.
        hwm: messages queued for the hub before new ones are dropped.
        flush_interval_s: shortest time between two shipments to the hub (a step end
            ships once this long has passed since the last one).
        sample_interval_s: device/host sampling period (0: off).
        clock_sync: ping the hub's clock service.
        instrument_torch: wrap torch.distributed collectives, optimizer steps and the
            DataLoader (default: when torch is already imported).
        ddp_buckets: how DDP's gradient all-reduce is timed (``RANKSCOPE_DDP_BUCKETS``,
            else ``auto``), one of ``monitor.DDP_BUCKET_MODES``: ``auto`` is ``tail`` on
            CPU and ``every`` on GPU; ``every`` bucket of every step through a Python comm
            hook; ``sampled``, the same hook recording one step in ``ddp_sample_every``;
            ``tail``, no hook, one row per backward for the wait at its end; ``off``, no
            hook and nothing of DDP's all-reduce seen.
        ddp_sample_every: with ``sampled``, the step period (``RANKSCOPE_DDP_SAMPLE_EVERY``,
            else 10).
        nccl_inspector: path of NVIDIA's NCCL Inspector plugin
            (``libnccl-profiler-inspector.so``; ``RANKSCOPE_NCCL_INSPECTOR``): sets its
            environment in this process and tails its output for device-timed collectives
            (`collector.inspector_tail`). NCCL reads it when it starts: call before the
            first collective.

    Returns:
        The active monitor (inert when this rank's identity could not be determined).

    Raises:
        ValueError: on a bad explicit argument, naming it.
    """
    global _active
    env = os.environ
    with _lock:
        if _active is not None and not _active._closed:
            # Started already (e.g. by `rankscope run`): keep it, add the caller's config.
            if job_config:
                _active.update_job_config(dict(job_config))
            return _active
        if job is not None:
            job = _check_label(job, "job")
        else:
            script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
            job = _env_label(env, "RANKSCOPE_JOB") or _env_label({"j": script}, "j") or "job"
        if run is not None:
            run = _check_label(run, "run")
        if parent_run is not None:
            parent_run = _check_label(parent_run, "parent_run")
        else:
            parent_run = _env_label(env, "RANKSCOPE_PARENT_RUN")
        if scope is None:
            scope = env.get("RANKSCOPE_SCOPE", "full").strip() or "full"
            if scope not in schema.SCOPES:
                log.warning(
                    "rankscope: ignoring RANKSCOPE_SCOPE=%r (not one of %s)", scope, schema.SCOPES
                )
                scope = "full"
        elif scope not in schema.SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {', '.join(schema.SCOPES)}")
        if hub is not None:
            hub = check_endpoint(hub)
            clock_endpoint(hub)
        else:
            hub = DEFAULT_HUB
            raw = env.get("RANKSCOPE_HUB")
            if raw:
                try:
                    hub = check_endpoint(raw)
                    clock_endpoint(hub)
                except ValueError as exc:
                    log.warning(
                        "rankscope: ignoring RANKSCOPE_HUB (%s); using %s", exc, DEFAULT_HUB
                    )
                    hub = DEFAULT_HUB
        if job_config is not None and not isinstance(job_config, Mapping):
            raise ValueError(f"job_config must be a mapping, got {type(job_config).__name__}")
        ddp_buckets, ddp_sample_every = _ddp_settings(env, ddp_buckets, ddp_sample_every)
        inspector = _inspector_plugin(env, nccl_inspector)
        for name, size in (("capacity", capacity), ("hwm", hwm)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s!r}")
        for name, value in (
            ("rank", rank),
            ("world_size", world_size),
            ("local_rank", local_rank),
            ("node_rank", node_rank),
            ("shard", shard),
        ):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if host is not None:
            host = _check_label(host, "host")
        if mesh is not None:
            bad = {
                k: v
                for k, v in mesh.items()
                if k not in schema.MESH_DIMS or not isinstance(v, int) or v < 0
            }
            if bad:
                raise ValueError(f"mesh entries {bad} are not {schema.MESH_DIMS} -> int >= 0")

        warned: list[str] = []

        def warn(msg: str) -> None:
            warned.append(msg)
            log.warning("rankscope: %s", msg)

        enabled = True
        try:
            identity = resolve_identity(
                env=env,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                node_rank=node_rank,
                host=host,
                mesh=mesh,
                shard=shard,
                topology=topology,
                warn=warn,
                gpu_info=False,
            )
        except IdentityError as exc:
            log.warning("rankscope: monitoring disabled on this process: %s", exc)
            identity = Identity(
                rank=0, world_size=1, local_rank=0, host="?", node_rank=0, pid=os.getpid()
            )
            enabled = False
        if run is None:
            run = _env_label(env, "RANKSCOPE_RUN") or (
                _agree_run_id(job) if enabled else new_run_id(job)
            )
        mon = Monitor(
            job=job,
            run=run,
            identity=identity,
            hub=hub,
            scope=scope,
            parent_run=parent_run,
            job_config=job_config,
            capacity=capacity,
            hwm=hwm,
            flush_interval_s=flush_interval_s,
            sample_interval_s=sample_interval_s,
            clock_sync=clock_sync,
            enabled=enabled,
            ddp_buckets=ddp_buckets,
            ddp_sample_every=ddp_sample_every,
            # Keys are for tcp: an ipc socket (a node's relay, a hub on this machine) is a
            # file only its user can open, and speaks plain ZeroMQ.
            curve=client_curve_from_env(env) if enabled and hub.startswith("tcp://") else None,
        )
        if warned:
            mon._errors["bad_env"] = len(warned)
        if inspector and enabled:
            try:
                from rankscope.collector.inspector_tail import start_tail

                start_tail(mon, inspector)
            except Exception as exc:
                mon._error("nccl_inspector", exc)
        mon.start()
        _active = mon
    if enabled and (instrument_torch or (instrument_torch is None and "torch" in sys.modules)):
        try:
            from rankscope.collector import torch_hooks

            torch_hooks.install(mon)
        except Exception as exc:
            mon._error("torch_hooks", exc)
    return mon


def instrument(model: Any, monitor: Monitor | None = None) -> Any:
    """Instrument a torch model (forward phase; DDP gradient buckets). See
    ``rankscope.collector.torch_hooks.instrument``.

    Args:
        model: the (DDP-wrapped) model.
        monitor: the monitor (the active one by default).

    Returns:
        The model.
    """
    from rankscope.collector import torch_hooks

    return torch_hooks.instrument(model, monitor)


def close() -> None:
    """Close the active monitor (ships what is buffered) and remove the torch hooks."""
    global _active
    with _lock:
        mon, _active = _active, None
    if mon is not None:
        mon.close()


def _at_exit() -> None:
    try:
        close()
    except Exception:
        pass


def _after_fork_in_child() -> None:
    global _active, _lock
    # The parent's lock may have been held by another thread at fork time.
    _lock = threading.Lock()
    mon, _active = _active, None
    if mon is not None:
        mon._after_fork_in_child()


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
