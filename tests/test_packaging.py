"""Every component folder is installed under the rankscope namespace, from a source tree
and from a built wheel."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["setuptools"]["package-dir"]


def test_every_python_folder_is_mapped() -> None:
    mapped = {Path(p).as_posix() for p in _package_dirs().values()}
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in ("tests", "benchmarks", "examples", "build", "screenshots"):
            continue
        top = rel.split("/")[0]
        assert top in mapped, f"{rel} is not under a mapped component folder"
        # sub-packages must be listed explicitly (package-dir mappings do not auto-discover)
        pkg = next(k for k, v in _package_dirs().items() if v == top)
        name = ".".join([pkg, *rel.split("/")[1:]])
        assert name in declared, f"{name} ({rel}) missing from [tool.setuptools] packages"


@pytest.mark.slow
def test_wheel_installs_and_imports(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("rankscope-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "rankscope/collector/schema.py" in names
    assert "rankscope/diagnosis/window.py" in names
    assert any(n.startswith("rankscope/config/scenarios/") for n in names) or not list(
        (ROOT / "config" / "scenarios").glob("*.toml")
    )
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    code = (
        "import rankscope, rankscope.collector.schema, rankscope.hub, rankscope.diagnosis.window,"
        " rankscope.sim, rankscope.launch, rankscope.tui, rankscope.config;"
        "print(rankscope.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().startswith(str(target))
