"""Zero-code instrumentation: start monitoring when the job initialises its process group.

``rankscope run`` puts a generated ``sitecustomize.py`` first on ``PYTHONPATH``; it calls
:func:`install` in every Python process the command starts. ``install`` only registers an
import watcher — nothing else happens in a process that never imports
``torch.distributed`` (tools, the torchrun agent's helpers, data workers). When
``torch.distributed`` is imported, ``init_process_group`` is wrapped and
``DeviceMesh.__init__`` watched (so a mesh is seen whatever name the script bound); when
``init_process_group`` returns, a ``Monitor`` starts with settings from the
``RANKSCOPE_*`` environment and the torch hooks are installed. Any failure is logged once and training continues unobserved.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("rankscope")

ENV_MARKER = "RANKSCOPE_ZERO_CODE"
"""Set to ``1`` by ``rankscope run``; ``0`` turns the bootstrap off for a process."""

_TARGET = "torch.distributed"


def _start_monitor() -> None:
    try:
        from rankscope.collector import runtime

        runtime.start(instrument_torch=True)
    except Exception as exc:
        log.warning(
            "rankscope: zero-code monitoring did not start: %s: %s", type(exc).__name__, exc
        )


def _wrap_init(orig: Any) -> Any:
    if getattr(orig, "__rankscope_original__", None) is not None:
        return orig

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        _start_monitor()
        return out

    init_process_group.__rankscope_original__ = orig  # type: ignore[attr-defined]
    return init_process_group


def patch_torch_distributed(dist: ModuleType) -> None:
    """Wrap ``init_process_group`` in ``torch.distributed`` and its c10d module.

    Args:
        dist: the ``torch.distributed`` module.
    """
    if not getattr(dist, "is_available", lambda: False)():
        return
    # device_mesh binds its own name at import: a mesh made before any process group
    # initialises the default one through it.
    owners: list[Any] = [
        dist,
        getattr(dist, "distributed_c10d", None),
        sys.modules.get("torch.distributed.device_mesh"),
    ]
    for owner in owners:
        fn = getattr(owner, "init_process_group", None)
        if owner is not None and fn is not None:
            owner.init_process_group = _wrap_init(fn)
    _watch_meshes()
    if dist.is_initialized():  # imported and initialised before we could see it
        _start_monitor()


def _watch_meshes() -> None:
    """Note every ``DeviceMesh`` from now on, before the script binds any of torch's names
    (a mesh is usually built before or while the process group initialises)."""
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is None:
        return
    try:
        from rankscope.collector import torch_mesh

        torch_mesh.watch(device_mesh)
    except Exception as exc:
        log.warning("rankscope: device meshes go unseen: %s: %s", type(exc).__name__, exc)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            patch_torch_distributed(module)
        except Exception as exc:
            log.warning("rankscope: could not patch torch.distributed: %s", exc)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``torch.distributed`` once."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        remove_watcher()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


_watcher = _Watcher()


def remove_watcher() -> None:
    """Stop watching imports (after ``torch.distributed`` was seen)."""
    try:
        sys.meta_path.remove(_watcher)
    except ValueError:
        pass


def install() -> None:
    """Arrange for monitoring to start when the process group is initialised.

    Idempotent; does nothing when ``RANKSCOPE_ZERO_CODE=0``.
    """
    if os.environ.get(ENV_MARKER, "1") == "0":
        return
    dist = sys.modules.get(_TARGET)
    if dist is not None:
        patch_torch_distributed(dist)
        return
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)


SITECUSTOMIZE = '''\
"""Generated by `rankscope run`: start rankscope when torch.distributed initialises.

It first runs the sitecustomize this file shadows, if any, so existing site setup is kept.
"""


def _rankscope_bootstrap():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is not None and spec.loader is not None:
            chained = importlib.util.module_from_spec(spec)
            sys.modules["_rankscope_chained_sitecustomize"] = chained
            spec.loader.exec_module(chained)
    except Exception as exc:
        sys.stderr.write("rankscope: the original sitecustomize failed: %r\\n" % (exc,))
    try:
        from rankscope.collector import autostart

        autostart.install()
    except Exception as exc:
        sys.stderr.write("rankscope: zero-code instrumentation unavailable: %r\\n" % (exc,))


_rankscope_bootstrap()
del _rankscope_bootstrap
'''
"""Source of the injected ``sitecustomize.py``."""


def site_dir_path(base: str | None = None) -> str:
    """The directory `prepare_site_dir` writes to (in the usual case), without writing it:
    what ``rankscope run --dry-run`` shows on ``PYTHONPATH``.

    Args:
        base: parent directory (the system temporary directory by default).

    Returns:
        ``<base>/rankscope-site-<uid>-<hash of the bootstrap>``.
    """
    import hashlib
    import tempfile

    digest = hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest()[:12]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(base or tempfile.gettempdir(), f"rankscope-site-{uid}-{digest}")


def prepare_site_dir(base: str | None = None) -> str:
    """Write the bootstrap ``sitecustomize.py`` into a private directory and return it.

    The directory name carries a hash of the content, so it is written once and reused
    by later runs (``rankscope run`` replaces itself with the command, leaving nothing to
    clean up). A directory not owned by this user, or writable by others, is never used:
    its ``sitecustomize`` would run inside every training process.

    Args:
        base: parent directory (the system temporary directory by default).

    Returns:
        The directory to put first on ``PYTHONPATH``.
    """
    import stat
    import tempfile

    parent = base or tempfile.gettempdir()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = site_dir_path(base)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        unsafe = (
            not stat.S_ISDIR(st.st_mode)
            or (hasattr(os, "getuid") and st.st_uid != uid)
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        )
        if unsafe:
            path = tempfile.mkdtemp(prefix="rankscope-site-", dir=parent)
    target = os.path.join(path, "sitecustomize.py")
    try:
        with open(target, encoding="utf-8") as f:
            if f.read() == SITECUSTOMIZE:
                return path
    except OSError:
        pass
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE)
    os.replace(tmp, target)
    return path
