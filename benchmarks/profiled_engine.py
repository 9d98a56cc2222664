"""The real engine host plus an in-process sampling profiler, for benchmark runs only.

py-spy cannot attach on the lent GPU machine, so this samples ``sys._current_frames()`` from
a thread (every 20 ms) and writes collapsed stacks to ``$VQUEUE_BENCH_PROFILE`` every 5 s.
Threads parked on a lock, a future or a socket are counted apart, so the rest shows what held
the interpreter. Used as ``VQUEUE_ENGINE_CLASS=benchmarks.profiled_engine:ProfiledEngine``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

from schemas import Settings
from worker.engine import EngineHost

_IDLE = (
    "wait",
    "acquire",
    "select",
    "poll",
    "_recv",
    "recv_into",
    "readline",
    "sleep",
    "_worker",
    "get",
    "epoll",
    "accept",
    "read",
    "_wait_for_tstate_lock",
    "run_forever",
)


class ProfiledEngine(EngineHost):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        threading.Thread(target=self._sample, name="bench-profiler", daemon=True).start()

    def _sample(self) -> None:
        path = os.environ.get("VQUEUE_BENCH_PROFILE", "worker-profile.txt")
        counts: Counter[str] = Counter()
        me, last = threading.get_ident(), time.time()
        names = {}
        while True:
            for t in threading.enumerate():
                names[t.ident] = t.name.split("-")[0]
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                f = frame
                while f is not None:
                    stack.append(f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)})")
                    f = f.f_back
                leaf = frame.f_code.co_name
                state = "idle" if leaf in _IDLE else "busy"
                counts[f"{state};{names.get(tid, '?')};" + ";".join(reversed(stack))] += 1
            time.sleep(0.02)
            if time.time() - last > 5:
                with open(path, "w") as fh:
                    fh.writelines(f"{k} {v}\n" for k, v in counts.most_common())
                last = time.time()
