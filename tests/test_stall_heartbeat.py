"""Heartbeats: the wire kind, the hub's strict checks, and the hang judge on known cases."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from rankscope.collector import schema
from rankscope.collector.heartbeat import inside_collective
from rankscope.collector.stacks import python_stacks
from rankscope.diagnosis.stall import STALL_S, judge_hang, stall_threshold_s
from rankscope.hub.intake import Intake
from rankscope.hub.store import Store

S = 1_000_000_000
HEADER = {"job": "j", "run": "r", "rank": 0, "inc": 0, "batch": 1}
POS = {k: -1 for k in schema.BEAT_POS_FIELDS}


def _hello(rank: int, world: int = 2) -> bytes:
    ident = {
        "rank": rank,
        "world_size": world,
        "local_rank": rank,
        "host": "h",
        "node_rank": 0,
        "pid": 1,
    }
    return schema.hello_message({**HEADER, "rank": rank}, ident)


def _intake() -> tuple[Store, Intake]:
    store = Store()
    intake = Intake(store)
    for r in range(2):
        assert intake.feed(_hello(r))
    return store, intake


def test_a_beat_round_trips_and_lands_in_the_run():
    store, intake = _intake()
    pos = {**POS, "t": 5 * S, "step": 3, "group": 0, "seq": 7, "op": 0, "since": 4 * S}
    data = schema.beat_message({**HEADER, "rank": 1}, pos, stacks={"py": "x", "why": "y"})
    assert intake.feed(data, t_recv_ns=6 * S)
    beats = store.run_state("r").beats
    assert beats.count == 1 and beats.pos[1][schema.BEAT_POS_FIELDS.index("seq")] == 7
    assert beats.heard_ns[1] == 6 * S and beats.stacks[1]["py"] == "x"
    assert len(data) < 300  # the wire cost the heartbeat module states (~190 B)


def _raw(**fields) -> bytes:
    msg = {**HEADER, "kind": "beat", "v": schema.SCHEMA_VERSION, "pos": dict(POS), **fields}
    return msgpack.packb(msg, use_bin_type=True)


@pytest.mark.parametrize(
    "fields",
    [
        {"pos": "nope"},
        {"pos": {**POS, "step": "3"}},
        {"pos": {**POS, "seq": -5}},
        {"pos": {**POS, "op": len(schema.OPS)}},
        {"pos": {**POS, "t": 2**63 - 1}},
        {"pos": {**POS, "group": True}},
        {"state": "zombie"},
        {"stacks": {"py": "x" * (schema.MAX_STACK_CHARS + 1)}},
        {"stacks": {"evil": "x"}},
        {"stacks": {"py": 3}},
        {"stacks": ["py"]},
        {"pos": {f"k{i}": 0 for i in range(100)}},
    ],
)
def test_a_hostile_beat_is_refused_and_counted(fields):
    store, intake = _intake()
    assert not intake.feed(_raw(**fields))
    rejects = store.health["rejects"]
    assert sum(rejects.values()) == 1 and set(rejects) <= {"bad_beat", "bad_type"}, rejects
    assert store.run_state("r").beats.count == 0


def test_a_beat_before_hello_is_refused():
    store = Store()
    assert not Intake(store).feed(schema.beat_message(HEADER, dict(POS)))
    assert store.health["rejects"].get("unknown_rank") == 1


def test_stacks_are_held_for_a_bounded_number_of_ranks():
    from rankscope.hub.runstate import MAX_STACK_RANKS, Beats

    b = Beats(1000)
    for r in range(MAX_STACK_RANKS + 10):
        b.add(r, {"pos": POS, "stacks": {"py": "s"}}, r)
    assert len(b.stacks) == MAX_STACK_RANKS and min(b.stacks) == 10


def _beats(n: int, now: int, **cols) -> dict[str, np.ndarray]:
    out = {k: np.full(n, -1, np.int64) for k in schema.BEAT_POS_FIELDS}
    out["heard_ns"] = np.full(n, now - S // 2, np.int64)
    out["state"] = np.ones(n, np.int8)
    out["run_group"] = np.full(n, -1, np.int64)
    for k, v in cols.items():
        out[k] = np.asarray(v, out[k].dtype if k in out else np.int64)
    return out


GROUPS = {0: ((0, 1, 2, 3), "world"), 1: ((0, 1, 2, 3), "side")}
NOW = 1000 * S
STEPS = np.full(20, 0.1 * S)


def test_not_entered_names_the_rank_outside_and_what_the_others_wait_in():
    inside = [0, -1, 0, 0]
    b = _beats(4, NOW, step=[5] * 4, step_t0=[NOW - 30 * S] * 4, group=inside, seq=[9, -1, 9, 9],
               op=[0, -1, 0, 0], since=[NOW - 20 * S, -1, NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    h = judge_hang(b, NOW, STEPS, GROUPS, {1: "node7"})
    assert h.stalled and h.case == "not_entered"
    assert [(c.rank, c.host, c.group, c.seq, c.op) for c in h.culprits] == [
        (1, "node7", 0, 9, "all_reduce")
    ]
    assert [w.where for w in h.waiting] == [
        "in world:all_reduce#9", "step 5, outside collectives", "in world:all_reduce#9", "in world:all_reduce#9",
    ]  # fmt: skip


def test_a_silent_rank_is_gone_and_a_closing_beat_is_exit():
    b = _beats(4, NOW, step=[5] * 4, group=[0, -1, 0, 0], seq=[9, -1, 9, 9], op=[0, -1, 0, 0],
               since=[NOW - 20 * S, -1, NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    b["heard_ns"][1] = NOW - 30 * S
    h = judge_hang(b, NOW, STEPS, GROUPS)
    assert h.stalled and [(c.rank, c.case, c.seq) for c in h.culprits] == [(1, "gone", 9)]
    b["heard_ns"][1] = NOW
    b["state"][1] = 2
    h = judge_hang(b, NOW, STEPS, GROUPS)
    assert [(c.rank, c.case) for c in h.culprits] == [(1, "gone")] and "exited" in h.culprits[
        0
    ].detail


def test_a_rank_that_left_by_an_error_inside_a_collective_is_not_the_culprit():
    b = _beats(2, NOW, step=[5, 5], step_t0=[NOW - 30 * S] * 2, state=[2, 2], run_group=[0, -1])
    b["error"] = np.array([1, 0], np.int8)
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")})
    assert h.stalled and [(c.rank, c.case) for c in h.culprits] == [(1, "gone")]
    b["error"][:] = 0  # every rank closed without an error: the job finished
    assert not judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")}).stalled


def test_mismatch_names_the_rank_that_went_past():
    # Rank 1 skipped world#9 in step 5 and waits in side#4 of step 6; rank 0 waits in world#9.
    b = _beats(2, NOW, step=[5, 6], group=[0, 1], seq=[9, 4], op=[0, 0],
               since=[NOW - 20 * S, NOW - 20 * S])  # fmt: skip
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world"), 1: ((0, 1), "side")})
    assert h.stalled and [(c.rank, c.case, c.group, c.seq) for c in h.culprits] == [
        (1, "mismatch", 0, 9)
    ]


def test_every_member_inside_is_a_transfer_hang():
    b = _beats(2, NOW, step=[5, 5], group=[0, 0], seq=[9, 9], op=[0, 0], since=[NOW - 20 * S] * 2)
    h = judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")})
    assert h.stalled and h.case == "in_transfer" and [c.rank for c in h.culprits] == [0, 1]


def test_no_stall_within_what_the_steps_make_plausible():
    since = [NOW - 20 * S, -1]
    b = _beats(2, NOW, step=[5, 5], group=[0, -1], seq=[9, -1], op=[0, -1], since=since)
    assert judge_hang(b, NOW, STEPS, {0: ((0, 1), "world")}).stalled
    slow = np.full(20, 15.0 * S)  # 15 s steps: 20 s without progress is not yet a stall
    h = judge_hang(b, NOW, slow, {0: ((0, 1), "world")})
    assert not h.stalled and h.culprits == () and h.threshold_s == 30.0
    assert stall_threshold_s(np.zeros(0)) == STALL_S


def test_ranks_all_busy_outside_collectives_are_not_hung():
    b = _beats(2, NOW, step=[0, 0], step_t0=[NOW - 60 * S] * 2)
    assert not judge_hang(b, NOW, np.zeros(0), {0: ((0, 1), "world")}).stalled


def test_the_heartbeat_finds_the_collective_a_thread_is_inside():
    pytest.importorskip("torch")
    from rankscope.collector import torch_collectives

    inside = threading.Event()
    release = threading.Event()

    def fn(tensor, op=None, group=None, async_op=False):
        inside.set()
        release.wait(10)

    wrapped = torch_collectives._wrap(fn, "all_reduce", "tensor", torch_collectives._T)
    state = torch_collectives._state
    old = state.mon

    class Quiet:  # a monitor that records nothing
        def _rec_coll(self, *a):
            return -1

        def _error(self, *a):
            pass

    state.mon = Quiet()
    try:
        t = threading.Thread(target=wrapped, args=(np.zeros(4),))
        t.start()
        assert inside.wait(10)
        import sys

        got = inside_collective(sys._current_frames()[t.ident])
        text = python_stacks(first=t.ident)
        release.set()
        t.join(10)
    finally:
        state.mon = old
        release.set()
    assert got is not None and got[0] == schema.OP_INDEX["all_reduce"] and got[1] == 0
    assert got[2] <= time.monotonic_ns()
    assert "training thread" in text and "in fn" in text


# -- the hang bundle: a snapshot bundle with a hang/ part ---------------------------------


def _hung_store(tmp_path, fr: dict | None = None):
    """A 4-rank simulated run, recorded, whose rank 2 stopped outside collectives while the
    others wait in the world group's next all-reduce; each rank sent its stacks (and the
    Flight Recorder dumps in ``fr``, rank -> JSON text)."""
    from rankscope.hub.recording import RecordingWriter
    from rankscope.sim import load_scenario
    from rankscope.sim.emit import iter_messages

    t0 = 1_700_000_000 * S
    msgs = iter_messages(load_scenario("healthy", ranks=4, seed=3), 12, run_id="hung", t0_ns=t0)
    store = Store()
    rec = RecordingWriter(tmp_path / "rec")
    intake = Intake(store, rec)
    for m in msgs:
        assert intake.feed(m, t_recv_ns=t0 + 60 * S)
    run = store.run_state("hung")
    gid = min(int(g) for g in run.groups)
    now = t0 + 120 * S
    job = run.job
    for r in range(4):
        inside = r != 2
        pos = {**POS, "t": now - S, "step": 12, "step_t0": now - 40 * S, "ended": 11,
               "ended_t": now - 40 * S, "group": gid if inside else -1, "seq": 50 if inside else -1,
               "op": 0 if inside else -1, "since": now - 30 * S if inside else -1}  # fmt: skip
        stacks = {
            "py": f"Thread MainThread (training thread):\n  in rank{r}_frame\n",
            "why": "stuck",
        }
        if fr and r in fr:
            stacks["fr"] = fr[r]
        head = {"job": job, "run": "hung", "rank": r, "inc": 0, "batch": 99}
        assert intake.feed(schema.beat_message(head, pos, stacks=stacks), t_recv_ns=now - S)
    rec.flush()
    return store, rec, now


def test_the_hang_bundle_is_a_snapshot_bundle_with_the_stall_first(tmp_path):
    import subprocess
    import sys

    from rankscope.hub.hang import HangWatch
    from rankscope.snapshot import open_snapshot

    store, rec, now = _hung_store(tmp_path)
    watch = HangWatch(store, tmp_path / "b", clock=lambda: now, recording=tmp_path / "rec",
                      flush=rec.flush)  # fmt: skip
    got = watch.check()["hung"]
    assert got.hang.stalled and [c.rank for c in got.hang.culprits] == [2], got.hang
    assert got.bundle is not None
    root = tmp_path / "b" / got.bundle.split("/")[-1]
    assert (root / "hang" / "verdict.json").exists() and (root / "window").is_dir()
    assert "rank2_frame" in (root / "hang" / "stacks-r2.txt").read_text()
    content = json.loads((root / "snapshot.json").read_text())
    assert [c["rank"] for c in content["hang"]["verdict"]["culprits"]] == [2]
    assert content["view"]["pins"] == [2] and content["files"]["stacks:r2"] == "hang/stacks-r2.txt"
    assert content["hang"]["diagnosis_note"] is None and content["diagnosis"]["verdict"]
    # No rank enabled a Flight Recorder: the text says how to.
    assert "TORCH_FR_BUFFER_SIZE" in (root / "hang" / "flight_recorder").read_text()
    md = (root / "snapshot.md").read_text()
    assert md.index("## Stall") < md.index("## Verdict")
    assert "culprit **rank 2**" in md and "case **not_entered**" in md
    assert "[stacks-r2.txt](hang/stacks-r2.txt)" in md
    opened = open_snapshot(root)
    assert opened.recording is not None and opened.view.pins == (2,)
    out = subprocess.run([sys.executable, "-m", "rankscope", "report", str(root), "--width", "160"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "STALLED" in out.stdout and "culprit rank 2" in out.stdout, out.stdout[:3000]
    # The window's recording holds each rank's latest beat: the judge reads it the same.
    diag = subprocess.run([sys.executable, "-m", "rankscope", "diagnose", str(root / "window"),
                           "--json"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert diag.returncode == 0, diag.stderr
    assert json.loads(diag.stdout)["stall"]["culprits"] == [2]


def _fr_dump(rank: int, entered: int) -> str:
    """A Flight Recorder JSON dump (torch 2.13's fields) of a rank that issued ``entered``
    all-reduces on the world group, the last one unfinished when it did not reach 4."""
    entries = [
        {"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"],
         "collective_seq_id": i + 1, "p2p_seq_id": 0, "op_id": i + 1,
         "profiling_name": "gloo:all_reduce", "time_created_ns": (100 + i) * S,
         "input_sizes": [[256]], "input_dtypes": ["Float"], "output_sizes": [[256]],
         "output_dtypes": ["Float"], "state": "scheduled", "time_discovered_started_ns": 0,
         "time_discovered_completed_ns": 0, "retired": i < 3, "timeout_ms": 600000,
         "is_p2p": False}
        for i in range(entered)
    ]  # fmt: skip
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    return json.dumps({"version": "2.10", "pg_config": cfg, "pg_status": {}, "entries": entries})


def test_the_bundle_holds_each_flight_recorder_dump_and_the_import_names_the_missing_rank(
    tmp_path,
):
    from rankscope.hub.hang import HangWatch
    from rankscope.hub.importers import write_recording
    from rankscope.hub.importers.flight_recorder import load_dump

    fr = {r: _fr_dump(r, 3 if r == 2 else 4) for r in range(4)}
    fr[1] = '{"entries": [], "rankscope_note": "the Flight Recorder holds no entry yet"}'
    store, _, now = _hung_store(tmp_path, fr=fr)
    got = HangWatch(store, tmp_path / "b", clock=lambda: now).check()["hung"]
    part = tmp_path / "b" / got.bundle.split("/")[-1] / "hang"
    folder = part / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0.json", "rank_2.json", "rank_3.json"]
    assert len(load_dump(folder / "rank_0.json")["entries"]) == 4
    rep = write_recording("flight-recorder", [str(folder)], tmp_path / "imp", run="fr")
    assert rep.problems == [] and rep.ranks == 3
    hang = rep.details["hang"]
    assert [h["never_entered"] for h in hang] == [[2]] and hang[0]["seq"] == 4
    assert hang[0]["not_dumped"] == [1]
    md = (part.parent / "snapshot.md").read_text()
    assert "[rank_2.json](hang/flight_recorder/rank_2.json)" in md
    assert "rank 1: the Flight Recorder holds no entry yet" in md
    content = json.loads((part.parent / "snapshot.json").read_text())
    assert "window" not in content["files"]  # the hub was not recording: the bundle says so
    assert content["window"]["note"] == "the hub was not recording"


def test_a_failed_or_slow_diagnosis_leaves_the_evidence_and_says_why(tmp_path, monkeypatch):
    import rankscope.diagnosis.engine as engine
    from rankscope.commands.report import renderables
    from rankscope.hub.hang import HangWatch

    store, _, now = _hung_store(tmp_path)

    def boom(window, baseline=None):
        raise ValueError("no complete step in the window")

    monkeypatch.setattr(engine, "diagnose", boom)
    got = HangWatch(store, tmp_path / "b", clock=lambda: now).check()["hung"]
    root = tmp_path / "b" / got.bundle.split("/")[-1]
    content = json.loads((root / "snapshot.json").read_text())
    assert "failed (ValueError: no complete step" in content["hang"]["diagnosis_note"]
    assert "no complete step" in (root / "snapshot.md").read_text()
    assert (root / "hang" / "stacks-r2.txt").exists()
    assert renderables(content)  # rankscope report draws it
    release = threading.Event()

    def slow(window, baseline=None):
        release.wait(30)
        raise ValueError("late")

    monkeypatch.setattr(engine, "diagnose", slow)
    watch = HangWatch(store, tmp_path / "c", clock=lambda: now, diagnosis_budget_s=0.2)
    try:
        got = watch.check()["hung"]
    finally:
        release.set()
    content = json.loads((Path(got.bundle) / "snapshot.json").read_text())
    assert "did not finish within 0.2 s" in content["hang"]["diagnosis_note"]


def test_a_snapshot_that_cannot_be_written_leaves_hang_and_a_note(tmp_path, monkeypatch):
    import rankscope.snapshot as snapshot
    from rankscope.hub.hang import HangWatch

    store, _, now = _hung_store(tmp_path)

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(snapshot, "take_snapshot", broken)
    got = HangWatch(store, tmp_path / "b", clock=lambda: now).check()["hung"]
    root = Path(got.bundle)
    md = (root / "snapshot.md").read_text()
    assert "culprit **rank 2**" in md and "disk full" in md
    assert (root / "hang" / "verdict.json").exists() and (root / "manifest.json").exists()


@pytest.mark.parametrize(
    "fr",
    [3, "x" * (schema.MAX_FR_CHARS + 1), "not json", '["a list"]'],
)
def test_a_hostile_flight_recorder_dump_is_refused_as_bad_fr(fr):
    store, intake = _intake()
    assert not intake.feed(_raw(stacks={"py": "x", "fr": fr}))
    assert store.health["rejects"] == {"bad_fr": 1}
    assert intake.feed(_raw(stacks={"py": "x", "fr": '{"entries": []}'}))


def test_a_long_dump_is_cut_to_its_newest_entries_and_still_reads(tmp_path):
    from rankscope.collector.stacks import fit_dump
    from rankscope.hub.importers.flight_recorder import load_dump

    big = json.loads(_fr_dump(0, 4))
    one = big["entries"][0]
    big["entries"] = [{**one, "record_id": i, "collective_seq_id": i + 1} for i in range(5000)]
    raw = json.dumps(big)
    cut = fit_dump(raw, limit=64 * 1024)
    assert len(raw) > 64 * 1024 >= len(cut)
    (tmp_path / "rank_0.json").write_text(cut)
    doc = load_dump(tmp_path / "rank_0.json")
    kept = doc["entries"]
    assert 0 < len(kept) < 5000 and kept[-1]["collective_seq_id"] == 5000
    assert f"newest {len(kept)} of 5000 entries" in doc["rankscope_note"]
    small = _fr_dump(0, 4)
    assert fit_dump(small) == small  # one that fits is sent as torch wrote it


def test_no_flight_recorder_dump_unless_the_job_enabled_one(monkeypatch):
    import subprocess
    import sys

    from rankscope.collector import stacks

    for name in stacks.FR_ENV:
        monkeypatch.delenv(name, raising=False)
    assert stacks.flight_recorder_dump() is None
    # Enabled in the environment, but torch.distributed never loaded: nothing is imported.
    code = (
        "import os, sys; os.environ['TORCH_FR_BUFFER_SIZE'] = '100'\n"
        "from rankscope.collector.stacks import flight_recorder_dump\n"
        "print(flight_recorder_dump(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["None", "False"], out.stderr


def test_a_run_hung_in_its_first_step_still_gets_a_snapshot_bundle(tmp_path):
    from rankscope.commands.report import renderables
    from rankscope.hub import replay
    from rankscope.hub.hang import HangWatch, judge_run
    from rankscope.hub.recording import RecordingWriter
    from rankscope.snapshot import load_snapshot

    store = Store()
    rec = RecordingWriter(tmp_path / "rec")
    intake = Intake(store, rec)
    now = 1_700_000_000 * S
    for r in range(2):
        assert intake.feed(_hello(r), t_recv_ns=now - 60 * S)
    world = [{"id": 0, "name": "world", "ranks": [0, 1], "backend": "gloo"}]
    assert intake.feed(schema.groups_message(HEADER, world), t_recv_ns=now - 60 * S)
    for r in range(2):
        inside = r == 0
        pos = {**POS, "t": now - S, "step": 0, "step_t0": now - 40 * S,
               "group": 0 if inside else -1, "seq": 1 if inside else -1,
               "op": 0 if inside else -1, "since": now - 30 * S if inside else -1}  # fmt: skip
        beat = schema.beat_message({**HEADER, "rank": r}, pos, stacks={"py": f"r{r}", "why": "y"})
        assert intake.feed(beat, t_recv_ns=now - S)
    rec.flush()
    watch = HangWatch(store, tmp_path / "b", clock=lambda: now, recording=tmp_path / "rec")
    got = watch.check()["r"]
    assert [c.rank for c in got.hang.culprits] == [1] and watch.errors == 0
    content, folder = load_snapshot(got.bundle)
    assert content["window"]["n_steps"] == 0 and "no step was complete" in str(
        content["hang"]["diagnosis_note"]
    )
    assert renderables(content)
    again = replay.load(folder / "window")
    assert judge_run(again, "r", now).culprits[0].rank == 1


@pytest.mark.torch
@pytest.mark.slow  # a torch process with a gloo group: ~18 s on a loaded machine
def test_a_process_with_a_flight_recorder_dumps_it_as_json(tmp_path):
    import subprocess
    import sys

    pytest.importorskip("torch")
    from rankscope.hub.importers.flight_recorder import load_dump

    code = (
        "import os, socket, sys\n"
        "os.environ['TORCH_FR_BUFFER_SIZE'] = '50'\n"
        "import torch, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0,"
        " world_size=1)\n"
        "t = torch.ones(8)\n"
        "for _ in range(60):\n"
        "    dist.all_reduce(t)\n"
        "from rankscope.collector.stacks import flight_recorder_dump\n"
        "sys.stdout.write(flight_recorder_dump(limit=8 * 1024))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (tmp_path / "rank_0.json").write_text(out.stdout)
    doc = load_dump(tmp_path / "rank_0.json")
    entries = doc["entries"]
    assert len(out.stdout) <= 8 * 1024 and 0 < len(entries) < 50  # the ring keeps 50
    assert entries[-1]["profiling_name"] == "gloo:all_reduce"
    assert entries[-1]["collective_seq_id"] == 60
    assert "newest" in doc["rankscope_note"]
