"""Who this rank is: rank numbers, host, GPU, rack, rail, mesh coordinates, shard.

Sources, strongest first: explicit arguments to ``rankscope.start``, an initialised
``torch.distributed``, the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``, ``TORCHELASTIC_RESTART_COUNT``), then
rankscope's own variables (``RANKSCOPE_HOST``, ``RANKSCOPE_RACK``, ``RANKSCOPE_NIC``,
``RANKSCOPE_RAIL``, ``RANKSCOPE_MESH``, ``RANKSCOPE_SHARD``, ``RANKSCOPE_TOPOLOGY``).

Environment values are untrusted text. A garbage optional value is ignored with a
warning; a garbage rank or world size raises :class:`IdentityError` naming the variable,
so the monitor turns itself off instead of reporting under a wrong rank.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rankscope.collector import nvml
from rankscope.collector.schema import MESH_DIMS
from rankscope.collector.topology import TopologyError, load_topology

MAX_HOST_LEN = 253
MAX_LABEL_LEN = 128

Warn = Callable[[str], None]


class IdentityError(ValueError):
    """This rank's identity cannot be determined; the message names the culprit."""


@dataclass(frozen=True)
class Identity:
    """Identity fields of a ``hello`` (``schema.HELLO_REQUIRED`` + ``HELLO_OPTIONAL``)."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    node_rank: int
    pid: int
    incarnation: int = 0
    local_world_size: int | None = None
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    pci_bus: str | None = None
    numa_node: int | None = None
    nic: str | None = None
    rail: int | None = None
    rack: str | None = None
    mesh: dict[str, int] = field(default_factory=dict)
    shard: int | None = None

    def hello_fields(self) -> dict[str, Any]:
        """The identity map of a hello: unknown (None) fields left out."""
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "incarnation"}
        if not out.get("mesh"):
            out.pop("mesh", None)
        return out


def parse_int(text: str | None, name: str, *, lo: int = 0, hi: int | None = None) -> int | None:
    """Parse an integer environment value.

    Args:
        text: the raw value (None when unset).
        name: the variable name, for the error message.
        lo: smallest allowed value.
        hi: largest allowed value.

    Returns:
        The integer, or None when ``text`` is None or blank.

    Raises:
        ValueError: naming the variable and the value when it is not an int in range.
    """
    if text is None or not text.strip():
        return None
    t = text.strip()
    if not (t.isascii() and t.lstrip("+-").isdigit()) or len(t) > 12:
        raise ValueError(f"{name}={text!r} is not an integer")
    value = int(t)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={text!r} is out of range {bound}")
    return value


def parse_label(text: str | None, name: str, max_len: int = MAX_LABEL_LEN) -> str | None:
    """Validate a free-text label (host, rack, NIC): printable, no spaces, bounded length.

    Raises:
        ValueError: naming the variable when the value is not a usable label.
    """
    if text is None or not text.strip():
        return None
    t = text.strip()
    if len(t) > max_len or not t.isprintable() or any(c.isspace() for c in t):
        raise ValueError(f"{name}={text[:60]!r} is not a printable label of <= {max_len} chars")
    return t


def parse_mesh(text: str | None, name: str = "RANKSCOPE_MESH") -> dict[str, int]:
    """Parse mesh coordinates like ``"dp=0,tp=1"``.

    Raises:
        ValueError: naming the entry that is not ``dim=int`` with ``dim`` in ``MESH_DIMS``.
    """
    if text is None or not text.strip():
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        dim, sep, val = part.strip().partition("=")
        dim = dim.strip()
        if not sep or dim not in MESH_DIMS:
            raise ValueError(
                f"{name}: {part.strip()!r} is not dim=index with dim one of {', '.join(MESH_DIMS)}"
            )
        coord = parse_int(val, f"{name} {dim}")
        if coord is None:
            raise ValueError(f"{name}: {dim} has no index")
        out[dim] = coord
    return out


def _optional(parse: Callable[[], Any], warn: Warn) -> Any:
    try:
        return parse()
    except ValueError as exc:
        warn(f"ignoring {exc}")
        return None


def _torch_dist() -> tuple[int, int] | None:
    # Only look at torch if the program already imported it: the collector must not pull
    # torch into a process that does not use it.
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:
        return None
    return None


def _gpu_physical_index(local_rank: int, env: Mapping[str, str]) -> int | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        # current_device() would create a CUDA context; only ask when one exists.
        logical = (
            torch.cuda.current_device()
            if torch.cuda.is_initialized()
            else local_rank % max(1, torch.cuda.device_count())
        )
    except Exception:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return logical
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if logical >= len(entries):
        return logical
    entry = entries[logical]
    if entry.isdigit():
        return int(entry)
    return nvml.index_of_uuid(entry) if entry.startswith("GPU-") else None


def resolve_identity(
    *,
    env: Mapping[str, str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    node_rank: int | None = None,
    host: str | None = None,
    mesh: Mapping[str, int] | None = None,
    shard: int | None = None,
    topology: str | None = None,
    gpu_index: int | None = None,
    gpu_info: bool = True,
    warn: Warn = lambda msg: None,
) -> Identity:
    """Work out this rank's identity.

    Args:
        env: environment to read (``os.environ`` by default).
        rank, world_size, local_rank, node_rank, host, mesh, shard: explicit values that
            win over every other source.
        topology: topology file path (else ``RANKSCOPE_TOPOLOGY``).
        gpu_index: physical GPU index (else found through torch and ``CUDA_VISIBLE_DEVICES``).
        gpu_info: ask NVML for the GPU's UUID, PCI bus and NUMA node now (``Monitor``
            defers this to its background thread).
        warn: receives one message per ignored bad value.

    Returns:
        The identity.

    Raises:
        IdentityError: when the rank or world size is garbage or inconsistent.
    """
    env = os.environ if env is None else env
    from_dist = _torch_dist()
    try:
        if rank is None:
            rank = from_dist[0] if from_dist else parse_int(env.get("RANK"), "RANK")
        if world_size is None:
            world_size = (
                from_dist[1] if from_dist else parse_int(env.get("WORLD_SIZE"), "WORLD_SIZE", lo=1)
            )
    except ValueError as exc:
        raise IdentityError(str(exc)) from None
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise IdentityError(f"rank {rank} is outside world size {world_size}")

    lws = _optional(lambda: parse_int(env.get("LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE", lo=1), warn)
    if local_rank is None:
        local_rank = _optional(
            lambda: parse_int(env.get("LOCAL_RANK"), "LOCAL_RANK", hi=world_size - 1), warn
        )
    if local_rank is None:
        local_rank = rank % lws if lws else rank
    if node_rank is None:
        for var in ("GROUP_RANK", "NODE_RANK"):
            node_rank = _optional(lambda v=var: parse_int(env.get(v), v), warn)  # type: ignore[misc]
            if node_rank is not None:
                break
    if node_rank is None:
        node_rank = rank // lws if lws else 0

    if host is None:
        host = _optional(
            lambda: parse_label(env.get("RANKSCOPE_HOST"), "RANKSCOPE_HOST", MAX_HOST_LEN), warn
        )
    if host is None:
        host = socket.gethostname() or "localhost"
    incarnation = _optional(
        lambda: parse_int(env.get("TORCHELASTIC_RESTART_COUNT"), "TORCHELASTIC_RESTART_COUNT"),
        warn,
    )
    mesh_map = (
        dict(mesh)
        if mesh is not None
        else _optional(lambda: parse_mesh(env.get("RANKSCOPE_MESH")), warn)
    )
    if shard is None:
        shard = _optional(lambda: parse_int(env.get("RANKSCOPE_SHARD"), "RANKSCOPE_SHARD"), warn)

    if gpu_index is None:
        gpu_index = _gpu_physical_index(local_rank, env)
    gpu = nvml.device_info(gpu_index) if gpu_index is not None and gpu_info else {}

    rack = nic = rail = None
    topo_path = topology or env.get("RANKSCOPE_TOPOLOGY")
    if topo_path:
        try:
            # A CPU-only rank has no GPU index; its local rank names its device slot.
            place = load_topology(topo_path).lookup(
                host, gpu_index if gpu_index is not None else local_rank
            )
            rack, nic, rail = place.rack, place.nic, place.rail
        except TopologyError as exc:
            warn(f"ignoring the topology: {exc}")
    if rack is None:
        rack = _optional(lambda: parse_label(env.get("RANKSCOPE_RACK"), "RANKSCOPE_RACK"), warn)
    if nic is None:
        nic = _optional(lambda: parse_label(env.get("RANKSCOPE_NIC"), "RANKSCOPE_NIC"), warn)
    if rail is None:
        rail = _optional(
            lambda: parse_int(env.get("RANKSCOPE_RAIL"), "RANKSCOPE_RAIL", hi=1 << 20), warn
        )

    return Identity(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        host=host,
        node_rank=node_rank,
        pid=os.getpid(),
        incarnation=incarnation or 0,
        local_world_size=lws,
        gpu_index=gpu_index,
        gpu_uuid=gpu.get("gpu_uuid"),
        pci_bus=gpu.get("pci_bus"),
        numa_node=gpu.get("numa_node"),
        nic=nic,
        rail=rail,
        rack=rack,
        mesh=mesh_map or {},
        shard=shard,
    )
