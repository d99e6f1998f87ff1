"""Zero-code instrumentation: the injected sitecustomize, its laziness, chaining, safety,
and the ``rankscope run`` command line."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rankscope.collector.autostart import SITECUSTOMIZE, prepare_site_dir
from rankscope.commands import run as run_cmd
from rankscope.errors import CommandError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python(code: str, site: str, extra_path: str | None = None, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    full.update(env)
    full["PYTHONPATH"] = site + (os.pathsep + extra_path if extra_path else "")
    out = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    return prepare_site_dir(str(tmp_path_factory.mktemp("site")))


def test_site_dir_content_and_reuse(site: str) -> None:
    assert Path(site, "sitecustomize.py").read_text() == SITECUSTOMIZE
    assert prepare_site_dir(str(Path(site).parent)) == site
    assert stat.S_IMODE(os.stat(site).st_mode) == 0o700


def test_unsafe_existing_dir_is_not_used(tmp_path: Path) -> None:
    first = prepare_site_dir(str(tmp_path))
    os.chmod(first, 0o777)  # anyone could plant a sitecustomize there
    second = prepare_site_dir(str(tmp_path))
    assert second != first
    assert Path(second, "sitecustomize.py").read_text() == SITECUSTOMIZE


def test_nothing_happens_without_torch(site: str) -> None:
    code = (
        "import sys; import json\n"
        "print(json.dumps(['torch' in sys.modules, 'zmq' in sys.modules,"
        " 'rankscope.collector.runtime' in sys.modules,"
        " any(type(f).__name__ == '_Watcher' for f in sys.meta_path)]))"
    )
    assert _python(code, site, RANKSCOPE_ZERO_CODE="1") == "[false, false, false, true]"


def test_existing_sitecustomize_still_runs(site: str, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    code = "import os, sys; print(os.environ.get('CHAINED'), '_rankscope_chained_sitecustomize' in sys.modules)"
    assert _python(code, site, str(other)) == "yes True"


def test_broken_sitecustomize_does_not_stop_the_program(site: str, tmp_path: Path) -> None:
    other = tmp_path / "broken"
    other.mkdir()
    (other / "sitecustomize.py").write_text("raise RuntimeError('boom')\n")
    assert _python("print('still here')", site, str(other)) == "still here"


@pytest.mark.torch
def test_monitor_starts_when_the_process_group_initialises(site: str) -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    code = (
        "import torch.distributed as dist\n"
        "from rankscope.collector import runtime\n"
        "assert hasattr(dist.init_process_group, '__rankscope_original__')\n"
        "before = runtime.current()\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
        "mon = runtime.current()\n"
        "print(before is None, mon is not None and mon.enabled, mon.job, mon.run, mon.hub,"
        " hasattr(dist.all_reduce, '__rankscope_original__'))\n"
        "dist.destroy_process_group()\n"
    )
    hub = f"tcp://127.0.0.1:{_free_port()}"
    got = _python(
        code,
        site,
        RANKSCOPE_ZERO_CODE="1",
        RANKSCOPE_HUB=hub,
        RANKSCOPE_JOB="zc",
        RANKSCOPE_RUN="zc-1",
    ).split()
    assert got == ["True", "True", "zc", "zc-1", hub, "True"]


@pytest.mark.torch
def test_marker_zero_turns_it_off(site: str) -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    code = (
        "import torch.distributed as dist\n"
        "print(hasattr(dist.init_process_group, '__rankscope_original__'))"
    )
    assert _python(code, site, RANKSCOPE_ZERO_CODE="0") == "False"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return args


def test_run_environment() -> None:
    args = _args(
        "--hub",
        "tcp://10.0.0.1:7000",
        "--job",
        "llm",
        "--scope",
        "one-node",
        "--parent-run",
        "llm-1",
        "--",
        "torchrun",
        "--nproc_per_node=8",
        "train.py",
    )
    env = run_cmd.build_env(args, {"PYTHONPATH": "/existing"}, "/site")
    assert env["RANKSCOPE_HUB"] == "tcp://10.0.0.1:7000"
    assert env["RANKSCOPE_JOB"] == "llm" and env["RANKSCOPE_SCOPE"] == "one-node"
    assert env["RANKSCOPE_PARENT_RUN"] == "llm-1"
    assert env["RANKSCOPE_RUN"].startswith("llm-")  # single node: the run is named here
    assert env["PYTHONPATH"] == "/site" + os.pathsep + "/existing"
    assert env["RANKSCOPE_ZERO_CODE"] == "1"
    assert "RANKSCOPE_DDP_BUCKETS" not in env  # the collector's default (auto) applies
    args = _args("--ddp-buckets", "sampled", "--ddp-sample-every", "4", "--", "x.py")
    env = run_cmd.build_env(args, {}, "/site")
    assert env["RANKSCOPE_DDP_BUCKETS"] == "sampled" and env["RANKSCOPE_DDP_SAMPLE_EVERY"] == "4"


def test_multi_node_leaves_the_run_id_to_the_ranks() -> None:
    for nnodes in (["--nnodes=2"], ["--nnodes", "4"], ["--nnodes=1:4"]):
        args = _args("--", "torchrun", *nnodes, "train.py")
        assert "RANKSCOPE_RUN" not in run_cmd.build_env(args, {}, "/site")
    args = _args("--run", "shared-7", "--", "torchrun", "--nnodes=2", "train.py")
    assert run_cmd.build_env(args, {}, "/site")["RANKSCOPE_RUN"] == "shared-7"
    args = _args("--", "torchrun", "--nnodes=1", "train.py")
    assert run_cmd.build_env(args, {}, "/site")["RANKSCOPE_RUN"].startswith("train-")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--hub", "localhost:5555", "--", "x"], "--hub"),
        (["--job", "bad name", "--", "x"], "--job"),
        (["--run", "$(rm -rf /)", "--", "x"], "--run"),
        (["--topology", "/no/such/file.toml", "--", "x"], "--topology"),
        (["--ddp-sample-every", "0", "--", "x"], "--ddp-sample-every"),
    ],
)
def test_bad_options_are_named(argv: list[str], match: str) -> None:
    with pytest.raises(CommandError, match=match):
        run_cmd.build_env(_args(*argv), {}, "/site")


def test_command_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CommandError, match="no command"):
        run_cmd.run(_args())
    assert run_cmd.run(_args("--", "no-such-binary-rankscope")) == 127
    assert "not found" in capsys.readouterr().err


def test_dry_run_prints_and_does_not_execute(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cmd.run(_args("--dry-run", "--job", "j", "--", "true", "arg")) == 0
    out = capsys.readouterr().out
    assert "RANKSCOPE_JOB=j" in out and "PYTHONPATH=" in out and out.strip().endswith("true arg")


def test_rankscope_run_executes_the_command(tmp_path: Path) -> None:
    code = "import os; print(os.environ['RANKSCOPE_JOB'], os.environ['PYTHONPATH'].split(os.pathsep)[0].split(os.sep)[-1][:15])"
    out = subprocess.run(
        [sys.executable, "-m", "rankscope", "run", "--job", "k", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["k", "rankscope-site-"]
