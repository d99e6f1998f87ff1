"""Flight Recorder import: real gloo dumps written by torch (``_dump_fr_trace`` and
``_dump_fr_trace_json``) of a 2-rank job where rank 1 never enters the last all-reduce,
the restricted unpickler, bad files, and the hang in ``rankscope diagnose``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rankscope.hub.importers import ImportReport, write_recording
from rankscope.hub.importers.flight_recorder import DumpError, load_dump

torch = pytest.importorskip("torch")

WORKER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    rank, out, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["TORCH_FR_BUFFER_SIZE"] = "200"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(256)
    for _ in range(12):
        dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.empty(512), t)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # rank 1 never enters this one
    import time
    # Dumped past the stall judge's floor (6 s without progress), as a watchdog dumps at
    # its timeout: a dump taken at once shows no stall yet.
    time.sleep(7)
    import torch._C._distributed_c10d as c
    with open(os.path.join(out, f"rank_{rank}.pkl"), "wb") as f:
        f.write(c._dump_fr_trace())
    with open(os.path.join(out, f"json_rank_{rank}.json"), "wb") as f:
        f.write(c._dump_fr_trace_json())
    open(os.path.join(out, f"done{rank}"), "w").close()
    import time
    deadline = time.monotonic() + 60
    # Neither process leaves before both dumped: a closed peer would end the pending work.
    while not os.path.exists(os.path.join(out, f"done{1 - rank}")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fr")
    script = out / "worker.py"
    script.write_text(WORKER)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(out), str(port)], env=env)
        for r in (0, 1)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return out


def test_real_gloo_dump_pickle_and_json_agree(dumps: Path) -> None:
    pk = load_dump(dumps / "rank_0.pkl")
    js = load_dump(dumps / "json_rank_0.json")
    assert pk["version"] == js["version"]
    assert len(pk["entries"]) == len(js["entries"]) == 14
    last = pk["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["collective_seq_id"] == 14
    assert not last["retired"]


def _import(dumps: Path, pattern: str, tmp_path: Path) -> tuple[ImportReport, Path]:
    rec = tmp_path / "rec"
    rep = write_recording("flight-recorder", [str(dumps / pattern)], rec, job="j", run="r")
    return rep, rec


@pytest.mark.parametrize("pattern", ["rank_*.pkl", "json_rank_*.json"])
def test_import_names_the_rank_that_never_entered(
    dumps: Path, tmp_path: Path, pattern: str
) -> None:
    rep, rec = _import(dumps, pattern, tmp_path)
    assert rep.problems == []
    assert rep.ranks == 2 and rep.colls == 14 + 13
    hang = rep.details["hang"]
    assert len(hang) == 1
    assert hang[0]["seq"] == 14
    assert hang[0]["entered_not_finished"] == [0]
    assert hang[0]["never_entered"] == [1]
    assert any("steps" in lack for lack in rep.lacks)
    if pattern.endswith(".json"):
        return  # same rows as the pickle's: diagnose is run once
    res = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(rec), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["stall"]["stalled"] is True
    assert out["stall"]["culprits"] == [1]
    culprit = out["stall"]["hang"]["culprits"][0]
    assert culprit["rank"] == 1 and culprit["seq"] == 14 and culprit["op"] == "all_reduce"
    text = subprocess.run(
        [sys.executable, "-m", "rankscope", "diagnose", str(rec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "STALLED" in text.stdout and "culprit rank 1" in text.stdout


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("echo pwned",))


def test_pickle_with_a_global_is_refused_and_the_rest_imported(dumps: Path, tmp_path: Path) -> None:
    evil = tmp_path / "in" / "rank_1.pkl"
    evil.parent.mkdir()
    evil.write_bytes(pickle.dumps({"entries": [_Boom()]}))
    with pytest.raises(DumpError, match="refused global"):
        load_dump(evil)
    (tmp_path / "in" / "rank_0.pkl").write_bytes((dumps / "rank_0.pkl").read_bytes())
    (tmp_path / "in" / "rank_2.pkl").write_bytes((dumps / "rank_1.pkl").read_bytes()[:100])
    (tmp_path / "in" / "rank_3.json").write_text('{"version": "2.10"}')
    rep = write_recording("flight-recorder", [tmp_path / "in"], tmp_path / "rec", run="r")
    why = dict(rep.problems)
    assert "refused global" in why[str(evil)]
    assert "truncated or corrupt" in why[str(tmp_path / "in" / "rank_2.pkl")]
    assert "no 'entries' list" in why[str(tmp_path / "in" / "rank_3.json")]
    assert rep.files_read == [str(tmp_path / "in" / "rank_0.pkl")] and rep.colls == 14
