"""Run every benchmark and write benchmarks/RESULTS.md.

    python benchmarks/run.py            # full run
    python benchmarks/run.py --quick    # smaller sizes, for a quick look
    python benchmarks/run.py hub sim    # only these sections

Each ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> str | None`` returning a Markdown
section. Figures inside one section are measured in the same run and compared as ratios;
absolute numbers depend on this machine, which the header names. Sections not re-run keep
their previous text, as does a section whose ``run`` returns None (nothing this machine can
measure: ``gpu`` without a CUDA device), and the ``rankscope eval`` section (between its
markers) is left alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import platform
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
ORDER = [
    "collector",
    "hub",
    "hostile",
    "sim",
    "relay",
    "diagnosis",
    "robustness",
    "detection",
    "quiet",
    "tui",
    "real",
    "import",
    "gpu",
]


def machine() -> str:
    """One line naming the machine the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, Python {platform.python_version()}, {platform.system()}"


def _sections(text: str) -> dict[str, str]:
    found = {}
    for m in re.finditer(r"<!-- bench:(\w+):begin -->\n(.*?)<!-- bench:\1:end -->", text, re.S):
        found[m.group(1)] = m.group(2)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("names", nargs="*", help=f"sections to run (default: all of {ORDER})")
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    args = ap.parse_args(argv)
    names = args.names or ORDER
    sys.path.insert(0, str(HERE))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fresh: dict[str, str] = {}
    for name in names:
        mod = importlib.import_module(f"bench_{name}")
        print(f"== {name}", flush=True)
        got = mod.run(quick=args.quick)
        if got is None:  # nothing this machine can measure (no GPU): the section stays
            print(f"{name}: not measured here; its section is kept", flush=True)
            continue
        body = got.rstrip() + "\n"
        fresh[name] = (
            f"_Measured {stamp} on {machine()}{' (quick)' if args.quick else ''}._\n\n{body}"
        )
        print(body, flush=True)
    # Read the file only now: a long run must not put back sections that another run
    # (or `rankscope eval`) rewrote meanwhile.
    old = RESULTS.read_text() if RESULTS.exists() else ""
    sections = {**_sections(old), **fresh}
    eval_block = re.search(r"<!-- eval:begin -->.*?<!-- eval:end -->", old, re.S)
    out = [
        "# Benchmark results",
        "",
        "Written by `python benchmarks/run.py`; each section names its machine and date.",
        "",
    ]
    for name in [*ORDER, *sorted(set(sections) - set(ORDER))]:
        if name in sections:
            out += [
                f"<!-- bench:{name}:begin -->",
                sections[name].rstrip(),
                f"<!-- bench:{name}:end -->",
                "",
            ]
    out.append(
        eval_block.group(0)
        if eval_block
        else "<!-- eval:begin -->\n_`rankscope eval` has not been run yet._\n<!-- eval:end -->"
    )
    RESULTS.write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
