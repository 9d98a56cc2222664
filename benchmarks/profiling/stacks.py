"""Where two runs' time differs, from py-spy's collapsed stacks (``guided_raw --py-spy``).

    python -m benchmarks.profiling.stacks py-spy-inproc.txt \
        --runs guided_run,unconstrained_run --out s.json

Only stacks that pass through a run's marker frame count (the benchmark calls each run through a
function of its own name), so other threads and the engine's start are left out. For every
function below the markers it prints the seconds spent inside it (inclusive, counted once per
stack) in each run and the difference, largest first: with both runs generating the same tokens,
that difference is what the first run costs more, and where.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def frames(stack: str) -> list[str]:
    """A stack's frames, outermost first, with line numbers dropped (a function is one row)."""
    return [_LINE.sub(")", f) for f in stack.split(";")]


def _name(frame: str) -> str:
    """``child.<locals>.guided_run (file)`` -> ``guided_run``."""
    return frame.partition(" (")[0].rpartition(".")[2]


def tally(path: Path, markers: list[str], rate_hz: float) -> dict[str, dict[str, float]]:
    """Seconds per function below each marker, and the marker's own total under ``"(all)"``."""
    out: dict[str, Counter[str]] = {m: Counter() for m in markers}
    with path.open(errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            fs = frames(stack)
            for m in markers:
                at = next((i for i, fr in enumerate(fs) if _name(fr) == m), None)
                if at is None:
                    continue
                below = fs[at + 1 :]
                out[m]["(all)"] += int(count)
                for fr in set(below):
                    out[m][fr] += int(count)
                if below:
                    out[m]["self: " + below[-1]] += int(count)
                break
    return {m: {k: v / rate_hz for k, v in c.items()} for m, c in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks", type=Path, help="py-spy record -f raw output")
    ap.add_argument("--runs", default="guided_run,unconstrained_run")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's sampling rate, Hz")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    markers = a.runs.split(",")
    if len(markers) != 2:
        ap.error("--runs takes two marker functions: A,B")
    seconds = tally(a.stacks, markers, a.rate)
    first, second = (seconds[m] for m in markers)
    if not first or not second:
        sys.exit(f"no stacks pass through {' and '.join(m for m in markers if not seconds[m])}")
    keys = set(first) | set(second)
    rows = sorted(
        ({"function": k, markers[0]: first.get(k, 0.0), markers[1]: second.get(k, 0.0)}
         for k in keys),
        key=lambda r: -(r[markers[0]] - r[markers[1]]),
    )  # fmt: skip
    for r in rows:
        r["difference"] = r[markers[0]] - r[markers[1]]
    print(f"| function | {markers[0]} s | {markers[1]} s | difference s |\n|---|---|---|---|")
    for r in rows[: a.top]:
        print(
            f"| {r['function'][:110]} | {r[markers[0]]:.2f} | {r[markers[1]]:.2f} | "
            f"{r['difference']:+.2f} |"
        )
    if a.out:
        a.out.write_text(json.dumps({"runs": markers, "rows": rows[: a.top * 5]}, indent=1))


if __name__ == "__main__":
    main()
