"""Fixtures shared by several test modules.

The real torch jobs are most of the suite's time. A run that more than one module reads
is made once per session here, against one hub, instead of once per module.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Bytecode is cached (in __pycache__, which git ignores) even where the environment says
# not to (PYTHONDONTWRITEBYTECODE): without it every worker rewrites the asserts of every
# test module again (11 of its 15 s of collection on this machine) and every process the
# tests start (hubs, CLI commands, torchrun ranks) compiles the package from source again.
if sys.dont_write_bytecode:
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Keys made with `rankscope keys` on this machine would turn the suite's hubs and
# collectors (and the processes they start) to CURVE; a test that wants keys names its own.
os.environ["RANKSCOPE_KEYS"] = "none"


def _incidents() -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import incidents

    return incidents


@pytest.fixture(scope="session")
def real_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A hub on a loopback port it chose itself (port 0, read back), recording, for the
    real ``gpt_packing.py`` runs of the session; each run has its own run id."""
    with _incidents().local_hub(tmp_path_factory.mktemp("real") / "record") as hub:
        yield hub


@pytest.fixture(scope="session")
def packing_baseline(real_hub: Any) -> Any:
    """The healthy run of the packing incident (attention packer, explicit API, two
    ranks, the incident's own step count), warm-up left out of the window.

    The packing incident's baseline and its experiment's after-run have the same flags
    (the change the experiment tests is going back to the attention packer), so this one
    run serves as both; it is also the numerator incident's baseline and the explicit-API
    run the instrumentation tests read.
    """
    incidents = _incidents()
    spec = incidents.PACKING.spec("baseline")
    assert spec.flags == incidents.PACKING.spec("after").flags
    incidents.run_local(real_hub.endpoint, spec)
    return incidents.settled_window(real_hub.store, spec)


@pytest.fixture
def no_hub() -> Iterator[str]:
    """A loopback address where nothing listens and nothing can start to: the port stays
    bound (not listening) by this process until the test ends, so a connection attempt
    is refused. A port probed free, released and used later could meanwhile be taken by
    any other process, whose listener would then take the messages a test expects to be
    dropped."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{held.getsockname()[1]}"


# Tests that read the session-wide real runs above: one xdist worker makes them once.
_SHARED_RUNS = {"real_hub", "packing_baseline"}

# The groups that take longest (real torch jobs, many simulated runs), longest first, as
# measured on a loaded 2-core machine: xdist hands out groups in collection order, so
# these go first and the short ones fill the gaps at the end (longest first is close to
# the best split). A group missing here only runs later.
_LONGEST_FIRST = (
    "tests/test_torch_e2e.py",
    "shared-real-runs",
    "tests/test_real_faults.py",
    "tests/test_demo_command.py",
    "tests/test_launch_torch.py",
    "tests/test_ladder_tui.py",
    "tests/test_tui_controlled.py",
    "tests/test_capture_forms.py",
    "tests/test_real_workload.py",
    "tests/test_tui_discoverable.py",
    "tests/test_import_flight_recorder.py",
    "tests/test_stage.py",
    "tests/test_method_walk.py",
    "tests/test_tui_app.py",
)


def _group(item: pytest.Item) -> str:
    if _SHARED_RUNS & set(getattr(item, "fixturenames", ())):
        return "shared-real-runs"
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests for ``pytest-xdist --dist loadgroup`` (the suite's default): each
    module runs on one worker, so its module fixtures (most of them real or simulated runs)
    are made once; the tests reading the session's shared real runs run on one worker
    together; the longest groups are handed out first. Without xdist the marks do nothing
    and only the order changes (modules stay whole)."""
    rank = {g: i for i, g in enumerate(_LONGEST_FIRST)}
    groups = {id(item): _group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    items.sort(key=lambda item: rank.get(groups[id(item)], len(rank)))
