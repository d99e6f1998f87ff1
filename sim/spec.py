"""Scenario files: what a simulated cluster is made of, read from ``config/scenarios/*.toml``.

A scenario names a topology, a parallel layout, a model, a workload, noise and at most one
fault. Any numeric value may be written as a range ``[lo, hi]``, any text value as a list of
choices, and any value as ``{choice = [a, b, ...]}``; the scenario's ``seed`` draws the
concrete value, so a diagnosis scored on many seeds cannot be tuned to one constant. Each
field has its own random stream (keyed by its name), so adding a range to one field never
changes what another field draws. ``base = "NAME"`` starts from another scenario file of the
same folder (its sections are merged key by key, the file's own keys winning); files whose
name starts with ``_`` are bases only and are not listed.

A minimal file::

    description = "One GPU throttles: slow compute, low SM clock, throttle flags"
    seed = 11

    [topology]
    hosts = 8

    [fault]
    mechanism = "slow_device"
    magnitude = [0.55, 0.8]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.sim.draw import ScenarioError, draw
from rankscope.sim.faults import MECHANISMS, FaultSpec, resolve_fault

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PACKERS = ("token_balanced", "attn_balanced")


@dataclass(frozen=True)
class TopologySpec:
    """Machines and links of the full cluster."""

    hosts: int = 8
    """Servers in the full cluster (derived from ``ranks`` when that is set)."""
    gpus_per_host: int = 8
    """GPUs per server; each GPU has its own NIC, and rail = that NIC's index."""
    ranks: int = 0
    """World size of the full cluster; 0 = ``hosts * gpus_per_host``. When set, the host
    count follows it, so a drawn host size keeps the world size (a world smaller than one
    host is one host of that many GPUs)."""
    hosts_per_rack: int = 4
    intra_gbps: float = 360.0
    """NVLink-class bus bandwidth inside a host, GB/s (= bytes/ns)."""
    nic_gbps: float = 45.0
    """Bandwidth of one NIC across hosts, GB/s (400 Gb/s class)."""
    alpha_intra_us: float = 4.0
    """Per-hop latency inside a host."""
    alpha_inter_us: float = 12.0
    """Per-hop latency across hosts."""
    gpu_model: str = "SIM-H100-80GB"
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU."""
    sm_clock_mhz: float = 1980.0
    mem_clock_mhz: float = 2619.0
    power_limit_w: float = 700.0
    hbm_gib: float = 80.0


@dataclass(frozen=True)
class LayoutSpec:
    """Parallel degrees; dp is what remains of the world size."""

    tp: int = 8
    """Tensor-parallel degree; ``"host"`` (also inside a choice) means ``gpus_per_host``, so
    a drawn host size keeps tensor parallelism on NVLink."""
    pp: int = 1
    ep: int = 1
    """Expert-parallel degree (MoE models): ``ep`` consecutive data-parallel ranks of one
    pipeline stage and tensor rank hold one copy of the experts and exchange tokens by
    all-to-all; 1 = no expert parallelism."""


@dataclass(frozen=True)
class ModelSpec:
    """The model, as far as step cost goes."""

    name: str = "sim-7b"
    params_b: float = 7.0
    """Parameters, billions."""
    layers: int = 24
    hidden: int = 4096
    grad_buckets: int = 8
    """Data-parallel gradient all-reduce buckets per step (DDP buckets)."""
    mfu: float = 0.45
    """Fraction of peak the kernels reach."""
    precision: str = "bf16"
    experts: int = 0
    """Routed experts per layer (a mixture-of-experts MLP); 0 = a dense MLP. With experts,
    ``params_b`` counts the parameters active per token."""


@dataclass(frozen=True)
class WorkloadSpec:
    """Batching, sequence lengths and the packer that assigns sequences to ranks."""

    micro_batch: int = 1
    """Packed rows per micro batch."""
    grad_accum: int = 2
    """Micro batches per step on each data-parallel rank."""
    seq_len: int = 8192
    """Row capacity in tokens; longer documents are cut to it."""
    packer: str = "attn_balanced"
    """``token_balanced`` (concatenate and cut rows: tokens equal, Σseq² not) or
    ``attn_balanced`` (assign documents to balance an attention-cost estimate too)."""
    length_median: float = 700.0
    """Median document length of the lognormal body."""
    length_sigma: float = 1.0
    tail_fraction: float = 0.05
    """Share of documents drawn from the Pareto tail."""
    tail_min: float = 2048.0
    tail_alpha: float = 1.2
    pad_fraction: float = 0.02
    """Executed padding tokens per valid token."""
    input_ms: float = 6.0
    """Healthy data-loader wait at the start of a step."""
    optimizer_ms: float = 35.0
    checkpoint_every: int = 0
    """Steps between checkpoints; 0 = none in the window."""
    checkpoint_s: float = 1.0
    host_gap_us: float = 0.0
    """Host time before each recorded phase, outside any phase (Python between forward and
    backward, loss, hooks, zero_grad)."""


@dataclass(frozen=True)
class NoiseSpec:
    """What makes a healthy cluster not perfectly flat."""

    static_sigma: float = 0.002
    """Per-GPU speed spread (silicon, cooling), fixed for the run."""
    step_sigma: float = 0.004
    """Per-rank, per-step speed variation."""
    chunk_sigma: float = 0.01
    """Per-kernel-span jitter."""
    hiccup_prob: float = 0.01
    """Chance per rank and step of an OS hiccup stalling one compute span."""
    hiccup_ms_min: float = 1.0
    hiccup_ms_max: float = 25.0
    transfer_sigma: float = 0.03
    """Spread of each collective's service time."""
    clock_error_us: float = 8.0
    """Residual clock-alignment error of each rank (constant per rank)."""
    warmup_steps: int = 0
    """Steps at the start that run slower on every rank (communicator set-up on the first
    collective of each group, allocator growth, compilation); 0 = none. A healthy feature:
    the truth lists it (``warmup_steps``) and keeps the mechanism."""
    warmup_factor: float = 3.0
    """Compute and host time of step 0 relative to steady state; the excess decays over the
    warm-up steps."""
    spike_prob: float = 0.0
    """Chance per rank and step of a heavy-tailed compute spike (a slow kernel: page
    faults, ECC retries, a memory-bandwidth neighbour)."""
    spike_ms: float = 5.0
    """Scale of a spike: ``spike_ms * (1 + Pareto(spike_alpha))``, cut at 100 x the scale."""
    spike_alpha: float = 1.5
    """Pareto shape of the spikes (smaller = heavier tail)."""


@dataclass(frozen=True)
class Scenario:
    """A resolved scenario: every range drawn, every target chosen."""

    name: str
    description: str
    seed: int
    job: str
    topology: TopologySpec
    layout: LayoutSpec
    model: ModelSpec
    workload: WorkloadSpec
    noise: NoiseSpec
    fault: FaultSpec
    source: str = ""
    """Path of the TOML file, empty when built in code."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The file's contents with overrides applied, before drawing (for the manifest)."""

    @property
    def world_size(self) -> int:
        return self.topology.hosts * self.topology.gpus_per_host

    @property
    def dp(self) -> int:
        return self.world_size // (self.layout.tp * self.layout.pp)


_SECTIONS: dict[str, type] = {
    "topology": TopologySpec,
    "layout": LayoutSpec,
    "model": ModelSpec,
    "workload": WorkloadSpec,
    "noise": NoiseSpec,
}
_TOP_KEYS = {"description", "seed", "job", "fault", "base", *_SECTIONS}


def scenario_dir() -> Path:
    """The folder of the shipped scenarios (``config/scenarios``)."""
    from rankscope.config import CONFIG_DIR

    return CONFIG_DIR / "scenarios"


def list_scenarios() -> list[tuple[str, str]]:
    """Shipped scenarios with their one-line descriptions.

    Returns:
        ``(name, description)`` pairs sorted by name.
    """
    out = []
    for path in sorted(scenario_dir().glob("*.toml")):
        if path.name.startswith("_"):
            continue
        try:
            desc = str(tomllib.loads(path.read_text()).get("description", ""))
        except tomllib.TOMLDecodeError as exc:
            desc = f"(unreadable: {exc})"
        out.append((path.stem, desc))
    return out


def _section(name: str, cls: type, table: Any, seed: int) -> Any:
    if not isinstance(table, dict):
        raise ScenarioError(f"[{name}] must be a table")
    defaults = cls()
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ScenarioError(f"[{name}] unknown key(s) {unknown}; known: {sorted(known)}")
    values = {}
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        values[f.name] = draw(f"{name}.{f.name}", table.get(f.name, default), default, seed)
    return cls(**values)


def _sized(topo: TopologySpec) -> TopologySpec:
    """Derive the host count from a world size (``topology.ranks``)."""
    n, gph = topo.ranks, topo.gpus_per_host
    if n == 0:
        return topo
    if n < 0 or gph < 1:
        raise ScenarioError(f"topology.ranks must be >= 0, got {n}")
    if n < gph:
        return dataclasses.replace(topo, gpus_per_host=n, hosts=1)
    if n % gph:
        raise ScenarioError(f"ranks={n} is not a multiple of gpus_per_host={gph}")
    return dataclasses.replace(topo, hosts=n // gph)


def _host_sized(value: Any, topo: TopologySpec) -> Any:
    """``"host"`` in a tensor-parallel degree (alone or among choices) is the host's size."""
    if value == "host":
        return topo.gpus_per_host
    if isinstance(value, list):
        return [_host_sized(v, topo) for v in value]
    if isinstance(value, dict) and isinstance(value.get("choice"), list):
        return {**value, "choice": [_host_sized(v, topo) for v in value["choice"]]}
    return value


def _read(path: Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Parse a scenario file and merge it over its ``base``."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or base in seen:
        raise ScenarioError(f"{path}: base must name another scenario file, got {base!r}")
    merged = _read(path.parent / f"{base}.toml", (*seen, base))
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    ranks = overrides.get("ranks")
    for key, value in overrides.items():
        if value is None or key == "ranks":
            continue
        if key == "fault":
            # the scenario's twin with another fault (or none): same seed, same draws
            if value not in MECHANISMS:
                raise ScenarioError(f"fault override {value!r} is not one of {list(MECHANISMS)}")
            raw["fault"] = {"mechanism": value}
            continue
        section, _, name = key.partition("__")
        if not name:
            if section not in ("seed", "description", "job"):
                raise ScenarioError(f"unknown override {key!r}; use seed, ranks or section__key")
            raw[section] = value
            continue
        if section not in _SECTIONS and section != "fault":
            raise ScenarioError(f"unknown override section {section!r} in {key!r}")
        raw.setdefault(section, {})[name] = value
    if ranks is not None:
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ScenarioError(f"ranks must be a positive int, got {ranks!r}")
        raw.setdefault("topology", {})["ranks"] = ranks
    return raw


def build_scenario(raw: dict[str, Any], name: str = "custom", source: str = "") -> Scenario:
    """Resolve a scenario from its TOML contents.

    Args:
        raw: the parsed file (``description``, ``seed``, sections, ``[fault]``).
        name: scenario name (the file's stem).
        source: where it came from, for error messages and the manifest.

    Returns:
        The resolved scenario.

    Raises:
        ScenarioError: naming the file and key that is wrong.
    """
    where = source or name
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ScenarioError(f"{where}: seed must be a non-negative int, got {seed!r}")
    try:
        parts: dict[str, Any] = {}
        for k, cls in _SECTIONS.items():
            table = raw.get(k, {})
            if k == "layout" and isinstance(table, dict) and "tp" in table:
                table = {**table, "tp": _host_sized(table["tp"], parts["topology"])}
            parts[k] = _section(k, cls, table, seed)
            if k == "topology":
                parts[k] = _sized(parts[k])
        fault = resolve_fault(raw.get("fault"), parts["topology"], seed, parts["layout"])
    except ScenarioError as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    topo, layout, wl = parts["topology"], parts["layout"], parts["workload"]
    problems = []
    if topo.hosts < 1 or topo.gpus_per_host < 1 or topo.hosts_per_rack < 1:
        problems.append("topology.hosts, gpus_per_host and hosts_per_rack must be >= 1")
    model = parts["model"]
    if layout.tp < 1 or layout.pp < 1 or layout.ep < 1:
        problems.append("layout.tp, layout.pp and layout.ep must be >= 1")
    elif (topo.hosts * topo.gpus_per_host) % (layout.tp * layout.pp):
        problems.append(
            f"world size {topo.hosts * topo.gpus_per_host} is not divisible by "
            f"tp*pp = {layout.tp * layout.pp}"
        )
    if layout.pp > parts["model"].layers:
        problems.append(f"layout.pp={layout.pp} exceeds model.layers={parts['model'].layers}")
    if wl.packer not in PACKERS:
        problems.append(f"workload.packer {wl.packer!r} is not one of {list(PACKERS)}")
    if wl.micro_batch < 1 or wl.grad_accum < 1 or wl.seq_len < 16:
        problems.append("workload.micro_batch, grad_accum >= 1 and seq_len >= 16")
    if parts["model"].grad_buckets < 1:
        problems.append("model.grad_buckets must be >= 1")
    if layout.ep > 1 and layout.tp >= 1 and layout.pp >= 1:
        dp = (topo.hosts * topo.gpus_per_host) // (layout.tp * layout.pp)
        if model.experts < layout.ep or model.experts % layout.ep:
            problems.append(f"layout.ep={layout.ep} needs model.experts a multiple of it")
        elif dp % layout.ep:
            problems.append(f"layout.ep={layout.ep} does not divide dp={dp}")
    if model.experts < 0:
        problems.append("model.experts must be >= 0")
    if parts["noise"].warmup_steps < 0 or parts["noise"].warmup_factor < 1.0:
        problems.append("noise.warmup_steps must be >= 0 and noise.warmup_factor >= 1")
    if not 0.0 <= parts["noise"].spike_prob <= 1.0 or parts["noise"].spike_alpha <= 0:
        problems.append("noise.spike_prob must be in [0, 1] and noise.spike_alpha > 0")
    if problems:
        raise ScenarioError(f"{where}: " + "; ".join(problems))
    return Scenario(
        name=name,
        description=str(raw.get("description", "")),
        seed=seed,
        job=str(raw.get("job", f"sim-{name}")),
        fault=fault,
        source=source,
        raw=raw,
        **parts,
    )


def load_scenario(name_or_path: str | Path, **overrides: Any) -> Scenario:
    """Load a shipped scenario by name, or any scenario file by path.

    Args:
        name_or_path: a name from `list_scenarios`, a path to a ``.toml`` file, or a
            ``.json`` spec written by `write_spec` (a parent run's exact scenario).
        **overrides: ``seed=``, ``ranks=`` (the world size: sets ``topology.ranks``, so
            the host count follows the drawn host size), ``job=``,
            ``fault="healthy"`` (the same scenario and draws with another mechanism and its
            default parameters: the healthy twin), or ``section__key=value`` (e.g.
            ``workload__packer="token_balanced"``, ``fault__host=2``); ``None`` values are
            ignored.

    Returns:
        The resolved scenario.

    Raises:
        ScenarioError: unknown scenario, unreadable file, or a bad key or value.
    """
    path = Path(name_or_path)
    if path.suffix == ".json":
        name, raw = read_spec(path)
        return build_scenario(_apply_overrides(raw, overrides), name=name, source=str(path))
    if path.suffix != ".toml":
        path = scenario_dir() / f"{name_or_path}.toml"
        if not path.exists():
            names = ", ".join(n for n, _ in list_scenarios())
            raise ScenarioError(f"no scenario named {str(name_or_path)!r}; shipped: {names}")
    raw = _read(path)
    return build_scenario(_apply_overrides(raw, overrides), name=path.stem, source=str(path))


def write_spec(path: str | Path, name: str, raw: Mapping[str, Any]) -> Path:
    """Save a resolved scenario's contents (``Scenario.raw``, as a run's manifest records it
    under ``sim.spec``) so that `load_scenario` rebuilds exactly that scenario, overrides
    and all, whatever happens to the file it came from.

    Args:
        path: the ``.json`` file to write.
        name: the scenario's name.
        raw: its contents, overrides applied.

    Returns:
        The path written.
    """
    out = Path(path)
    out.write_text(json.dumps({"scenario": name, "spec": dict(raw)}, indent=1, sort_keys=True))
    return out


def read_spec(path: str | Path) -> tuple[str, dict[str, Any]]:
    """Read a file written by `write_spec`.

    Args:
        path: the ``.json`` file.

    Returns:
        ``(name, raw)``.

    Raises:
        ScenarioError: the file is missing or not such a spec.
    """
    try:
        obj = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario spec {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path}: not valid JSON: {exc}") from None
    if not (
        isinstance(obj, dict)
        and isinstance(obj.get("scenario"), str)
        and isinstance(obj.get("spec"), dict)
    ):
        raise ScenarioError(f"{path}: expected {{'scenario': name, 'spec': {{...}}}}")
    return obj["scenario"], obj["spec"]


def healthy_twin(scenario: Scenario) -> Scenario:
    """The same scenario without its fault: same seed, same draws, same cluster. A
    healthy baseline for the incident, as ``load_scenario(..., fault="healthy")`` gives.

    Args:
        scenario: a resolved scenario.

    Returns:
        The twin (the scenario itself when it is already healthy).
    """
    if scenario.fault.mechanism == "healthy":
        return scenario
    raw = _apply_overrides(scenario.raw, {"fault": "healthy"})
    return build_scenario(raw, name=scenario.name, source=scenario.source)
