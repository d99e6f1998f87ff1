"""The cores never import the UI stack: a collector inside a training rank must not pull in
Textual or Rich, and the diagnosis must stay pure numpy."""

import subprocess
import sys

import pytest

CORES = [
    "rankscope.collector",
    "rankscope.collector.schema",
    "rankscope.hub",
    "rankscope.diagnosis",
    "rankscope.sim",
    "rankscope.launch",
]


def _submodules(pkg: str) -> list[str]:
    import importlib
    import pkgutil

    mod = importlib.import_module(pkg)
    return [pkg] + [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)]


@pytest.mark.parametrize("package", CORES)
def test_core_does_not_import_ui(package: str) -> None:
    mods = _submodules(package) if not package.endswith("schema") else [package]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('textual', 'rich'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} imported UI modules: {out.stdout.strip()}"


def test_diagnosis_imports_no_project_module_but_schema() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import rankscope.diagnosis as d\n"
        "for m in pkgutil.iter_modules(d.__path__):\n"
        "    importlib.import_module('rankscope.diagnosis.' + m.name)\n"
        "ok = ('rankscope', 'rankscope.version', 'rankscope.diagnosis', 'rankscope.collector',"
        " 'rankscope.collector.schema')\n"
        "bad = sorted(k for k in sys.modules if k.startswith('rankscope') and k not in ok"
        " and not k.startswith('rankscope.diagnosis.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"diagnosis imported: {out.stdout.strip()}"


def test_collector_does_not_import_torch_eagerly() -> None:
    code = "import sys, rankscope.collector\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
