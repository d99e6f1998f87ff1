"""Long fuzz of every recording reader (issue 17 part 7), run by hand.

Writes random hostile recordings — a synthetic job whose messages are mutated with
extreme or ill-typed values, hand-written bad records, garbage, truncated and duplicated
messages, several hub sessions, flipped bytes and cut tails — directly with the recording
writer (no hub validation, as an older hub would have written them), and runs every reader
over each in-process: ``read_frames``, ``replay.load`` and the store's windows, the
follower, ``inspect_recording`` and, every ``--commands-every`` recordings, the commands
``inspect``, ``diagnose``, ``snapshot``, ``export``, ``ladder`` and ``rerun``
(`tests/hostile_records.py`). Any exception, or a traceback in a command's output or in
the log, is a failure: its recording is kept under ``--keep`` with the traceback.

Usage::

    python benchmarks/fuzz_readers.py --minutes 5 [--seed 1] [--commands-every 4]

Prints the recordings and records tried, the bad records the readers skipped and the
failures (0 is the only pass); exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hostile_records as hostile  # from tests/, put on the path above


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (5)")
    p.add_argument("--seed", type=int, default=None, help="first plan's seed (default: time)")
    p.add_argument(
        "--commands-every", type=int, default=4, help="run the commands on every Nth (4)"
    )
    p.add_argument("--keep", default="fuzz-failures", help="folder for failing recordings")
    args = p.parse_args(argv)
    seed0 = args.seed if args.seed is not None else int(time.time())
    end = time.monotonic() + 60 * args.minutes
    counts: collections.Counter[str] = collections.Counter()
    failures = 0
    kinds: collections.Counter[str] = collections.Counter()
    i = 0
    while time.monotonic() < end:
        seed = seed0 + i
        plan = hostile.random_plan(random.Random(seed))
        commands = args.commands_every > 0 and i % args.commands_every == 0
        i += 1
        path = Path(tempfile.mkdtemp(prefix="rs-fuzz-"))
        try:
            messages = hostile.build(path, plan)
            outcome = hostile.run_readers(path, commands=commands)
        except Exception as exc:  # the generator itself: not a reader failure, but say so
            print(f"seed {seed}: the generator failed: {exc!r}", file=sys.stderr)
            counts["generator_errors"] += 1
            shutil.rmtree(path, ignore_errors=True)
            continue
        counts["recordings"] += 1
        counts["with_commands"] += commands
        counts["messages_written"] += len(messages)
        counts["records_replayed"] += outcome.records
        counts["bad_records_skipped"] += outcome.bad_records
        counts["mutations"] += len(plan.mutations)
        counts["reader_runs"] += len(outcome.ran) + len(outcome.failures)
        kinds.update(m.kind for m in plan.mutations)
        if outcome.failures:
            failures += len(outcome.failures)
            keep = Path(args.keep) / f"seed-{seed}"
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(path, keep, dirs_exist_ok=True)
            text = "\n\n".join(f"== {name}\n{tb}" for name, tb in outcome.failures)
            (keep / "failures.txt").write_text(text)
            (keep / "plan.json").write_text(json.dumps(asdict(plan), default=repr, indent=1))
            print(f"seed {seed}: {len(outcome.failures)} failure(s), kept in {keep}")
            for name, tb in outcome.failures:
                print(f"  {name}: {tb.strip().splitlines()[-1]}")
        shutil.rmtree(path, ignore_errors=True)
    counts["tracebacks"] = failures
    print(
        json.dumps(
            {"seed": seed0, "minutes": args.minutes, **counts, "mutation_kinds": dict(kinds)},
            indent=1,
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
