"""Logprob early stop, the worker's side: what a request asks the monitor for, the board the
monitor reports to, and the same rule applied to vLLM's own logprobs where the monitor is not
installed.

The monitor itself runs inside vLLM's engine step (``worker.vllm_ext.monitor``). When a row's
top-1 logprob stays under the threshold for ``window`` consecutive tokens past the grace period,
it forces the row's next token to a *marker* token that the request lists in
``stop_token_ids``. vLLM then finishes the request in that same step (``stop_reason`` is the
marker), so the slot is free at once and the frontend learns why without any side channel.

The per-attempt numbers (tokens seen, sum and minimum of the top-1 logprob, whether the rule
fired) go to a small memory-mapped file, one row per attempt slot, which the worker reads when
the request finishes. On a GPU the kernel writes them there itself: the engine registers the
file's pages with CUDA, so the device writes host memory directly.

Signal: the top-1 logprob of the distribution the sampler starts from (after the grammar mask,
before temperature and top-p). It measures how sure the model is of its best next token; the
sampled token's logprob would also drop whenever temperature sampling picks a tail token, which
is the sampler's doing, not the model's.

Where ``worker.vllm_ext.compat`` finds no monitor for the installed vLLM (or
``VQUEUE_EARLY_STOP_PATH=logprobs``), monitored requests ask vLLM for ``logprobs=1`` instead and
``LogprobRule`` applies the same rule to each streamed token's top-1 logprob, aborting the
request in the engine when it holds: the same attempts and results, at the cost of vLLM's
logprobs (docs/vllm-compat.md). vLLM reports raw logprobs there, before the grammar mask.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
# extra_args key that carries a request's monitor settings into the engine
KEY = "vqueue_confidence"
# one row per attempt slot: tokens seen, sum of top-1 logprobs, min, fired (0/1)
COLUMNS = 4
SLOTS = 65536


@dataclass(frozen=True)
class Monitor:
    """What the monitor watches for in one request; ``abort`` False only observes (the last
    attempt, whose output is returned whatever happens)."""

    threshold: float
    window: int
    grace: int
    abort: bool


@dataclass(frozen=True)
class Reading:
    tokens: int  # decoding steps the monitor saw
    min_logprob: float | None
    mean_logprob: float | None
    fired: bool  # the rule's condition held at least once (past the grace period)


class ConfidenceBoard:
    """The worker's side: hands out attempt slots in the shared file and reads them back."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        )
        self.path = os.path.join(
            directory, f"vqueue-confidence-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._mm = np.lib.format.open_memmap(
            self.path, mode="w+", dtype=np.float32, shape=(SLOTS, COLUMNS)
        )
        self._lock = threading.Lock()
        self._next = 0

    def slot(self) -> int:
        """A fresh slot, zeroed. Slots are reused round-robin: 65,536 attempts apart, far more
        than an engine holds at once, so a finished request's row is never still being written."""
        with self._lock:
            slot = self._next
            self._next = (self._next + 1) % SLOTS
        self._mm[slot] = 0.0
        return slot

    def read(self, slot: int, tokens: int, wait_s: float = 0.2) -> Reading:
        """The slot's numbers once the monitor has seen ``tokens`` steps (it writes them right
        after each step, so this rarely waits), or whatever it has after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        row = self._mm[slot].copy()
        while row[0] < tokens and time.monotonic() < deadline:
            time.sleep(0.002)
            row = self._mm[slot].copy()
        seen = int(row[0])
        return Reading(
            tokens=seen,
            min_logprob=float(row[2]) if seen else None,
            mean_logprob=float(row[1] / seen) if seen else None,
            fired=bool(row[3]),
        )

    def close(self) -> None:
        del self._mm
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def request_args(
    board: ConfidenceBoard, slot: int, monitor: Monitor, marker: int
) -> dict[str, Any]:
    """The ``extra_args`` entry that turns the monitor on for one request."""
    return {
        KEY: {
            "file": board.path,
            "slot": slot,
            "threshold": monitor.threshold,
            "window": monitor.window,
            "grace": monitor.grace,
            "abort": monitor.abort,
            "marker": marker,
        }
    }


def marker_token(tokenizer: Any) -> int:
    """The abort marker: the vocabulary's last ordinary token, a rare BPE merge. Special and
    added tokens are skipped, since chat templates and stop rules give them meaning. Should a
    model emit it on its own, the request stops, and the worker, seeing the monitor did not
    fire, treats that as a plain stop."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "get_added_vocab", None)
    if callable(added):
        special |= set(added().values())
    for i in range(len(tokenizer) - 1, -1, -1):
        if i not in special:
            return i
    raise ValueError("the tokenizer has no ordinary token to use as the early-stop marker")


class LogprobRule:
    """The monitor's rule over vLLM's own logprobs, token by token (the fallback path): the
    same counters and the same condition as the in-engine step (``worker.vllm_ext.monitor``)."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.tokens = 0
        self.total = 0.0
        self.low: float | None = None
        self.streak = 0
        self.fired = False

    def step(self, top1: float) -> bool:
        """Count one generated token's top-1 logprob; True when the rule holds at it."""
        m = self.monitor
        self.tokens += 1
        self.total += top1
        self.low = top1 if self.low is None else min(self.low, top1)
        self.streak = self.streak + 1 if top1 < m.threshold else 0
        hit = self.streak >= m.window and self.tokens > m.grace
        self.fired = self.fired or hit
        return hit

    def reading(self) -> Reading:
        n = self.tokens
        return Reading(
            tokens=n,
            min_logprob=self.low,
            mean_logprob=self.total / n if n else None,
            fired=self.fired,
        )
