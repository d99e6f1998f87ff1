"""Launcher templates: TOML files that turn a rerun plan into the exact commands to run.

A template names the workload command once and says how to start it here, on another
host, or through a scheduler. Shipped templates live in ``config/launchers/``; users add
their own in ``$XDG_CONFIG_HOME/rankscope/launchers/`` (``~/.config/...``) or a folder given
with ``--launchers DIR``. A later folder overrides an earlier one by file name.

Keys of a template (all optional except ``command``)::

    description = "one line shown in menus"
    per_host = false        # true: one command per host of the plan ({host}, {node_rank})
    command = [...]         # the workload, one token per element
    argv = ["{command}"]    # how to start it on this machine (default: the command itself)
    remote_argv = [...]     # how to start it on another host, e.g. ssh; absent = refuse
    [env]                   # variables for the launched process
    NAME = "{placeholder}"
    [optional_env]          # the same, left out when one of its placeholders is unset
    CUDA_VISIBLE_DEVICES = "{gpus}"
    [defaults]              # values for placeholders the plan leaves open
    master_port = 29500

Placeholders are ``{name}`` with a name from `PLACEHOLDERS`. A list-valued placeholder
(``{script_args}``) must be a whole token and expands to several tokens. ``{command}``
(whole token) expands to the rendered command; ``{command_shell}`` is the command with its
environment as one shell-quoted string, for ``ssh`` and ``sbatch --wrap``. Every value is
validated for its field before substitution (`rankscope.launch.safety`).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from rankscope.launch.safety import (
    UnsafeValueError,
    check_argv,
    check_env,
    check_value,
    shell_join,
)

__all__ = [
    "PLACEHOLDERS",
    "Command",
    "LauncherTemplate",
    "TemplateError",
    "find_launcher",
    "is_local_host",
    "launcher_dirs",
    "list_launchers",
    "load_template",
    "render",
]

PLACEHOLDERS: dict[str, tuple[str, str]] = {
    # name: (value kind for rankscope.launch.safety, what it is)
    "python": ("path", "the Python interpreter running rankscope"),
    "hub": ("endpoint", "hub endpoint the rerun reports to (tcp://host:port)"),
    "job": ("name", "job name, shared by the parent run and its reruns"),
    "run": ("name", "id of the new (child) run"),
    "parent_run": ("name", "id of the run being reduced"),
    "scope": ("scope", "full, two-node, one-node, one-rank or custom"),
    "hosts": ("list", "comma-separated hosts of the rerun, suspect first"),
    "host": ("host", "the host of this command (per_host templates)"),
    "node_rank": ("int", "node rank of {host} (per_host templates)"),
    "nnodes": ("int", "number of hosts"),
    "nproc_per_node": ("int", "processes per host"),
    "world_size": ("int", "ranks in the rerun"),
    "parent_world_size": ("int", "ranks in the parent run"),
    "ranks": ("list", "parent-run global ranks the rerun keeps, comma-separated"),
    "gpus": ("list", "GPU indices to use on each host, comma-separated (CUDA_VISIBLE_DEVICES)"),
    "master_addr": ("host", "rendezvous host (the first host)"),
    "master_port": ("port", "rendezvous port"),
    "script": ("path", "training script"),
    "script_args": ("arg", "the training script's arguments (list, whole token)"),
    "micro_batch": ("int", "per-rank micro batch (preserved)"),
    "grad_accum": ("int", "gradient accumulation steps"),
    "global_batch": ("int", "global batch of the rerun"),
    "scenario": (
        "path",
        "simulated scenario: a name, or the parent's exact spec saved beside the log",
    ),
    "seed": ("int", "random seed (the simulated launcher)"),
    "steps": ("int", "steps to run"),
    "record": ("path", "recording folder of the parent run"),
    "log": ("path", "log file of the rerun"),
}
"""Every placeholder a template may use, with its validation kind and meaning."""

LIST_PLACEHOLDERS = frozenset({"script_args"})
DERIVED = frozenset({"command", "command_shell"})
_TOKEN = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_KEYS = {
    "description",
    "per_host",
    "command",
    "argv",
    "remote_argv",
    "env",
    "optional_env",
    "defaults",
}


class TemplateError(ValueError):
    """A launcher template is malformed or cannot be rendered for a plan."""


@dataclass(frozen=True)
class LauncherTemplate:
    """A parsed launcher template."""

    name: str
    """File name without ``.toml``."""
    path: Path
    description: str
    per_host: bool
    command: tuple[str, ...]
    argv: tuple[str, ...]
    remote_argv: tuple[str, ...] | None
    env: dict[str, str]
    optional_env: dict[str, str]
    defaults: dict[str, Any]


@dataclass(frozen=True)
class Command:
    """One process to start, exactly as it will run."""

    argv: tuple[str, ...]
    """Run without a shell."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the launcher's environment."""
    host: str | None = None
    """Where the workload runs; None for this machine or a scheduler's choice."""

    @property
    def display(self) -> str:
        """The command as one shell-quoted line with its environment, for showing a plan."""
        return shell_join(self.argv, self.env)


def launcher_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """The template search path, lowest priority first.

    Args:
        extra: folders given on the command line (``--launchers DIR``).

    Returns:
        Shipped ``config/launchers``, the user's ``rankscope/launchers`` config folder, then
        ``extra`` — whether or not they exist.
    """
    from rankscope.config import CONFIG_DIR

    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return [CONFIG_DIR / "launchers", Path(base) / "rankscope" / "launchers"] + [
        Path(p) for p in extra
    ]


def list_launchers(extra: Iterable[str | Path] = ()) -> dict[str, Path]:
    """Available templates by name; a later folder of `launcher_dirs` wins.

    Args:
        extra: extra folders (``--launchers DIR``).

    Returns:
        name -> template file, sorted by name.
    """
    found: dict[str, Path] = {}
    for folder in launcher_dirs(extra):
        if folder.is_dir():
            for path in sorted(folder.glob("*.toml")):
                found[path.stem] = path
    return dict(sorted(found.items()))


def find_launcher(name: str, extra: Iterable[str | Path] = ()) -> LauncherTemplate:
    """Load the template called ``name`` from the search path.

    Args:
        name: template name (file name without ``.toml``).
        extra: extra folders (``--launchers DIR``).

    Returns:
        The parsed template.

    Raises:
        TemplateError: when no template has that name (the error lists those that exist).
    """
    check_value("launcher", name, "name")
    found = list_launchers(extra)
    if name not in found:
        known = ", ".join(found) or "none"
        raise TemplateError(f"no launcher template {name!r} (available: {known})")
    return load_template(found[name])


def _str_list(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TemplateError(f"{where} must be a list of strings")
    return tuple(value)


def _check_placeholders(where: str, tokens: Iterable[str], allowed: set[str]) -> None:
    for tok in tokens:
        for name in _TOKEN.findall(tok):
            if name not in allowed:
                raise TemplateError(f"{where}: unknown placeholder {{{name}}}")
            if (name in LIST_PLACEHOLDERS or name == "command") and tok != f"{{{name}}}":
                raise TemplateError(f"{where}: {{{name}}} expands to several tokens; use it alone")


def _env_table(path: Path, data: dict[str, Any], key: str) -> dict[str, str]:
    env = data.get(key, {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise TemplateError(f"{path}: [{key}] must map names to strings")
    try:
        check_env({k: "" for k in env})
    except UnsafeValueError as exc:
        raise TemplateError(f"{path}: [{key}] {exc}") from None
    return dict(env)


def load_template(path: str | Path) -> LauncherTemplate:
    """Parse and check one template file.

    Args:
        path: the ``.toml`` file.

    Returns:
        The template.

    Raises:
        TemplateError: naming the file and what is wrong (unknown key or placeholder,
            wrong type, bad TOML).
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TemplateError(f"{path}: {exc}") from None
    unknown = set(data) - _KEYS
    if unknown:
        raise TemplateError(f"{path}: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
    if "command" not in data:
        raise TemplateError(f"{path}: a template needs a 'command' list")
    command = _str_list(f"{path}: command", data["command"])
    if not command:
        raise TemplateError(f"{path}: command is empty")
    argv = _str_list(f"{path}: argv", data.get("argv", ["{command}"]))
    remote = data.get("remote_argv")
    remote_argv = _str_list(f"{path}: remote_argv", remote) if remote is not None else None
    env = _env_table(path, data, "env")
    optional_env = _env_table(path, data, "optional_env")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise TemplateError(f"{path}: [defaults] must be a table")
    for key, value in defaults.items():
        if key not in PLACEHOLDERS:
            raise TemplateError(f"{path}: [defaults] has unknown placeholder {key!r}")
        if not isinstance(value, (str, int, list)) or isinstance(value, bool):
            raise TemplateError(f"{path}: [defaults].{key} must be a string, integer or list")
    per_host = data.get("per_host", False)
    if not isinstance(per_host, bool):
        raise TemplateError(f"{path}: per_host must be true or false")
    names = set(PLACEHOLDERS)
    _check_placeholders(f"{path}: command", command, names)
    _check_placeholders(f"{path}: env", env.values(), names - LIST_PLACEHOLDERS)
    _check_placeholders(f"{path}: optional_env", optional_env.values(), names - LIST_PLACEHOLDERS)
    _check_placeholders(f"{path}: argv", argv, names | DERIVED)
    if remote_argv is not None:
        _check_placeholders(f"{path}: remote_argv", remote_argv, names | DERIVED)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise TemplateError(f"{path}: description must be a string")
    return LauncherTemplate(
        name=path.stem,
        path=path,
        description=description,
        per_host=per_host,
        command=command,
        argv=argv,
        remote_argv=remote_argv,
        env=env,
        optional_env=optional_env,
        defaults=dict(defaults),
    )


def _validated(values: Mapping[str, Any]) -> dict[str, str | tuple[str, ...]]:
    out: dict[str, str | tuple[str, ...]] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in PLACEHOLDERS:
            raise TemplateError(f"unknown placeholder value {name!r}")
        kind = PLACEHOLDERS[name][0]
        if name in LIST_PLACEHOLDERS:
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise UnsafeValueError(name, value, "expected a list of arguments")
            out[name] = tuple(check_value(f"{name}[{i}]", v, kind) for i, v in enumerate(value))
        else:
            out[name] = check_value(name, value, kind)
    return out


def _subst(tpl: LauncherTemplate, tokens: Sequence[str], values: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for tok in tokens:
        whole = _TOKEN.fullmatch(tok)
        if whole and isinstance(values.get(whole.group(1)), tuple):
            out.extend(values[whole.group(1)])
            continue

        def one(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in values:
                what = PLACEHOLDERS.get(name, ("", name))[1]
                raise TemplateError(
                    f"launcher {tpl.name!r} needs {{{name}}} ({what}), which the plan does not set"
                )
            return str(values[name])

        out.append(_TOKEN.sub(one, tok))
    return out


def is_local_host(host: str) -> bool:
    """Whether a host name means this machine (localhost, 127.0.0.1 or its own name)."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
    return host in names


def render(
    template: LauncherTemplate,
    values: Mapping[str, Any],
    hosts: Sequence[str],
    *,
    local: Iterable[str] | None = None,
) -> tuple[Command, ...]:
    """Render a template into the commands that start a rerun.

    Args:
        template: the launcher template.
        values: placeholder values (``PLACEHOLDERS`` names; None = unset). Each is validated
            for its field first; ``host`` and ``node_rank`` are filled per host.
        hosts: the rerun's hosts, in node-rank order.
        local: host names that mean this machine (default: localhost and this host name).

    Returns:
        One command for the whole rerun, or one per host for ``per_host`` templates.

    Raises:
        UnsafeValueError: a value does not match its field's pattern.
        TemplateError: the template needs a value the plan does not have, or must reach a
            remote host but has no ``remote_argv``.
    """
    is_local = (lambda h: h in set(local)) if local is not None else is_local_host
    merged: dict[str, Any] = {name: () for name in LIST_PLACEHOLDERS}
    merged.update(template.defaults)
    merged.update({k: v for k, v in values.items() if v is not None})
    checked_hosts = [check_value("host", h, "host") for h in hosts]
    targets: list[tuple[str | None, int | None]] = [(None, None)]
    if template.per_host:
        targets = [(h, i) for i, h in enumerate(checked_hosts)]
    commands = []
    for host, node_rank in targets:
        vals = dict(merged)
        if host is not None:
            vals.update(host=host, node_rank=node_rank)
        vals_ok = _validated(vals)
        command = _subst(template, template.command, vals_ok)
        env_raw = {k: "".join(_subst(template, [v], vals_ok)) for k, v in template.env.items()}
        for k, v in template.optional_env.items():
            if all(name in vals_ok for name in _TOKEN.findall(v)):
                env_raw[k] = "".join(_subst(template, [v], vals_ok))
        env = check_env(env_raw)
        derived: dict[str, Any] = dict(vals_ok)
        derived["command"] = tuple(command)
        derived["command_shell"] = shell_join(command, env)
        remote = host is not None and not is_local(host)
        if remote and template.remote_argv is None:
            raise TemplateError(
                f"launcher {template.name!r} runs only on this machine, but the plan needs host "
                f"{host!r}; use a template with remote_argv (e.g. ssh) or a scheduler"
            )
        spec = template.remote_argv if remote and template.remote_argv else template.argv
        argv = check_argv(_subst(template, spec, derived))
        # Over ssh the environment travels inside {command_shell}; the local ssh needs none.
        commands.append(Command(argv=argv, env={} if remote else env, host=host))
    return tuple(commands)
