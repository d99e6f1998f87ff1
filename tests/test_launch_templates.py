"""Launcher templates: discovery, parsing and rendering into argv lists."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rankscope.launch.safety import UnsafeValueError
from rankscope.launch.templates import (
    PLACEHOLDERS,
    TemplateError,
    find_launcher,
    launcher_dirs,
    list_launchers,
    load_template,
    render,
)

BASE = dict(
    python="/opt/venv/bin/python",
    hub="tcp://10.0.0.1:5555",
    job="llm",
    run="r1-two-node-1",
    parent_run="r1",
    scope="two-node",
    hosts="node03,node07",
    nnodes=2,
    nproc_per_node=8,
    world_size=16,
    master_addr="node03",
    script="train.py",
    script_args=["--lr=0.1", "--bs", "4"],
    log="/rec/reruns/r1-two-node-1.log",
)


def test_shipped_templates_parse_and_document_their_placeholders() -> None:
    found = list_launchers()
    assert {"torchrun", "slurm", "slurm-sbatch"} <= set(found)
    for name, path in found.items():
        tpl = load_template(path)
        assert tpl.name == name
        assert tpl.description
        text = path.read_text()
        # Every placeholder a shipped template uses is explained in its header comment.
        used = {p for p in PLACEHOLDERS if "{" + p + "}" in text.split("description", 1)[1]}
        header = text.split("description", 1)[0]
        undocumented = {p for p in used if "{" + p + "}" not in header}
        assert not undocumented, f"{name}: {undocumented}"


def test_torchrun_runs_locally_without_ssh() -> None:
    tpl = find_launcher("torchrun")
    (cmd,) = render(tpl, dict(BASE, nnodes=1, hosts="here"), ["here"], local=["here"])
    assert cmd.argv[:5] == ("/opt/venv/bin/python", "-m", "rankscope", "run", "--")
    assert "torchrun" in cmd.argv
    assert "--nproc-per-node=8" in cmd.argv
    assert "--node-rank=0" in cmd.argv
    # The list placeholder expands to separate tokens, in order, at the end.
    assert cmd.argv[-3:] == ("--lr=0.1", "--bs", "4")
    assert cmd.env["RANKSCOPE_PARENT_RUN"] == "r1"
    assert cmd.env["RANKSCOPE_SCOPE"] == "two-node"
    assert cmd.env["RANKSCOPE_RUN"] == "r1-two-node-1"
    assert cmd.env["RANKSCOPE_HUB"] == "tcp://10.0.0.1:5555"
    # No GPU reported: the optional CUDA_VISIBLE_DEVICES is left out, not set empty.
    assert "CUDA_VISIBLE_DEVICES" not in cmd.env


def test_torchrun_reaches_other_hosts_over_ssh_with_quoted_command() -> None:
    tpl = find_launcher("torchrun")
    cmds = render(tpl, dict(BASE, gpus="0,1,2,3"), ["node03", "node07"], local=[])
    assert [c.host for c in cmds] == ["node03", "node07"]
    for i, cmd in enumerate(cmds):
        assert cmd.argv[:5] == ("ssh", "-o", "BatchMode=yes", "--", cmd.host)
        assert len(cmd.argv) == 6
        remote = shlex.split(cmd.argv[5])
        assert remote[0] == "env"
        assert "RANKSCOPE_PARENT_RUN=r1" in remote
        assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in remote
        assert f"--node-rank={i}" in remote
        assert "--master-addr=node03" in remote
        assert cmd.env == {}


def test_slurm_uses_the_node_list() -> None:
    (cmd,) = render(find_launcher("slurm"), BASE, ["node03", "node07"], local=[])
    assert cmd.argv[0] == "srun"
    assert "--nodelist=node03,node07" in cmd.argv
    assert "--nodes=2" in cmd.argv
    assert "--rdzv-endpoint=node03:29500" in cmd.argv
    assert cmd.env["RANKSCOPE_SCOPE"] == "two-node"


def test_sbatch_wraps_a_quoted_script() -> None:
    (cmd,) = render(find_launcher("slurm-sbatch"), BASE, ["node03", "node07"], local=[])
    assert cmd.argv[0] == "sbatch"
    wrap = next(a for a in cmd.argv if a.startswith("--wrap="))
    words = shlex.split(wrap.removeprefix("--wrap="))
    assert words[:2] == ["srun", "env"]
    assert "RANKSCOPE_RUN=r1-two-node-1" in words
    assert "--output=/rec/reruns/r1-two-node-1.log" in cmd.argv


def test_missing_value_names_the_placeholder() -> None:
    vals = dict(BASE)
    del vals["script"]
    with pytest.raises(TemplateError, match=r"\{script\}"):
        render(find_launcher("slurm"), vals, ["node03", "node07"])


def test_local_only_template_refuses_a_remote_host(tmp_path: Path) -> None:
    (tmp_path / "here.toml").write_text(
        'description = "x"\nper_host = true\ncommand = ["echo", "{host}"]\n'
    )
    tpl = load_template(tmp_path / "here.toml")
    with pytest.raises(TemplateError, match="only on this machine"):
        render(tpl, {}, ["elsewhere"], local=["here"])
    (cmd,) = render(tpl, {}, ["here"], local=["here"])
    assert cmd.argv == ("echo", "here")


def test_user_folders_add_and_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "cfg"
    (user / "rankscope" / "launchers").mkdir(parents=True)
    (user / "rankscope" / "launchers" / "mine.toml").write_text('command = ["true"]\n')
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "torchrun.toml").write_text('description = "site torchrun"\ncommand = ["true"]\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(user))
    assert launcher_dirs([extra])[-1] == extra
    found = list_launchers([extra])
    assert found["mine"].parent == user / "rankscope" / "launchers"
    assert found["torchrun"] == extra / "torchrun.toml"
    assert find_launcher("torchrun", [extra]).description == "site torchrun"
    with pytest.raises(TemplateError, match="available"):
        find_launcher("nope", [extra])


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ('command = ["echo", "{nope}"]', "unknown placeholder"),
        ('command = ["echo", "x{script_args}"]', "use it alone"),
        ('command = "echo"', "list of strings"),
        ('description = "x"', "needs a 'command'"),
        ('command = ["x"]\nbogus = 1', "unknown keys"),
        ('command = ["x"]\n[env]\n"A B" = "x"', "environment variable"),
        ('command = ["x"]\n[env]\nA = "{script_args}"', "unknown placeholder"),
        ('command = ["x"]\n[defaults]\nzzz = 1', "unknown placeholder"),
        ("command = [", "Invalid"),
    ],
)
def test_malformed_templates_are_refused_with_the_file_named(
    tmp_path: Path, body: str, match: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body + "\n")
    with pytest.raises(TemplateError, match=match) as err:
        load_template(path)
    assert str(path) in str(err.value)


def test_placeholder_substitution_is_not_format_string(tmp_path: Path) -> None:
    # A value that looks like a placeholder is not expanded again, and attribute syntax
    # is not a placeholder at all.
    path = tmp_path / "t.toml"
    path.write_text('command = ["echo", "{job}"]\n')
    with pytest.raises(UnsafeValueError, match="job"):
        render(load_template(path), {"job": "a{run}"}, ["h"])
    path.write_text('command = ["echo", "{job.__class__}"]\n')
    (cmd,) = render(load_template(path), {"job": "x"}, ["h"])
    assert cmd.argv == ("echo", "{job.__class__}")
