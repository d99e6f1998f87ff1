"""Mesh coordinates and process groups, however the training script made them.

A script may bind ``init_device_mesh`` before rankscope's hooks exist (``from
torch.distributed.device_mesh import init_device_mesh`` at the top), build a
``DeviceMesh(...)`` directly, slice it (``mesh["tp"]``), flatten dimensions, or make groups
with ``new_group`` / ``split_group`` and no mesh at all. Two sources cover every form:

- ``DeviceMesh.__init__`` is wrapped on the class as soon as ``torch.distributed`` is
  imported (`watch`, called by the zero-code bootstrap): every mesh, whatever function built
  it, is noted — before the monitor exists too — and read at the next step boundary.
- torch's own group registry (``distributed_c10d._world.pg_map``) is scanned when it grows:
  every group this rank belongs to is registered, and a group torch made for a mesh
  dimension (``group_desc`` ``mesh_<dim>``) gives that dimension's coordinate (the rank's
  index in it) and name, so a mesh made before any hook still yields coordinates.

Coordinates a program or ``RANKSCOPE_MESH`` gave explicitly win over derived ones.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from rankscope.collector import schema

MESH_ALIASES = {
    "dp_replicate": "dp",
    "dp_shard": "dp",
    "data": "dp",
    "fsdp": "dp",
    "tensor": "tp",
    "pipeline": "pp",
    "context": "cp",
    "expert": "ep",
}
"""DeviceMesh dimension names mapped onto ``schema.MESH_DIMS`` (several names on one
dimension, e.g. HSDP's ``dp_replicate`` x ``dp_shard``, combine in mesh order)."""

MAX_PENDING = 256
"""Meshes noted before they are read; beyond this the oldest are read at once or dropped."""


class _MeshState:
    def __init__(self) -> None:
        self.pending: list[Any] = []
        """Meshes built since the last `refresh`."""
        self.seen_groups = -1
        """Size of torch's group registry at the last scan."""
        self.from_meshes: dict[str, int] = {}
        self.from_groups: dict[str, int] = {}
        self.explicit: dict[str, int] | None = None
        """Coordinates the identity held before any was derived (they win)."""
        self.pp_ranks: frozenset[int] = frozenset()
        """Global ranks of this rank's pipeline group (``pp``), empty when unknown."""
        self.watched = False


state = _MeshState()


def dim_of(name: str) -> str | None:
    """The schema mesh dimension a DeviceMesh dimension name stands for, or None."""
    return name if name in schema.MESH_DIMS else MESH_ALIASES.get(name)


def watch(device_mesh: Any) -> None:
    """Wrap ``DeviceMesh.__init__`` so every mesh built from now on is noted.

    Idempotent. Costs one list append per mesh built (meshes are built at set-up).

    Args:
        device_mesh: the ``torch.distributed.device_mesh`` module.
    """
    cls = getattr(device_mesh, "DeviceMesh", None)
    if cls is None or state.watched:
        return
    orig = cls.__init__
    if getattr(orig, "__rankscope_original__", None) is not None:
        state.watched = True
        return

    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        pend = state.pending
        if len(pend) >= MAX_PENDING:
            del pend[: MAX_PENDING // 2]
        pend.append(self)
        try:  # while monitoring, take it now (a slice's groups are its root's: seen there)
            from rankscope.collector.torch_collectives import _state

            if _state.mon is not None:
                refresh(_state.mon)
        except Exception:
            pass

    __init__.__rankscope_original__ = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__
    state.watched = True


def _group_count() -> int:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        return len(c10d._world.pg_map) if c10d is not None else 0
    except Exception:
        return 0


def dirty() -> bool:
    """A mesh or a group appeared since the last `refresh` (cheap: a step-boundary check)."""
    return bool(state.pending) or _group_count() != state.seen_groups


def _combine(parts: list[tuple[str, int, int]]) -> dict[str, int]:
    """``(dim, coordinate, size)`` in mesh order -> one coordinate per dim (mixed radix)."""
    out: dict[str, int] = {}
    for dim, coord, size in parts:
        out[dim] = out.get(dim, 0) * size + coord
    return out


def note_mesh(mesh: Any, mon: Any) -> None:
    """Take a mesh's coordinates and name its per-dimension groups.

    Args:
        mesh: a ``DeviceMesh``.
        mon: the monitor (its group table receives the names).
    """
    from rankscope.collector.torch_collectives import _name_group

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    coord = mesh.get_coordinate()
    if coord is None or not names:
        return
    shape = tuple(mesh.mesh.shape) if hasattr(mesh, "mesh") else (1,) * len(names)
    parts = []
    exact = {dim_of(n) for n in names if n in schema.MESH_DIMS}
    for i, name in enumerate(names):
        dim = dim_of(name)
        # A dimension named exactly (``dp``, often a flattened dp_replicate x dp_shard)
        # wins over the aliases that make it up.
        if dim is not None and (name in schema.MESH_DIMS or dim not in exact):
            parts.append((dim, int(coord[i]), int(shape[i])))
        try:
            pg = mesh.get_group(i)
            _name_group(pg, name)
            if dim == "pp":
                dist = sys.modules["torch.distributed"]
                state.pp_ranks = frozenset(dist.get_process_group_ranks(pg))
        except Exception as exc:
            if getattr(mesh, "_root_mesh", None) is None:
                mon._error("device_mesh_group", exc)
    for dim, c in _combine(parts).items():
        # A mesh of several dimensions is the layout itself; a 1-D one (a slice, a
        # flattened dimension) only fills what no such mesh gave.
        if len(names) > 1 or dim not in state.from_meshes:
            state.from_meshes[dim] = c


def _scan_groups(mon: Any) -> None:
    """Register every group of torch's registry; mesh-dimension groups give coordinates."""
    from rankscope.collector.torch_collectives import _group_id, _name_group

    dist = sys.modules["torch.distributed"]
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    me = dist.get_rank()
    groups = list(c10d._world.pg_map)
    state.seen_groups = len(groups)
    parts: list[tuple[str, int, int]] = []
    for pg in groups:
        if pg is dist.group.WORLD:
            continue
        gid = _group_id(pg)
        if gid < 0:
            continue
        desc = str(getattr(pg, "group_desc", "") or "")
        if not desc.startswith("mesh_"):
            continue
        name = desc[5:]
        _name_group(pg, name)
        dim = dim_of(name)
        if dim is None:
            continue
        ranks = list(dist.get_process_group_ranks(pg))
        if name in schema.MESH_DIMS:
            state.from_groups[dim] = ranks.index(me)
        else:
            parts.append((dim, ranks.index(me), len(ranks)))
        if dim == "pp":
            state.pp_ranks = frozenset(ranks)
    for dim, c in _combine(parts).items():
        state.from_groups.setdefault(dim, c)


def refresh(mon: Any) -> None:
    """Read the meshes and groups made since the last call into ``mon``'s identity and group
    table (a hello follows when the coordinates changed). Never raises.

    Args:
        mon: the running monitor.
    """
    try:
        if state.explicit is None:
            state.explicit = dict(mon.identity.mesh)
        pending, state.pending = state.pending, []
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_initialized():
            state.pending = pending + state.pending
            return
        _scan_groups(mon)
        for mesh in pending:
            try:
                note_mesh(mesh, mon)
            except Exception as exc:
                mon._error("device_mesh", exc)
        coords = {**state.from_groups, **state.from_meshes, **state.explicit}
        if coords != mon.identity.mesh:
            mon.update_identity(mesh=coords)
    except Exception as exc:
        mon._error("mesh_refresh", exc)


def reset() -> None:
    """Forget what was derived (``torch_hooks.uninstall``); the class patch stays."""
    state.pending.clear()
    state.seen_groups = -1
    state.from_meshes.clear()
    state.from_groups.clear()
    state.explicit = None
    state.pp_ranks = frozenset()
