"""A sampling profiler for every process of a benchmark run: the worker, its urgent process,
vLLM's engine core, and the raw engines beside them.

py-spy cannot attach on the lent GPU machine, so each process samples itself: a thread reads
``sys._current_frames()`` every ``VQUEUE_BENCH_PROFILE_MS`` (default 10 ms) while the file
``$VQUEUE_BENCH_PROFILE_DIR/on`` exists (its text names the part of the run: files go to a
folder of that name), and charges each thread's stack with the CPU time that
thread used since the last sample (its own clock, ``pthread_getcpuclockid``): a thread blocked on
a lock, a socket or a queue costs nothing, a thread in C code (tokenizers, xgrammar) costs what
it burns. Garbage collections are timed too (``gc;generation N``, wall seconds, whichever
thread ran them). Collapsed stacks (``thread;frames seconds``) go to
``<dir>/<part>/<process title>-<pid>.txt``. The suite's ``--profile`` starts every process with
``benchmarks/profiling/hook`` on ``PYTHONPATH`` (its ``sitecustomize`` calls ``start``) and turns
sampling on for each run of one extra, unmeasured round (part: ``<workload>-<system>``).

    # per process: CPU seconds by thread, function
    python -m benchmarks.profiling.sampler DIR/PART [--top 25]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import FrameType

_started = False


def start() -> None:
    """Sample this process (and, after a fork, the child) while the ``on`` file exists."""
    global _started
    if _started:
        return
    _started = True
    threading.Thread(target=_run, name="bench-sampler", daemon=True).start()
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    global _started
    _started = False
    start()


def _title() -> str:
    try:  # setproctitle rewrites argv: vLLM's EngineCore
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
        words = [w.decode(errors="replace") for w in argv if w][:4]
    except OSError:
        words = sys.argv[:3]
    name = "_".join(Path(w).name for w in words if not w.startswith("-"))[:60]
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in name) or "python"


def _run() -> None:
    folder = Path(os.environ["VQUEUE_BENCH_PROFILE_DIR"])
    flag = folder / "on"
    every = float(os.environ.get("VQUEUE_BENCH_PROFILE_MS", "10")) / 1000
    seconds: defaultdict[str, float] = defaultdict(float)
    me, names, written = threading.get_ident(), {}, time.monotonic()
    used: dict[int, float] = {}  # each thread's CPU clock at the last sample
    part = ""
    began = [0.0]
    # keys fixed up front: a collection may run inside any allocation, the sampler's included
    in_gc = {f"gc;generation {g}": 0.0 for g in range(3)}

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif began[0] and part:
            in_gc[f"gc;generation {info.get('generation')}"] += time.perf_counter() - began[0]

    gc.callbacks.append(timed)
    while True:
        if not flag.exists():
            if seconds:
                seconds.update((k, v) for k, v in in_gc.items() if v)
                _write(folder / part, seconds)
                seconds.clear()
                in_gc.update(dict.fromkeys(in_gc, 0.0))
            used.clear()
            part = ""
            time.sleep(0.1)
            continue
        if not part:
            try:
                part = flag.read_text().strip() or "all"
            except OSError:
                continue
        for t in threading.enumerate():
            names[t.ident] = t.name
        for tid, frame in sys._current_frames().items():
            try:
                now = time.clock_gettime(time.pthread_getcpuclockid(tid))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
            spent, used[tid] = now - used.get(tid, now), now
            if tid == me or spent <= 0:
                continue
            stack = []
            f: FrameType | None = frame
            while f is not None:
                stack.append(f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)})")
                f = f.f_back
            thread = re.sub(r"[-_ ]\d+\b", "", names.get(tid, "?"))  # one row per kind
            seconds[f"{thread};" + ";".join(reversed(stack))] += spent
        time.sleep(every)
        if time.monotonic() - written > 5:
            _write(folder / part, seconds)
            written = time.monotonic()


def _write(folder: Path, seconds: dict[str, float]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_title()}-{os.getpid()}.txt"
    text = "".join(f"{k} {v:.6f}\n" for k, v in _top(seconds))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _top(d: dict[str, float], n: int | None = None) -> list[tuple[str, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


def summarize(folder: Path, top: int) -> str:
    """Per process file: CPU seconds per thread, then the functions those seconds were spent
    in (inclusive: counted once per stack) and at (self), largest first."""
    out = []
    for path in sorted(folder.glob("*.txt"), key=lambda p: -p.stat().st_size):
        threads: defaultdict[str, float] = defaultdict(float)
        incl: defaultdict[str, float] = defaultdict(float)
        leaf: defaultdict[str, float] = defaultdict(float)
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            thread, *frames = stack.split(";")
            spent = float(n)
            threads[thread] += spent
            for f in set(frames):
                incl[f] += spent
            if frames:
                leaf[frames[-1]] += spent
        if sum(threads.values()) < 0.2:  # an idle helper process
            continue
        out.append(f"## {path.stem}: CPU seconds by thread")
        out += [f"  {n:8.2f}  {t}" for t, n in _top(threads)]
        out.append("  inclusive:")
        out += [f"  {n:8.2f}  {f}" for f, n in _top(incl, top)]
        out.append("  self:")
        out += [f"  {n:8.2f}  {f}" for f, n in _top(leaf, top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description="summarize benchmarks.profiling.sampler files")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(summarize(a.folder, a.top))


if __name__ == "__main__":
    main()
