"""Typed settings of the TUI, loaded from TOML.

One object, :class:`Settings`, with a nested section per concern. Every field has a
docstring; ``config/default.toml`` is the reference file listing each one with its default.

Discovery (first match wins, see :func:`find_config`):

1. the ``--config PATH`` flag;
2. the ``RANKSCOPE_CONFIG`` environment variable;
3. ``./rankscope.toml`` in the working directory;
4. ``rankscope/config.toml`` in the user config dir (``$XDG_CONFIG_HOME`` or ``~/.config``).

A file only needs the fields it changes. Unknown sections or keys, and values of the wrong
type, raise :class:`SettingsError` naming the file and the key, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import tomllib

METRICS = (
    "step",
    "compute",
    "lateness",
    "wait",
    "transfer",
    "input",
    "sm_clock",
    "power",
    "temperature",
)
"""Heatmap metrics, in the order the ``m`` key cycles through them."""

GROUP_BY = ("host", "rack", "rail", "gpu", "dp", "tp", "pp", "cp", "ep", "shard")
"""Dimensions the heatmap rows can be grouped by, in the order ``g`` cycles through them."""

COLOR_MODES = ("auto", "truecolor", "256", "16")


class SettingsError(ValueError):
    """A settings file or value is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class ViewSettings:
    """What the main screen shows when it opens."""

    metric: str = "lateness"
    """Initial heatmap metric, one of ``METRICS``. Lateness (how long after the first rank
    each rank entered its collectives) shows who holds the job up; the step time of a
    synchronous job is the same on every rank and shows when, not who."""
    group_by: str = "host"
    """Initial row grouping, one of ``GROUP_BY``."""
    window_steps: int = 120
    """Steps of history the view asks the store for (heatmap columns, statistics)."""
    max_cells: int = 1_048_576
    """Most rank × step cells one window may hold: a larger world gets fewer steps (at
    least 16), which keeps the view's memory bounded (a window is ~40 float64 arrays of
    that many cells)."""
    baseline_max_cells: int = 262_144
    """Most rank × step cells of the baseline run's window. The baseline is a reference —
    its step-time distribution, mean decomposition, work per step, message-size curves and
    manifest — which a few steps of every rank measure about as well as many, so it gets a
    quarter of ``max_cells``: 16 steps (~75 MiB) at 16,384 ranks next to the run's 64."""
    rank_rows_max: int = 64
    """Up to this many ranks each get their own heatmap row; above it, rows are groups
    showing their worst rank (zoom into a group with ``enter``)."""
    group_rows_max: int = 256
    """Up to this many host rows; above it, hosts roll up into their racks (where the
    ranks report racks), and ``enter`` on a rack shows its hosts."""
    pin_slowest: int = 4
    """How many ranks ``P`` pins: the slowest by mean busy time (step time minus the
    time spent waiting for other ranks) over the window."""
    last_arrivals: int = 6
    """Collective instances listed in the last-arriving ranks panel."""


@dataclass(frozen=True)
class RefreshSettings:
    """The sampling and rendering clocks."""

    sample_hz: float = 4.0
    """How often the view asks its source for the latest window."""
    diagnosis_s: float = 2.0
    """Seconds between two diagnosis passes (they run in a worker thread)."""
    stall_s: float = 10.0
    """No new step for this long while the run has ranks switches to the stall view."""


@dataclass(frozen=True)
class DisplaySettings:
    """Terminal appearance."""

    theme: str = "textual-dark"
    """Textual theme name."""
    color: str = "auto"
    """``auto`` follows the terminal; ``truecolor``, ``256`` or ``16`` force a palette."""
    show_clock: bool = True
    """Show the wall clock in the header (off in the test profile)."""
    show_machine: bool = True
    """Show this machine's host name in the header (off in the test profile)."""
    animation: bool = True
    """Textual animations and a blinking cursor (off in the test profile)."""


@dataclass(frozen=True)
class RerunSettings:
    """What a confirmed rerun may run (``rankscope rerun --yes``, ``y`` in the rerun menu)."""

    allow: tuple[str, ...] = ()
    """Training scripts a rerun may run when the program comes from telemetry (the parent
    run's manifest ``argv``, which anyone who reaches the hub can write): ``fnmatch``
    patterns on the path as recorded (``"train.py"``, ``"/shared/jobs/*.py"``). A script
    named with ``--script`` always runs; any other telemetry script is refused."""


@dataclass(frozen=True)
class StateSettings:
    """Where per-job view state (pins, metric, grouping, baseline) is kept."""

    persist: bool = True
    """Save pins and view settings per job and restore them on the next open."""
    dir: str = ""
    """Folder for the state files; empty means the user state dir
    (``$XDG_STATE_HOME/rankscope`` or ``~/.local/state/rankscope``)."""


@dataclass(frozen=True)
class HubSettings:
    """The hub that ``rankscope watch`` starts in-process."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ address the collectors push to (loopback; ``tcp://*:5555`` for every
    interface needs keys, ``rankscope keys``, or ``rankscope watch --insecure``)."""
    record_dir: str = ""
    """Folder to record into; empty records nothing."""


@dataclass(frozen=True)
class Settings:
    """Everything the TUI can be told. Build with :func:`load_settings` or construct
    directly (tests use :func:`deterministic_settings`)."""

    view: ViewSettings = field(default_factory=ViewSettings)
    """Initial view."""
    refresh: RefreshSettings = field(default_factory=RefreshSettings)
    """Clocks."""
    display: DisplaySettings = field(default_factory=DisplaySettings)
    """Appearance."""
    state: StateSettings = field(default_factory=StateSettings)
    """Persisted view state."""
    hub: HubSettings = field(default_factory=HubSettings)
    """In-process hub."""
    rerun: RerunSettings = field(default_factory=RerunSettings)
    """What reruns may run."""

    def state_dir(self) -> Path:
        """The folder where per-job view state lives."""
        if self.state.dir:
            return Path(self.state.dir).expanduser()
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "rankscope"


def _validate(settings: Settings, where: str) -> Settings:
    v = settings.view
    checks = [
        (v.metric in METRICS, "view.metric", f"{v.metric!r} is not one of {', '.join(METRICS)}"),
        (
            v.group_by in GROUP_BY,
            "view.group_by",
            f"{v.group_by!r} is not one of {', '.join(GROUP_BY)}",
        ),
        (v.window_steps >= 2, "view.window_steps", f"must be >= 2, got {v.window_steps}"),
        (v.rank_rows_max >= 1, "view.rank_rows_max", f"must be >= 1, got {v.rank_rows_max}"),
        (
            v.group_rows_max >= 1,
            "view.group_rows_max",
            f"must be >= 1, got {v.group_rows_max}",
        ),
        (v.max_cells >= 1024, "view.max_cells", f"must be >= 1024, got {v.max_cells}"),
        (
            v.baseline_max_cells >= 1024,
            "view.baseline_max_cells",
            f"must be >= 1024, got {v.baseline_max_cells}",
        ),
        (v.pin_slowest >= 1, "view.pin_slowest", f"must be >= 1, got {v.pin_slowest}"),
        (v.last_arrivals >= 1, "view.last_arrivals", f"must be >= 1, got {v.last_arrivals}"),
        (
            0 < settings.refresh.sample_hz <= 60,
            "refresh.sample_hz",
            f"must be in (0, 60], got {settings.refresh.sample_hz}",
        ),
        (
            settings.refresh.diagnosis_s > 0,
            "refresh.diagnosis_s",
            f"must be > 0, got {settings.refresh.diagnosis_s}",
        ),
        (
            settings.refresh.stall_s > 0,
            "refresh.stall_s",
            f"must be > 0, got {settings.refresh.stall_s}",
        ),
        (
            settings.display.color in COLOR_MODES,
            "display.color",
            f"{settings.display.color!r} is not one of {', '.join(COLOR_MODES)}",
        ),
    ]
    for ok, key, why in checks:
        if not ok:
            raise SettingsError(f"{where}: {key} {why}")
    return settings


def _section(cls: type, data: Mapping[str, Any], where: str, prefix: str) -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise SettingsError(f"{where}: unknown key '{prefix}{key}' (known: {sorted(names)})")
        typ = hints[key]
        if get_origin(typ) is tuple:  # tuple[str, ...]: a TOML array of strings
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SettingsError(f"{where}: {prefix}{key} must be a list of strings")
            kwargs[key] = tuple(value)
            continue
        if isinstance(typ, type) and dataclasses.is_dataclass(typ):
            if not isinstance(value, Mapping):
                raise SettingsError(f"{where}: [{prefix}{key}] must be a table")
            kwargs[key] = _section(typ, value, where, f"{prefix}{key}.")
            continue
        # TOML ints are fine where a float is expected; bools are never numbers here.
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
            raise SettingsError(
                f"{where}: {prefix}{key} must be {typ.__name__}, got {type(value).__name__}"
            )
        kwargs[key] = value
    return cls(**kwargs)


def settings_from_mapping(data: Mapping[str, Any], where: str = "<settings>") -> Settings:
    """Build validated settings from a parsed TOML mapping.

    Args:
        data: the mapping (sections as nested mappings); missing fields keep defaults.
        where: name used in error messages (usually the file path).

    Returns:
        The settings.

    Raises:
        SettingsError: on an unknown key, a wrong type or an out-of-range value.
    """
    return _validate(_section(Settings, data, where, ""), where)


def find_config(
    flag: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Path | None:
    """Find the settings file by the documented discovery order.

    Args:
        flag: value of ``--config``, if given (must exist).
        env: environment (defaults to ``os.environ``); ``RANKSCOPE_CONFIG`` must exist if set.
        cwd: working directory to look for ``rankscope.toml`` (defaults to the real one).

    Returns:
        The path to load, or None when no file is found (defaults apply).

    Raises:
        SettingsError: when the flag or the env variable names a missing file.
    """
    env = os.environ if env is None else env
    for origin, value in (("--config", flag), ("RANKSCOPE_CONFIG", env.get("RANKSCOPE_CONFIG"))):
        if value:
            path = Path(value).expanduser()
            if not path.is_file():
                raise SettingsError(f"{origin} names {path}, which is not a file")
            return path
    local = (cwd or Path.cwd()) / "rankscope.toml"
    if local.is_file():
        return local
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    user = Path(base) / "rankscope" / "config.toml"
    return user if user.is_file() else None


def load_settings(
    flag: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Settings:
    """Discover and load the settings (see :func:`find_config`).

    Args:
        flag: value of ``--config``.
        env: environment (defaults to ``os.environ``).
        cwd: working directory (defaults to the real one).

    Returns:
        The settings; defaults when no file is found.

    Raises:
        SettingsError: when the file cannot be read, is not TOML, or holds invalid values.
    """
    path = find_config(flag, env, cwd)
    if path is None:
        return Settings()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    return settings_from_mapping(data, str(path))


def deterministic_settings(state_dir: str | Path = "") -> Settings:
    """Settings for tests, snapshots and screenshots: no clock, no machine name, no
    animation, a fixed palette, nothing persisted outside ``state_dir``.

    Args:
        state_dir: folder for view-state files; empty disables persistence.

    Returns:
        Deterministic settings.
    """
    return Settings(
        display=DisplaySettings(
            color="truecolor", show_clock=False, show_machine=False, animation=False
        ),
        state=StateSettings(persist=bool(state_dir), dir=str(state_dir)),
    )
