"""``rankscope.collector.shards``: the shard a rank reads under ``RANKSCOPE_SWAP_SHARDS``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import rankscope
from rankscope.collector.shards import SWAP_ENV, shard_of, swapped_shards

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_without_a_swap_every_rank_reads_its_own_shard() -> None:
    assert [shard_of(r, 4, env={}) for r in range(4)] == [0, 1, 2, 3]
    assert shard_of(3, env={SWAP_ENV: "  "}) == 3
    assert swapped_shards({}) is None


def test_a_swap_exchanges_exactly_the_two_ranks_shards() -> None:
    env = {SWAP_ENV: "3, 1"}
    assert swapped_shards(env, 4) == (3, 1)
    assert [shard_of(r, 4, env=env) for r in range(4)] == [0, 3, 2, 1]
    # The shards stay a permutation: no shard is read twice or dropped.
    assert sorted(shard_of(r, 8, env={SWAP_ENV: "7,0"}) for r in range(8)) == list(range(8))


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1", "not two ranks"),
        ("1,2,3", "not two ranks"),
        ("a,b", "not two ranks"),
        ("-1,2", "not two ranks"),
        ("1.0,2", "not two ranks"),
        ("2,2", "names rank 2 twice"),
        ("0,4", "outside the job's 4 ranks"),
    ],
)
def test_a_malformed_swap_names_the_variable_and_its_value(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as exc:
        shard_of(0, 4, env={SWAP_ENV: value})
    assert f"{SWAP_ENV}={value!r}" in str(exc.value)


def test_the_rank_must_be_a_rank() -> None:
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="rank must be"):
            shard_of(bad, env={})  # type: ignore[arg-type]


def test_shard_of_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWAP_ENV, "0,1")
    assert shard_of(0) == 1 and shard_of(1) == 0 and shard_of(2) == 2
    assert rankscope.shard_of is shard_of  # the public name


def test_the_example_job_stops_on_a_malformed_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    sys.path.insert(0, str(EXAMPLES))
    import faultjobs

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(SWAP_ENV, "0,2")
    # Before the process group: a bad swap never starts a job that would read as unswapped.
    with pytest.raises(SystemExit, match=f"{SWAP_ENV}='0,2' names rank 2, outside"):
        faultjobs.main(["--fault=data"])
    args = faultjobs.parse_args(["--fault=data", "--fault-rank=1", "--shard-scale=4"])
    assert [faultjobs.shard_rows(args, s) for s in (0, 1)] == [args.batch, 4 * args.batch]
