"""Sum a py-spy raw profile (``--subprocesses --gil --format raw``) by process and by stack.

    python3 -m benchmarks.profiling.gil_profile gil.txt [--top 8] [--depth 3] [--by-thread]

With ``--gil`` a sample is taken only from the thread holding its process's GIL, so a process's
samples over the recording's ``rate x duration`` say how busy its interpreter was, and its top
stacks say with what. A recording with ``--idle --threads`` (every thread, waiting included) of
one worker process is summed by thread with ``--by-thread``, which says where Celery's consumer
thread and vLLM's loop thread spend their wall clock.
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--depth", type=int, default=3, help="innermost frames that name a stack")
    ap.add_argument("--by-thread", action="store_true", help="group by process and thread")
    a = ap.parse_args()
    totals: collections.Counter[str] = collections.Counter()
    stacks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(a.path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            parts = stack.split(";")
            procs = [p for p in parts if p.startswith("process ")]
            threads = [p for p in parts if p.lower().startswith("thread ")]
            named = ("process ", "thread ")
            frames = [p.split(" (")[0] for p in parts if not p.lower().startswith(named)]
            proc = (procs[-1] if procs else "?")[:100]
            if a.by_thread:
                proc += " " + (threads[0] if threads else "?")[:40]
            totals[proc] += int(count)
            stacks[proc][";".join(frames[-a.depth :])] += int(count)
    for proc, n in totals.most_common():
        print(f"{n:7d}  {proc}")
        for key, m in stacks[proc].most_common(a.top):
            print(f"{m:9d}  {key}")


if __name__ == "__main__":
    main()
