"""Topology files: which rack a host sits in and which NIC and rail each GPU uses.

The format (``config/topology/example.toml`` is the annotated reference)::

    version = 1
    [racks]                      # rack -> host names or fnmatch patterns
    "rack-a" = ["gpu-a01", "gpu-a0[2-4]"]
    [gpus]                       # GPU index -> NIC and rail, on every host
    "0" = { nic = "mlx5_0", rail = 0 }
    [hosts."gpu-b07"]            # per-host overrides
    rack = "rack-b"
    gpus = { "3" = { nic = "mlx5_9", rail = 3 } }

Every problem in a file is reported as a :class:`TopologyError` naming the file and the
offending key, because a silently ignored typo would later read as "no rail effect".
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOPOLOGY_VERSION = 1


class TopologyError(ValueError):
    """A topology file cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Placement:
    """Where one rank's GPU sits in the fabric; None means unknown."""

    rack: str | None = None
    nic: str | None = None
    rail: int | None = None


@dataclass(frozen=True)
class GpuLink:
    """The NIC and rail a GPU uses."""

    nic: str | None
    rail: int | None


@dataclass(frozen=True)
class Topology:
    """A parsed topology file."""

    path: str
    racks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(rack, host patterns) in file order."""
    gpus: dict[int, GpuLink] = field(default_factory=dict)
    """Default GPU index -> link for every host."""
    host_racks: dict[str, str] = field(default_factory=dict)
    host_gpus: dict[str, dict[int, GpuLink]] = field(default_factory=dict)

    def rack_of(self, host: str) -> str | None:
        """The rack of ``host``: a per-host entry first, then the first matching pattern."""
        if host in self.host_racks:
            return self.host_racks[host]
        for rack, patterns in self.racks:
            if any(fnmatch.fnmatchcase(host, p) for p in patterns):
                return rack
        return None

    def lookup(self, host: str, gpu_index: int | None) -> Placement:
        """Rack, NIC and rail of a GPU on a host.

        Args:
            host: host name as the rank reports it.
            gpu_index: the GPU (or device slot) index on that host, None if unknown.

        Returns:
            The placement; fields the file does not cover are None.
        """
        link = None
        if gpu_index is not None:
            link = self.host_gpus.get(host, {}).get(gpu_index) or self.gpus.get(gpu_index)
        return Placement(
            rack=self.rack_of(host),
            nic=link.nic if link else None,
            rail=link.rail if link else None,
        )


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise TopologyError(
                f"topology file {path}: reading TOML needs Python 3.11+ or the tomli package"
            ) from None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"topology file {path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TopologyError(f"topology file {path}: not UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"topology file {path}: invalid TOML ({exc})") from None


def _gpu_map(path: Path, where: str, raw: Any) -> dict[int, GpuLink]:
    if not isinstance(raw, dict):
        raise TopologyError(f"topology file {path}: {where} must be a table of GPU index -> link")
    out: dict[int, GpuLink] = {}
    for key, val in raw.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise TopologyError(
                f"topology file {path}: {where} key {key!r} is not a GPU index (0, 1, ...)"
            )
        if not isinstance(val, dict):
            raise TopologyError(
                f"topology file {path}: {where}.{key} must be a table like {{ nic = ..., rail = ... }}"
            )
        unknown = set(val) - {"nic", "rail"}
        if unknown:
            raise TopologyError(
                f"topology file {path}: {where}.{key} has unknown keys {sorted(unknown)}"
            )
        nic, rail = val.get("nic"), val.get("rail")
        if nic is not None and (not isinstance(nic, str) or not nic.strip()):
            raise TopologyError(
                f"topology file {path}: {where}.{key}.nic must be a non-empty string"
            )
        if rail is not None and (isinstance(rail, bool) or not isinstance(rail, int) or rail < 0):
            raise TopologyError(
                f"topology file {path}: {where}.{key}.rail must be an int >= 0, got {rail!r}"
            )
        out[int(key)] = GpuLink(nic=nic.strip() if nic else None, rail=rail)
    return out


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file.

    Args:
        path: the TOML file.

    Returns:
        The parsed topology.

    Raises:
        TopologyError: naming the file and the key on any problem (missing file, bad TOML,
            wrong version, wrong types, unknown sections).
    """
    p = Path(path)
    data = _load_toml(p)
    version = data.get("version")
    if version != TOPOLOGY_VERSION:
        raise TopologyError(
            f"topology file {p}: 'version' must be {TOPOLOGY_VERSION}, got {version!r}"
        )
    unknown = set(data) - {"version", "racks", "gpus", "hosts"}
    if unknown:
        raise TopologyError(f"topology file {p}: unknown sections {sorted(unknown)}")
    racks_raw = data.get("racks", {})
    if not isinstance(racks_raw, dict):
        raise TopologyError(f"topology file {p}: [racks] must be a table of rack -> host list")
    racks = []
    for rack, hosts in racks_raw.items():
        if isinstance(hosts, str):
            hosts = [hosts]
        if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
            raise TopologyError(
                f"topology file {p}: racks.{rack} must be a list of host names or patterns"
            )
        racks.append((rack, tuple(hosts)))
    gpus = _gpu_map(p, "[gpus]", data.get("gpus", {}))
    hosts_raw = data.get("hosts", {})
    if not isinstance(hosts_raw, dict):
        raise TopologyError(f"topology file {p}: [hosts] must be a table of host -> settings")
    host_racks: dict[str, str] = {}
    host_gpus: dict[str, dict[int, GpuLink]] = {}
    for host, spec in hosts_raw.items():
        if not isinstance(spec, dict):
            raise TopologyError(f"topology file {p}: hosts.{host} must be a table")
        bad = set(spec) - {"rack", "gpus"}
        if bad:
            raise TopologyError(f"topology file {p}: hosts.{host} has unknown keys {sorted(bad)}")
        if "rack" in spec:
            if not isinstance(spec["rack"], str) or not spec["rack"]:
                raise TopologyError(f"topology file {p}: hosts.{host}.rack must be a string")
            host_racks[host] = spec["rack"]
        if "gpus" in spec:
            host_gpus[host] = _gpu_map(p, f"hosts.{host}.gpus", spec["gpus"])
    return Topology(
        path=str(p), racks=tuple(racks), gpus=gpus, host_racks=host_racks, host_gpus=host_gpus
    )
