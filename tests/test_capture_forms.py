"""Zero-code capture of mesh coordinates, groups and pipeline ids, on a script written the
way torch's documentation writes it (``init_device_mesh`` bound at the top, before any
rankscope hook exists), run as 4 real gloo ranks under ``rankscope run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rankscope.collector import schema

SCRIPT = """
import json
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
pp = mesh["pp"].get_local_rank()
peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)
extra = dist.new_group([0, 1, 2, 3])
w = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(w.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(4, 8)
    for m in range(2):
        if pp == 0:
            dist.send(w(x).detach(), peer)
        else:
            buf = torch.empty(4, 8)
            dist.recv(buf, peer)
    w(x).sum().backward()
    for p in w.parameters():
        dist.all_reduce(p.grad, group=mesh.get_group("dp"))
    opt.step()
    opt.zero_grad()
# Test epilogue (not part of the form under test): what the collector captured.
from rankscope.collector import runtime, schema
mon = runtime.current()
c = mon._colls.unread()
st, mb = schema.pp_ids(c["flags"])
# One file per rank: lines printed by four processes into one pipe can interleave.
import os, pathlib
pathlib.Path(os.environ["FORMS_OUT"], f"rank{dist.get_rank()}.json").write_text(json.dumps({
  "rank": dist.get_rank(), "mesh": mon.identity.mesh,
  "groups": sorted((g["name"], g["ranks"]) for g in mon._groups_snapshot()[1]),
  "pp": sorted({(int(s), int(m)) for s, m in zip(st, mb) if s >= 0}),
  "pp_wait": int((mon._phases.unread()["phase"] == schema.PHASE_INDEX["pp_wait"]).sum())}))
dist.destroy_process_group()
"""


def test_pp_flag_bits_round_trip() -> None:
    flags = np.array(
        [
            schema.pp_flags(0, 0),
            schema.pp_flags(3, 17) | schema.FLAG_ASYNC,
            0,
            schema.pp_flags(-1, 2),
        ],
        dtype=np.int32,
    )
    stage, micro = schema.pp_ids(flags)
    assert stage.tolist() == [0, 3, -1, -1] and micro.tolist() == [0, 17, -1, 2]
    assert flags[1] & schema.FLAG_ASYNC and flags.min() >= 0


@pytest.fixture(scope="module")
def top_import_job(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    pytest.importorskip("torch")
    folder = Path(tmp_path_factory.mktemp("forms"))
    script = folder / "form_top.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env["FORMS_OUT"] = str(folder)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankscope",
            "run",
            "--job",
            "forms",
            "--",
            "torchrun",
            "--standalone",
            "--nproc_per_node=4",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
    assert len(got) == 4, out.stdout[-2000:] + out.stderr[-2000:]
    return {r["rank"]: r for r in got}


@pytest.mark.torch
@pytest.mark.slow  # the 4-rank job of the fixture: ~18 s in a busy suite
def test_mesh_bound_before_the_hooks_gives_every_coordinate_and_group(top_import_job) -> None:
    assert sorted(top_import_job) == [0, 1, 2, 3]
    for rank, r in top_import_job.items():
        # Mesh [[0, 1], [2, 3]] over (dp, pp): dp is the row, pp the column.
        assert r["mesh"] == {"dp": rank // 2, "pp": rank % 2}
        names = {name: ranks for name, ranks in r["groups"]}
        assert names["dp"] == [rank % 2, rank % 2 + 2]
        assert names["pp"] == [rank - rank % 2, rank - rank % 2 + 1]
        # The plain new_group is in the table too, with no mesh name.
        assert any(ranks == [0, 1, 2, 3] and name != "world" for name, ranks in r["groups"])


@pytest.mark.torch
@pytest.mark.slow
def test_explicit_pipeline_rows_carry_stage_and_micro_batch(top_import_job) -> None:
    for rank, r in top_import_job.items():
        stage = rank % 2
        # Rows the sender already shipped are not in the ring any more: what is left of the
        # last step(s) still names this stage and micro-batches 0 and 1 only.
        assert r["pp"] and {tuple(x) for x in r["pp"]} <= {(stage, 0), (stage, 1)}
        assert 1 <= r["pp_wait"] <= 6  # 2 blocking send/recv a step, 3 steps


FORMS_SCRIPT = """
import json, os, pathlib
import torch
import torch.distributed as dist

form = os.environ["FORM"]
dist.init_process_group("gloo")
rank = dist.get_rank()
if form == "direct":
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    a, b = mesh["tp"].get_group(), mesh.get_group("dp")
elif form == "flatten":
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    a = mesh["dp_shard"].get_group()
    b = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
elif form == "new_group":
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    a, b = rows[rank // 2], cols[rank % 2]
else:
    raise SystemExit(f"unknown form {form}")
for step in range(3):
    x = torch.ones(16)
    dist.all_reduce(x, group=a)
    dist.all_reduce(x, group=b)
    dist.barrier()
# Test epilogue (not part of the form under test): what the collector captured.
from rankscope.collector import runtime, schema
mon = runtime.current()
c = mon._colls.unread()
groups = {g["id"]: (g["name"], g["ranks"]) for g in mon._groups_snapshot()[1]}
rows = [groups.get(int(g), ("?", [])) for g, op in zip(c["group"], c["op"])
        if op == schema.OP_INDEX["all_reduce"]]
pathlib.Path(os.environ["FORMS_OUT"], f"rank{rank}.json").write_text(json.dumps({
  "rank": rank, "mesh": mon.identity.mesh, "rows": rows,
  "groups": sorted((name, ranks) for name, ranks in groups.values())}))
dist.destroy_process_group()
"""

FORMS = ("direct", "flatten", "new_group")


def _forms_job(folder: Path, form: str) -> dict[int, dict]:
    script = folder / "forms.py"
    script.write_text(FORMS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
    env |= {"FORMS_OUT": str(folder), "FORM": form}
    argv = [sys.executable, "-m", "rankscope", "run", "--job", f"forms-{form}", "--"]
    argv += ["torchrun", "--standalone", "--nproc_per_node=4", str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
    assert len(got) == 4, out.stdout[-2000:] + out.stderr[-2000:]
    return {r["rank"]: r for r in got}


def _row_of(rank: int) -> list[int]:
    return [rank - rank % 2, rank - rank % 2 + 1]


def _column_of(rank: int) -> list[int]:
    return [rank % 2, rank % 2 + 2]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_every_script_form_gives_coordinates_and_groups(form: str, tmp_path: Path) -> None:
    """The same 2 x 2 layout built three more ways: a ``DeviceMesh`` constructed
    directly and sliced, HSDP-style dimensions flattened into one, and plain
    ``new_group`` calls with no mesh. Each rank's coordinates, and the group every
    all-reduce row names, follow from the layout alone."""
    pytest.importorskip("torch")
    got = _forms_job(tmp_path, form)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, r in got.items():
        if form == "direct":
            # Mesh [[0, 1], [2, 3]] over (dp, tp): dp is the row, tp the column.
            assert r["mesh"] == {"dp": rank // 2, "tp": rank % 2}, r
            expected = [["tp", _row_of(rank)], ["dp", _column_of(rank)]]
        elif form == "flatten":
            # dp_replicate and dp_shard are both data parallel: one dp coordinate, in
            # mesh order (replicate major), i.e. the rank itself on this mesh.
            assert r["mesh"] == {"dp": rank}, r
            assert [name for name, _ in r["rows"][:2]] == ["dp_shard", "dp"], r["rows"]
            expected = [["dp_shard", _row_of(rank)], ["dp", [0, 1, 2, 3]]]
        else:
            # No mesh: no coordinate is made up, and each row names its own group.
            assert not any(v >= 0 for v in (r["mesh"] or {}).values()), r
            expected = [[r["rows"][0][0], _row_of(rank)], [r["rows"][1][0], _column_of(rank)]]
        # Three steps of (a, b): every all-reduce row names the group it ran on.
        assert len(r["rows"]) >= 6, r["rows"]
        assert [list(x) for x in r["rows"][:6]] == expected * 3, r["rows"]
