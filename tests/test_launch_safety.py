"""Command construction refuses hostile values and quotes what must become a shell string."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from rankscope.launch.safety import (
    UnsafeValueError,
    check_argv,
    check_env,
    check_hosts,
    check_value,
    shell_join,
)
from rankscope.launch.templates import find_launcher, render

HOSTILE = [
    "a;rm -rf /",
    "$(x)",
    "`id`",
    "node1\nrm -rf /",
    "-oProxyCommand=sh",
    "--help",
    "node 1",
    "a|b",
    "a&b",
    "a>b",
    "${HOME}",
    "",
    "x'y",
    'x"y',
]


@pytest.mark.parametrize("value", HOSTILE)
def test_host_refuses_hostile_names(value: str) -> None:
    with pytest.raises(UnsafeValueError) as err:
        check_value("host", value, "host")
    # The error names the field and shows the value.
    assert err.value.field == "host"
    assert "host=" in str(err.value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("kind", ["name", "path", "list", "host"])
@pytest.mark.parametrize("value", ["a;rm -rf /", "$(x)", "`x`", "a\nb", "-x"])
def test_every_kind_refuses_shell_syntax_and_options(kind: str, value: str) -> None:
    with pytest.raises(UnsafeValueError):
        check_value("field", value, kind)


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(UnsafeValueError, match="newline"):
        check_value("host", "a\nb", "host")
    with pytest.raises(UnsafeValueError, match="option"):
        check_value("host", "-oProxyCommand=x", "host")
    with pytest.raises(UnsafeValueError, match="command substitution"):
        check_value("job", "$(reboot)", "name")
    with pytest.raises(UnsafeValueError, match="empty"):
        check_value("host", "", "host")


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("node-01.cluster.local", "host"),
        ("gpu17", "host"),
        ("llama-70b_run3", "name"),
        ("job:2024-05-01@a+b", "name"),
        ("/home/me/train.py", "path"),
        ("configs/run=3,a.yaml", "path"),
        ("--lr=3e-4", "arg"),
        ("", "arg"),
        ("node01,node02", "list"),
        ("tcp://10.0.0.1:5555", "endpoint"),
        ("ipc:///tmp/rankscope.sock", "endpoint"),
    ],
)
def test_ordinary_values_pass(value: str, kind: str) -> None:
    assert check_value("f", value, kind) == value


def test_script_args_may_start_with_a_dash_but_hold_no_shell() -> None:
    assert check_value("script_args[0]", "--epochs", "arg") == "--epochs"
    for bad in ("--x;id", "a b", "$(id)", "a\nb"):
        with pytest.raises(UnsafeValueError):
            check_value("script_args[0]", bad, "arg")


def test_numbers_ports_and_scopes() -> None:
    assert check_value("nnodes", 2, "int") == "2"
    assert check_value("nnodes", "16", "int") == "16"
    for bad in (-1, "1;2", "1e3", True, 1.5, "0x10"):
        with pytest.raises(UnsafeValueError, match="nnodes"):
            check_value("nnodes", bad, "int")
    assert check_value("master_port", 29500, "port") == "29500"
    with pytest.raises(UnsafeValueError, match="port"):
        check_value("master_port", 70000, "port")
    with pytest.raises(UnsafeValueError, match="scope"):
        check_value("scope", "one-node;id", "scope")


def test_host_lists() -> None:
    assert check_hosts("hosts", ["a", "b"]) == ("a", "b")
    with pytest.raises(UnsafeValueError, match="hosts"):
        check_hosts("hosts", ["a", "b;c"])
    with pytest.raises(UnsafeValueError):
        check_hosts("hosts", [])


def test_argv_and_env_checks() -> None:
    assert check_argv(["echo", "x"]) == ("echo", "x")
    with pytest.raises(UnsafeValueError):
        check_argv([])
    with pytest.raises(UnsafeValueError):
        check_argv(["-rf"])
    with pytest.raises(UnsafeValueError):
        check_argv(["echo", "a\x00b"])
    with pytest.raises(UnsafeValueError):
        check_env({"BAD NAME": "x"})
    with pytest.raises(UnsafeValueError, match="RANKSCOPE_RUN"):
        check_env({"RANKSCOPE_RUN": "a\nb"})


def test_shell_join_round_trips_through_a_real_shell(tmp_path: Path) -> None:
    # What a quoted string means is decided by the shell that reads it, so ask one.
    argv = ["printf", "%s|", "it's", "a b", "$(touch pwned)", "`touch pwned`", "x;y"]
    line = shell_join(argv, {"RS_X": "v w"})
    assert shlex.split(line) == ["env", "RS_X=v w", *argv]
    out = subprocess.run(
        ["sh", "-c", line], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout == "it's|a b|$(touch pwned)|`touch pwned`|x;y|"
    assert not (tmp_path / "pwned").exists()


def _values(**over: object) -> dict[str, object]:
    vals: dict[str, object] = dict(
        python="/usr/bin/python3",
        hub="tcp://10.0.0.1:5555",
        job="llm",
        run="r1-one-node-1",
        parent_run="r1",
        scope="one-node",
        hosts="node03",
        nnodes=1,
        nproc_per_node=8,
        world_size=8,
        master_addr="node03",
        script="train.py",
        script_args=["--lr=0.1"],
        log="/tmp/r.log",
    )
    vals.update(over)
    return vals


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "slurm-sbatch"])
@pytest.mark.parametrize("hostile", ["a;rm -rf /", "$(x)", "node\nx", "-oProxyCommand=x"])
def test_templates_refuse_hostile_host_names(launcher: str, hostile: str) -> None:
    tpl = find_launcher(launcher)
    with pytest.raises(UnsafeValueError, match="host"):
        render(tpl, _values(hosts=f"node03,{hostile}", master_addr=hostile), ["node03", hostile])


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "slurm-sbatch"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job", "x;reboot"),
        ("run", "$(curl evil)"),
        ("parent_run", "`id`"),
        ("script", "train.py;id"),
        ("script", "-c"),
        ("hub", "tcp://h:1;id"),
        ("nproc_per_node", "8 && id"),
        ("script_args", ["--ok", "$(id)"]),
    ],
)
def test_templates_refuse_hostile_values(launcher: str, field: str, value: object) -> None:
    tpl = find_launcher(launcher)
    with pytest.raises(UnsafeValueError) as err:
        render(tpl, _values(**{field: value}), ["node03"], local=["node03"])
    assert field in str(err.value)
