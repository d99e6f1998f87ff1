"""Topology files: the shipped example parses; every kind of bad file is named clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankscope.collector.topology import Placement, TopologyError, load_topology

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "topology" / "example.toml"


def test_example_file() -> None:
    topo = load_topology(EXAMPLE)
    assert topo.lookup("gpu-a01", 2) == Placement(rack="rack-a", nic="mlx5_2", rail=2)
    assert topo.lookup("gpu-a04", 0).rack == "rack-a"  # pattern gpu-a0[3-4]
    assert topo.lookup("gpu-b12", 7) == Placement(rack="rack-b", nic="mlx5_7", rail=7)
    assert topo.lookup("gpu-b07", 3) == Placement(rack="rack-b", nic="mlx5_9", rail=3)
    assert topo.lookup("gpu-c01", 1) == Placement(rack="rack-c", nic="mlx5_1", rail=1)
    assert topo.lookup("elsewhere", None) == Placement()
    assert topo.lookup("gpu-a01", 42) == Placement(rack="rack-a")


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "topo.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("version = 1\n[racks\n", "invalid TOML"),
        ('[racks]\nr = ["a"]\n', "'version' must be 1, got None"),
        ("version = 2\n", "'version' must be 1, got 2"),
        ("version = 1\n[rails]\n", r"unknown sections \['rails'\]"),
        ("version = 1\nracks = 3\n", r"\[racks\] must be a table"),
        ("version = 1\n[racks]\nr1 = [1, 2]\n", "racks.r1 must be a list"),
        ('version = 1\n[gpus]\nzero = { nic = "m", rail = 0 }\n', "key 'zero' is not a GPU index"),
        ('version = 1\n[gpus]\n"0" = "mlx5_0"\n', r"\[gpus\].0 must be a table"),
        ('version = 1\n[gpus]\n"0" = { nic = "m", rail = -1 }\n', "rail must be an int >= 0"),
        ('version = 1\n[gpus]\n"0" = { nic = "m", rail = "1" }\n', "rail must be an int >= 0"),
        ('version = 1\n[gpus]\n"0" = { nic = "", rail = 1 }\n', "nic must be a non-empty string"),
        ('version = 1\n[gpus]\n"0" = { nic = "m", speed = 1 }\n', r"unknown keys \['speed'\]"),
        ("version = 1\n[hosts.h1]\nrack = 5\n", "hosts.h1.rack must be a string"),
        ('version = 1\n[hosts.h1]\nrow = "x"\n', r"hosts.h1 has unknown keys \['row'\]"),
        ('version = 1\n[hosts.h1.gpus]\n"x" = { rail = 1 }\n', "hosts.h1.gpus key 'x'"),
    ],
)
def test_bad_files_name_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(TopologyError, match=match) as err:
        load_topology(path)
    assert str(path) in str(err.value)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "nope.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TopologyError, match="not UTF-8"):
        load_topology(p)
