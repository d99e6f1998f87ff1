"""Launching a rerun plan: placeholder values, rendered commands, a process group per
command, output captured to a log beside the recording, cancellation.

The launched workload reports to the same hub as a new run: the templates hand it the
hub endpoint, the new run id, the parent run and the scope (``RANKSCOPE_HUB``,
``RANKSCOPE_RUN``, ``RANKSCOPE_PARENT_RUN``, ``RANKSCOPE_SCOPE`` for ``rankscope run``;
arguments for the simulated cluster). Nothing runs through a shell.

Where the program comes from (`Launch.sources`): unless ``--script`` / ``--script-arg``
name them, the training script and its arguments are the parent's ``argv`` as its ranks
reported it in the manifest, and the hosts are the host names the ranks reported — all
telemetry, which anyone who can reach the hub can write. The plan says so for every part,
and `program_check` decides whether a confirmed launch may run a program telemetry chose:
only one that the user named (``--script``) or that the rerun allow-list holds
(``[rerun] allow`` in the settings file, `rankscope.tui.settings.RerunSettings`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from rankscope.launch.plan import RerunPlan
from rankscope.launch.templates import (
    Command,
    LauncherTemplate,
    is_local_host,
    render,
)

__all__ = [
    "TELEMETRY",
    "Launch",
    "LaunchSettings",
    "RunningRerun",
    "launch_sources",
    "prepare",
    "program_check",
    "reruns_dir",
    "script_from_manifest",
    "start",
]


@dataclass(frozen=True)
class LaunchSettings:
    """What a launch needs beyond the plan."""

    hub: str
    """Endpoint the rerun reports to (the parent's hub)."""
    python: str = sys.executable
    script: str | None = None
    """Training script; default: the parent run's (`script_from_manifest`)."""
    script_args: tuple[str, ...] | None = None
    """Its arguments; default: the parent run's when ``script`` is unset or the parent's
    own script, else none."""
    master_port: int | None = None
    scenario: str | None = None
    seed: int | None = None
    steps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Further placeholder values (names of ``templates.PLACEHOLDERS``)."""


@dataclass(frozen=True)
class Launch:
    """A plan with its exact commands: everything that is shown before confirmation."""

    plan: RerunPlan
    launcher: str
    commands: tuple[Command, ...]
    log: Path
    values: dict[str, Any]
    """Placeholder values used (validated)."""
    warnings: tuple[str, ...] = ()
    """What may keep the rerun from reporting or starting as planned."""
    scenario_spec: tuple[Path, str, dict[str, Any]] | None = None
    """``(file, name, spec)``: the simulated parent's scenario as it ran, which the command
    names and `start` writes (preparing a launch writes nothing)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each part of what runs comes from: ``script``, ``args``, ``hosts`` (and
    ``scenario`` for a simulated parent) -> `TELEMETRY`, ``--script``, ``--script-arg``,
    ``template`` (the launcher template's own program, no script) or ``none``."""

    @property
    def telemetry_script(self) -> str | None:
        """The script the commands run when telemetry chose it (the parent's manifest
        ``argv``), else None."""
        if self.sources.get("script") != TELEMETRY:
            return None
        script = self.values.get("script")
        return script if isinstance(script, str) else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``rerun --json``, the launch record beside the log)."""
        plan = asdict(self.plan)
        plan["nnodes"] = self.plan.nnodes
        return {
            "plan": plan,
            "launcher": self.launcher,
            "log": str(self.log),
            "warnings": list(self.warnings),
            "sources": dict(self.sources),
            "commands": [
                {"argv": list(c.argv), "env": dict(c.env), "host": c.host, "display": c.display}
                for c in self.commands
            ],
        }


TELEMETRY = "telemetry"
"""`Launch.sources` value of a part taken from what the parent's ranks reported."""


def launch_sources(
    template: LauncherTemplate, settings: LaunchSettings, manifest: Mapping[str, Any] | None
) -> dict[str, str]:
    """Where each part of what a launch runs comes from (`Launch.sources`; `plan_values`
    chooses the values the same way).

    Args:
        template: the launcher template (does it run a ``{script}``, a ``{scenario}``?).
        settings: the user's overrides (``script``, ``script_args``, ``scenario``).
        manifest: the parent run's manifest.

    Returns:
        Part -> origin: ``script``, ``args``, ``hosts``, ``scenario`` where used.
    """
    text = " ".join((*template.command, *template.argv))
    recorded, recorded_args = script_from_manifest(manifest or {})
    out: dict[str, str] = {}
    if "{script}" in text:
        if settings.script is not None:
            out["script"] = "--script"
        else:
            out["script"] = TELEMETRY if recorded else "none"
        if settings.script_args is not None:
            out["args"] = "--script-arg"
        elif settings.script is not None and settings.script != recorded:
            out["args"] = "none"  # another script than the parent's: none of its arguments
        else:
            out["args"] = TELEMETRY if recorded_args else "none"
    else:
        out["script"] = "template"
    if "{scenario}" in text:
        out["scenario"] = "--scenario" if settings.scenario is not None else TELEMETRY
    out["hosts"] = TELEMETRY
    return out


def program_check(launch: Launch, allow: Sequence[str] = (), *, cli: bool = True) -> str | None:
    """Whether a confirmed launch may run the program it names.

    A program the user named (``--script``) or the template's own runs. A script taken
    from telemetry (the parent's manifest ``argv``) runs only when a pattern of ``allow``
    matches it (``fnmatch``, on the path as recorded: ``train.py``,
    ``/shared/jobs/*.py``).

    Args:
        launch: the prepared launch.
        allow: the rerun allow-list (``[rerun] allow`` of the settings).
        cli: the refusal also says that ``--script`` confirms it (the command line's way).

    Returns:
        None when it may run; else one line saying why not and how to allow it.
    """
    from fnmatch import fnmatchcase

    script = launch.telemetry_script
    if script is None or any(fnmatchcase(script, pat) for pat in allow):
        return None
    from rankscope.sanitize import for_terminal

    shown = for_terminal(repr(script))
    confirm = f"pass --script {shown} to confirm it, or " if cli else ""
    return (
        f"refusing to run {shown}: the script comes from the recorded manifest (telemetry), "
        f"not from you; {confirm}add it to [rerun] allow in the rankscope settings file "
        "(RANKSCOPE_CONFIG, ./rankscope.toml or ~/.config/rankscope/config.toml)"
    )


def reruns_dir(record: str | Path) -> Path:
    """Where rerun logs and launch records of a recording live: ``<record>/reruns``."""
    return Path(record) / "reruns"


def script_from_manifest(manifest: Mapping[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """The training script and its arguments as the parent's ranks reported them.

    These strings come from telemetry: they are validated like every other value when the
    template is rendered, so a hostile ``argv`` is refused, not run.

    Args:
        manifest: the parent run's manifest (``argv`` is the rank's ``sys.argv``).

    Returns:
        ``(script, args)``; ``(None, ())`` when the manifest has no argv.
    """
    argv = manifest.get("argv")
    if not isinstance(argv, Sequence) or isinstance(argv, str) or not argv:
        return None, ()
    return str(argv[0]), tuple(str(a) for a in argv[1:])


def _unique_run(plan: RerunPlan, folder: Path) -> RerunPlan:
    # A second rerun of the same parent at the same scope gets -2, -3... so logs never mix.
    run, n = plan.run, 1
    while (folder / f"{run}.log").exists() or (folder / f"{run}.json").exists():
        n += 1
        run = f"{plan.run}-{n}"
    return replace(plan, run=run)


def plan_values(
    plan: RerunPlan,
    settings: LaunchSettings,
    *,
    manifest: Mapping[str, Any] | None = None,
    log: Path | None = None,
    record: Path | None = None,
    local: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Placeholder values for a plan (not yet validated: `render` does that).

    Args:
        plan: the rerun plan.
        settings: hub, python, script overrides...
        manifest: the parent run's manifest, for the default script and arguments.
        log: the rerun's log file.
        record: the recording folder.
        local: host names that mean this machine (default: localhost and this host).

    Returns:
        Name -> value for ``templates.PLACEHOLDERS``.
    """
    script, args = script_from_manifest(manifest or {})
    if settings.script is not None:
        # Naming the parent's own script confirms it and keeps its recorded arguments;
        # another script starts without them.
        if settings.script != script:
            args = ()
        script = settings.script
    if settings.script_args is not None:
        args = settings.script_args
    sim = (manifest or {}).get("sim")
    sim = sim if isinstance(sim, Mapping) else {}
    names = set(local) if local is not None else None
    all_local = all((h in names) if names is not None else is_local_host(h) for h in plan.hosts)
    values: dict[str, Any] = {
        "python": settings.python,
        "hub": settings.hub,
        "job": plan.job,
        "run": plan.run,
        "parent_run": plan.parent_run,
        "scope": plan.scope,
        "hosts": ",".join(plan.hosts),
        "nnodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node,
        "world_size": plan.world_size,
        "parent_world_size": plan.parent_world_size,
        "ranks": ",".join(map(str, plan.ranks)),
        "gpus": ",".join(map(str, plan.gpus)) if plan.gpus else None,
        # On one machine the loopback address always resolves; a host name may not.
        "master_addr": "127.0.0.1" if all_local else plan.hosts[0],
        "master_port": settings.master_port,
        "script": script,
        "script_args": list(args),
        # A simulated parent names its scenario and seed in the manifest.
        "scenario": settings.scenario if settings.scenario is not None else sim.get("scenario"),
        "seed": settings.seed if settings.seed is not None else sim.get("seed"),
        "steps": settings.steps,
        "record": str(record) if record is not None else None,
        "log": str(log) if log is not None else None,
    }
    values.update(plan.batch)
    values.update(settings.extra)
    return values


def prepare(
    plan: RerunPlan,
    template: LauncherTemplate,
    settings: LaunchSettings,
    *,
    record: str | Path,
    manifest: Mapping[str, Any] | None = None,
    local: Iterable[str] | None = None,
) -> Launch:
    """Render a plan through a launcher template; nothing runs yet.

    Args:
        plan: the rerun plan.
        template: the launcher template.
        settings: hub endpoint and overrides.
        record: the parent's recording folder; the log goes to ``<record>/reruns/<run>.log``.
        manifest: the parent run's manifest (default script and arguments).
        local: host names that mean this machine.

    Returns:
        The launch, with every value validated. Nothing is written: `start` writes what
        the commands need (the log, the launch record, a simulated parent's scenario).

    Raises:
        UnsafeValueError: a value (host, job, path, argument...) fails its pattern.
        TemplateError: the template needs something the plan does not provide.
    """
    folder = reruns_dir(record)
    plan = _unique_run(plan, folder)
    log = folder / f"{plan.run}.log"
    values = plan_values(
        plan, settings, manifest=manifest, log=log, record=Path(record), local=local
    )
    spec = _sim_spec(manifest)
    scenario_spec = None
    if spec is not None and settings.scenario is None:
        # The parent's scenario as it ran (overrides included), not the file's name.
        name, raw = spec
        scenario_spec = (folder / f"{plan.run}.scenario.json", name, raw)
        values["scenario"] = str(scenario_spec[0])
    commands = render(template, values, plan.hosts, local=local)
    return Launch(
        plan=plan,
        launcher=template.name,
        commands=commands,
        log=log,
        values=values,
        warnings=_launch_warnings(commands, values, local),
        scenario_spec=scenario_spec,
        sources=launch_sources(template, settings, manifest),
    )


def _sim_spec(manifest: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    sim = (manifest or {}).get("sim")
    if not isinstance(sim, Mapping):
        return None
    name, raw = sim.get("scenario"), sim.get("spec")
    if isinstance(name, str) and isinstance(raw, dict):
        return name, raw
    return None


_LOOPBACK = ("127.", "localhost", "[::1]")


def _launch_warnings(
    commands: Sequence[Command], values: Mapping[str, Any], local: Iterable[str] | None
) -> tuple[str, ...]:
    out = []
    hub = str(values.get("hub") or "")
    where = hub.partition("://")[2]
    names = set(local) if local is not None else None

    def is_local(host: str) -> bool:
        return host in names if names is not None else is_local_host(host)

    remote = [c.host for c in commands if c.host is not None and not is_local(c.host)]
    if remote and where.startswith(_LOOPBACK):
        out.append(
            f"the hub endpoint {hub} is a loopback address, which {', '.join(remote)} cannot "
            "reach: pass --hub with an address of this machine those hosts can reach"
        )
    script = values.get("script")
    if isinstance(script, str) and not os.path.isabs(script):
        out.append(
            f"the script path {script!r} is relative: the rerun starts in this directory "
            f"({os.getcwd()}), which must be the parent run's"
        )
    return tuple(out)


class RunningRerun:
    """A launched rerun: one process group per command, all writing to one log."""

    def __init__(self, launch: Launch, procs: list[subprocess.Popen], log: IO[bytes]) -> None:
        self.launch = launch
        self.procs = procs
        self._log = log
        self.cancelled = False

    @property
    def run(self) -> str:
        """Id of the new run."""
        return self.launch.plan.run

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def poll(self) -> int | None:
        """None while any command runs; else the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        self._close()
        return next((c for c in codes if c), 0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every command.

        Args:
            timeout: seconds; None waits for ever.

        Returns:
            The first non-zero exit code, or 0.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            p.wait(left)
        code = self.poll()
        assert code is not None
        return code

    def cancel(self, grace_s: float = 5.0) -> int:
        """Stop the rerun: SIGTERM to every process group, SIGKILL after ``grace_s``.

        Args:
            grace_s: seconds the processes get to exit cleanly.

        Returns:
            The exit code (negative: the signal that ended it).
        """
        self.cancelled = True
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        if any(p.poll() is None for p in self.procs):
            self._signal(signal.SIGKILL)
            for p in self.procs:
                p.wait()
        self._note(f"cancelled; exit codes {[p.returncode for p in self.procs]}")
        code = self.poll()
        assert code is not None
        return code

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    # Each command leads its own session, so its pid is its group id: the
                    # signal reaches torchrun's workers, not just torchrun.
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _note(self, text: str) -> None:
        if not self._log.closed:
            self._log.write(f"# rankscope: {text}\n".encode())
            self._log.flush()

    def _close(self) -> None:
        if not self._log.closed:
            self._log.close()


def start(launch: Launch, *, env: Mapping[str, str] | None = None) -> RunningRerun:
    """Start every command of a launch, each in its own process group.

    A JSON record of the launch (plan, commands, log) is written next to the log first, so
    the recording keeps what was run even if the launcher dies.

    Args:
        launch: a prepared launch (shown to and confirmed by the user).
        env: base environment (default ``os.environ``); each command adds its own.

    Returns:
        The running rerun.
    """
    launch.log.parent.mkdir(parents=True, exist_ok=True)
    if launch.scenario_spec is not None:
        from rankscope.sim.spec import write_spec

        write_spec(*launch.scenario_spec)
    record = launch.log.with_suffix(".json")
    record.write_text(json.dumps(launch.to_dict(), indent=2) + "\n")
    log = open(launch.log, "ab")  # noqa: SIM115 - owned by RunningRerun, closed when done
    header = [f"rerun {launch.plan.run} of {launch.plan.parent_run} at {launch.plan.scope}"]
    header += [f"command: {c.display}" for c in launch.commands]
    log.write("".join(f"# rankscope: {line}\n" for line in header).encode())
    log.flush()
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    try:
        for cmd in launch.commands:
            procs.append(
                subprocess.Popen(
                    list(cmd.argv),
                    env={**base, **cmd.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    except OSError as exc:
        if procs:
            RunningRerun(launch, procs, log).cancel(grace_s=1.0)
        log.close()
        raise RuntimeError(
            f"could not start {launch.commands[len(procs)].argv[0]!r}: {exc}"
        ) from exc
    return RunningRerun(launch, procs, log)
