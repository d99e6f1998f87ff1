"""Identity from arguments and environment, including hostile and garbage values."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from rankscope.collector import runtime, schema
from rankscope.collector.identity import (
    IdentityError,
    parse_int,
    parse_label,
    parse_mesh,
    resolve_identity,
)
from rankscope.collector.manifest import build_manifest, filtered_env

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "topology" / "example.toml"


def _resolve(env: dict[str, str], **kw: object):
    warnings: list[str] = []
    ident = resolve_identity(env=env, warn=warnings.append, gpu_info=False, **kw)
    return ident, warnings


def test_torchrun_environment() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "RANKSCOPE_HOST": "nodeB",
        "RANKSCOPE_MESH": "dp=1, tp=1",
        "RANKSCOPE_SHARD": "17",
    }
    ident, warnings = _resolve(env)
    assert warnings == []
    assert (ident.rank, ident.world_size, ident.local_rank, ident.node_rank) == (5, 8, 1, 1)
    assert ident.local_world_size == 4 and ident.incarnation == 2
    assert ident.host == "nodeB" and ident.mesh == {"dp": 1, "tp": 1} and ident.shard == 17
    hello = ident.hello_fields()
    assert "incarnation" not in hello and "gpu_uuid" not in hello
    for key, typ in schema.HELLO_REQUIRED.items():
        assert isinstance(hello[key], typ)


def test_node_rank_derived_when_launcher_does_not_say() -> None:
    ident, _ = _resolve({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert ident.node_rank == 1 and ident.local_rank == 2


def test_no_environment_is_a_single_process_on_this_host() -> None:
    ident, warnings = _resolve({})
    assert (ident.rank, ident.world_size, ident.local_rank, ident.node_rank) == (0, 1, 0, 0)
    assert ident.host == socket.gethostname() and warnings == []


def test_explicit_arguments_win() -> None:
    ident, _ = _resolve(
        {"RANK": "1", "WORLD_SIZE": "2", "RANKSCOPE_HOST": "envhost"},
        rank=3,
        world_size=4,
        host="arghost",
        mesh={"pp": 2},
    )
    assert (ident.rank, ident.world_size, ident.host, ident.mesh) == (3, 4, "arghost", {"pp": 2})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "abc", "WORLD_SIZE": "4"}, "RANK='abc'"),
        ({"RANK": "1", "WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "outside world size"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK='-1'"),
        ({"RANK": "1e3", "WORLD_SIZE": "4"}, "RANK='1e3'"),
        ({"RANK": "9" * 40, "WORLD_SIZE": "4"}, "RANK="),
        ({"RANK": "٣", "WORLD_SIZE": "4"}, "RANK="),  # a non-ASCII digit
        ({"RANK": "0", "WORLD_SIZE": "\x00"}, "WORLD_SIZE="),
    ],
)
def test_garbage_rank_or_world_is_an_identity_error(env: dict[str, str], match: str) -> None:
    with pytest.raises(IdentityError, match=match):
        _resolve(env)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("LOCAL_RANK", "zero"),
        ("LOCAL_RANK", "99"),
        ("LOCAL_WORLD_SIZE", "-3"),
        ("GROUP_RANK", "x"),
        ("TORCHELASTIC_RESTART_COUNT", "many"),
        ("RANKSCOPE_HOST", "bad host"),
        ("RANKSCOPE_HOST", "a\x1b[31mred"),
        ("RANKSCOPE_HOST", "h" * 400),
        ("RANKSCOPE_MESH", "dp=zz"),
        ("RANKSCOPE_MESH", "xx=1"),
        ("RANKSCOPE_MESH", "dp"),
        ("RANKSCOPE_SHARD", "-2"),
        ("RANKSCOPE_RAIL", "rail-3"),
        ("RANKSCOPE_RACK", "rack a"),
        ("RANKSCOPE_NIC", "\ud800"),
        ("RANKSCOPE_TOPOLOGY", "/nonexistent/topology.toml"),
    ],
)
def test_garbage_optional_values_are_ignored_with_a_warning(var: str, value: str) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", var: value}
    ident, warnings = _resolve(env)
    assert ident.rank == 1 and ident.world_size == 4
    assert len(warnings) == 1
    assert var in warnings[0] or "topology" in warnings[0]
    assert ident.host == socket.gethostname() or var != "RANKSCOPE_HOST"


def test_topology_file_gives_rack_nic_rail() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "3",
        "RANKSCOPE_HOST": "gpu-b07",
        "RANKSCOPE_TOPOLOGY": str(EXAMPLE),
        "RANKSCOPE_RACK": "ignored-when-file-says",
    }
    ident, warnings = _resolve(env)
    assert warnings == []
    # CPU-only here: the local rank stands for the device slot.
    assert (ident.rack, ident.nic, ident.rail) == ("rack-b", "mlx5_9", 3)


def test_env_fallbacks_fill_what_the_file_does_not_cover() -> None:
    env = {
        "RANKSCOPE_HOST": "unlisted-host",
        "RANKSCOPE_TOPOLOGY": str(EXAMPLE),
        "RANKSCOPE_RACK": "r9",
        "RANKSCOPE_NIC": "eth1",
        "RANKSCOPE_RAIL": "1",
    }
    ident, _ = _resolve(env)
    # local rank 0 -> GPU slot 0 in [gpus]; the rack comes from the environment
    assert (ident.rack, ident.nic, ident.rail) == ("r9", "mlx5_0", 0)
    ident, _ = _resolve({k: v for k, v in env.items() if k != "RANKSCOPE_TOPOLOGY"})
    assert (ident.rack, ident.nic, ident.rail) == ("r9", "eth1", 1)


def test_parsers_name_the_variable() -> None:
    assert parse_int(" 12 ", "X") == 12 and parse_int("", "X") is None
    with pytest.raises(ValueError, match="MYVAR='x'"):
        parse_int("x", "MYVAR")
    with pytest.raises(ValueError, match=r"out of range \[0, 3\]"):
        parse_int("4", "Y", hi=3)
    assert parse_label(" n1 ", "H") == "n1"
    with pytest.raises(ValueError, match="H="):
        parse_label("a b", "H")
    assert parse_mesh("dp=0,tp=3,pp=1") == {"dp": 0, "tp": 3, "pp": 1}
    with pytest.raises(ValueError, match="RANKSCOPE_MESH"):
        parse_mesh("dp=1,tp=")


def test_garbage_identity_env_gives_an_inert_monitor(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RANK", "not-a-rank")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANKSCOPE_HUB", "tcp://127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        mon = runtime.start(job="j", sample_interval_s=0, instrument_torch=False)
    try:
        assert not mon.enabled
        assert any("RANK='not-a-rank'" in r.message for r in caplog.records)
        with mon.step(), mon.collective("all_reduce"):  # still harmless to call
            pass
        assert mon._colls.head == 0
    finally:
        runtime.close()


def test_garbage_hub_and_scope_env_fall_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RANKSCOPE_HUB", "http://evil:80/")
    monkeypatch.setenv("RANKSCOPE_SCOPE", "everything")
    monkeypatch.setenv("RANKSCOPE_JOB", "bad job name")
    monkeypatch.setenv("RANKSCOPE_MESH", "tp=banana")
    for var in ("RANK", "WORLD_SIZE", "RANKSCOPE_RUN"):
        monkeypatch.delenv(var, raising=False)
    with caplog.at_level(logging.WARNING, logger="rankscope"):
        mon = runtime.start(sample_interval_s=0, instrument_torch=False)
    try:
        assert mon.enabled
        assert mon.hub == runtime.DEFAULT_HUB and mon.scope == "full"
        assert mon.job != "bad job name" and " " not in mon.job
        assert mon.identity.mesh == {}
        assert mon.stats()["errors"]["bad_env"] == 1
        text = " ".join(r.message for r in caplog.records)
        assert "RANKSCOPE_HUB" in text and "RANKSCOPE_SCOPE" in text and "RANKSCOPE_MESH" in text
    finally:
        runtime.close()


def test_manifest_filters_env_and_redacts_secrets() -> None:
    env = {
        "NCCL_IB_HCA": "mlx5_0",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RANKSCOPE_API_TOKEN": "hunter2",
        "HOME": "/root",
        "AWS_SECRET_ACCESS_KEY": "x",
        "MASTER_PORT": "29500",
        "RANKSCOPE_GIT_COMMIT": "abc1234",
    }
    got = filtered_env(env)
    assert got["NCCL_IB_HCA"] == "mlx5_0" and got["MASTER_PORT"] == "29500"
    assert got["RANKSCOPE_API_TOKEN"] == "<redacted>"
    assert "HOME" not in got and "AWS_SECRET_ACCESS_KEY" not in got
    man = build_manifest({"model": "tiny", "global_batch": 64, "odd": object()}, env=env)
    assert man["git_commit"] == "abc1234"
    assert man["job_config"]["model"] == "tiny" and isinstance(man["job_config"]["odd"], str)
    assert man["env"] == got and man["python"] and man["rankscope"]
