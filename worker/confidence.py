"""Logprob early stop: the engine-side monitor and the worker-side board it reports to.

Asking vLLM for ``logprobs`` costs 44% of throughput on the GPU (a full log-softmax, a top-k and
a host copy per token, then Python objects per token in the frontend). The monitor instead runs
inside the engine step as a vLLM logits processor: per monitored row it takes one max and one
logsumexp over the logits (the top-1 logprob), keeps running counters on the device, and never
synchronizes with the host.

When a row's top-1 logprob stays under the threshold for ``window`` consecutive tokens past the
grace period, the monitor forces the row's next token to a *marker* token that the request lists
in ``stop_token_ids``. vLLM then finishes the request in that same step (``stop_reason`` is the
marker), so the slot is free at once and the frontend learns why without any side channel.

The per-attempt numbers (tokens seen, sum and minimum of the top-1 logprob, whether the rule
fired) go to a small memory-mapped file, one row per attempt slot, which the worker reads when
the request finishes. On a GPU the copy runs on a background thread after the step's event, so the
step itself never waits for it.

Signal: the top-1 logprob of the raw distribution (after the grammar mask, before temperature,
penalties and top-p). It measures how sure the model is of its best next token; the sampled
token's logprob would also drop whenever temperature sampling picks a tail token, which is the
sampler's doing, not the model's, and it is only known after sampling, outside this interface.
"""

from __future__ import annotations

import logging
import os
import queue
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


def _base() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    return LogitsProcessor


class ConfidenceMonitor(_base()):  # type: ignore[misc]
    """The engine's side, loaded by vLLM from ``logits_processors``; see the module docstring.

    Everything per step is a handful of batched tensor ops: the batch's changes (vLLM reports
    each add, removal and move) are folded on the host into one row permutation and one
    settings table, which reach the device as two asynchronous copies from pinned memory; the
    host never waits for the device.
    """

    # settings columns (host table, copied to the device when the batch changes)
    ON, THRESHOLD, WINDOW, GRACE, ABORT, MARKER = range(6)
    # state columns (device): tokens seen, sum of top-1 logprobs, min, low streak, fired
    N, SUM, MIN, STREAK, FIRED = range(5)

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.rows = rows = vllm_config.scheduler_config.max_num_seqs
        self.pin = bool(is_pin_memory)
        self.settings = torch.zeros((rows, 6), dtype=torch.float32)
        self.d_settings = self.settings.to(device)
        self.state = torch.zeros((rows, 5), dtype=torch.float32, device=device)
        self.slots = np.full(rows, -1, dtype=np.int64)
        self.file_ids = np.full(rows, -1, dtype=np.int64)
        self.files: list[str] = []
        self.outputs: list[list[int] | None] = [None] * rows
        self.prefilling: set[int] = set()  # rows with no output token yet
        self.src = np.arange(rows)  # where each row's state comes from; -1: a fresh row
        self.active = 0
        self.changed = False
        self.maps: dict[int, Any] = {}
        self._no_fresh = torch.zeros(rows, dtype=torch.bool, device=device)
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._step = _step
        if self.cuda:
            # one fused kernel for the vocabulary reductions and the counters, instead of a
            # dozen passes and launches; compiled here, at engine start, not on a job's step
            try:
                compiled = torch.compile(_step, dynamic=True, fullgraph=True)
                vocab = vllm_config.model_config.get_vocab_size()
                for b in (1, 2, 3):  # 1 is specialized; 3 settles the dynamic batch size
                    probe = torch.zeros((b, vocab), device=device)
                    compiled(probe, self.state[:b], self.d_settings[:b], self._no_fresh[:b])
                self._step = compiled
            except Exception as exc:  # eager is correct, only slower
                log.warning("confidence monitor: torch.compile failed (%s); running eager", exc)
        if self.cuda:  # host copies land in pinned buffers, written out by a thread
            self.pending: queue.Queue[Any] = queue.Queue(maxsize=64)
            threading.Thread(target=self._writer, name="vqueue-confidence", daemon=True).start()

    def is_argmax_invariant(self) -> bool:
        return False  # forcing the marker changes greedy picks too

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = (sampling_params.extra_args or {}).get(KEY)
        if args is not None and not isinstance(args, dict):
            raise ValueError(f"extra_args[{KEY!r}] must be a dict")

    # -- batch bookkeeping (host only) ---------------------------------------------------------
    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._clear(index)
        for index, params, _prompt, output in batch_update.added:
            self._clear(index)
            args = (params.extra_args or {}).get(KEY) if params is not None else None
            if args:
                self._add(index, args, output)
        for a, b, direction in batch_update.moved:
            self._move(a, b, swap=direction.name == "SWAP")

    def _clear(self, i: int) -> None:
        if self.slots[i] >= 0:
            self.active -= 1
            self.changed = True
        self.slots[i] = -1
        self.settings[i, self.ON] = 0.0
        self.outputs[i] = None
        self.prefilling.discard(i)
        self.src[i] = -1

    def _add(self, i: int, args: dict[str, Any], output: list[int]) -> None:
        path = str(args["file"])
        if path not in self.files:
            self.files.append(path)
        self.file_ids[i] = self.files.index(path)
        self.slots[i] = int(args["slot"])
        self.settings[i] = self.torch.tensor(
            [1.0, args["threshold"], args["window"], args["grace"], args["abort"], args["marker"]]
        )
        self.outputs[i] = output
        self.prefilling.add(i)
        self.src[i] = -1
        self.active += 1
        self.changed = True

    def _move(self, a: int, b: int, swap: bool) -> None:
        if swap:
            pair, rev = [a, b], [b, a]
            self.settings[pair] = self.settings[rev]
            for arr in (self.slots, self.file_ids, self.src):
                arr[pair] = arr[rev]
            self.outputs[a], self.outputs[b] = self.outputs[b], self.outputs[a]
            pa, pb = a in self.prefilling, b in self.prefilling
            for i, p in ((a, pb), (b, pa)):
                (self.prefilling.add if p else self.prefilling.discard)(i)
        else:  # a's request now lives at b; a is empty
            if self.slots[b] >= 0:
                self.active -= 1
            self.settings[b] = self.settings[a]
            self.settings[a, self.ON] = 0.0
            for arr in (self.slots, self.file_ids, self.src):
                arr[b] = arr[a]
            self.slots[a], self.src[a] = -1, -1
            self.outputs[b], self.outputs[a] = self.outputs[a], None
            if a in self.prefilling:
                self.prefilling.add(b)
            else:
                self.prefilling.discard(b)
            self.prefilling.discard(a)
        self.changed = True

    def _to_device(self, host: Any) -> Any:
        if self.cuda:  # a pinned copy per transfer: the caching host allocator keeps it alive
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    # -- the step ------------------------------------------------------------------------------
    def apply(self, logits: Any) -> Any:
        if self.active <= 0 and not self.changed:
            return logits
        torch = self.torch
        if self.changed:  # one gather follows every move since the last step; new rows start at 0
            src = torch.from_numpy(self.src)
            idx = self._to_device(src)
            kept = self.state[idx.clamp(min=0)]
            self.state = torch.where((idx >= 0).unsqueeze(1), kept, torch.zeros_like(kept))
            self.d_settings = self._to_device(self.settings.clone())
            self.src = np.arange(self.rows)
            self.changed = False
        if self.active <= 0:
            return logits
        b = logits.shape[0]
        # a row with no output token yet is prefilling (perhaps one chunk of several): whatever
        # it computed so far is discarded, so its counters restart until the first token
        fresh = self._no_fresh[:b]
        if self.prefilling:
            started = [i for i in self.prefilling if self.outputs[i]]
            self.prefilling.difference_update(started)
            if self.prefilling:
                mask = torch.zeros(self.rows, dtype=torch.bool)
                mask[list(self.prefilling)] = True
                fresh = self._to_device(mask)[:b]
        x = logits[:b]
        try:
            st, force = self._step(x, self.state[:b], self.d_settings[:b], fresh)
        except Exception as exc:  # a recompile gone wrong must not take the engine down
            if self._step is _step:
                raise
            log.warning("confidence monitor: compiled step failed (%s); running eager", exc)
            self._step = _step
            st, force = _step(x, self.state[:b], self.d_settings[:b], fresh)
        self.state[:b] = st
        # the marker outweighs every other token by far, so greedy, sampling, top-p and
        # penalties all pick it; one scatter, not a pass over the whole vocabulary
        marker = self.d_settings[:b, self.MARKER].long().unsqueeze(1)
        keep = x.gather(1, marker)
        x.scatter_(1, marker, torch.where(force.unsqueeze(1), torch.full_like(keep, 1e9), keep))
        rows = np.nonzero(self.slots[:b] >= 0)[0]
        slots, files = self.slots[rows], self.file_ids[rows]
        table = st
        if self.cuda:
            host = torch.empty(table.shape, dtype=torch.float32, pin_memory=self.pin)
            host.copy_(table, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self.pending.put((done, host, rows, slots, files))
        else:
            self._write(table.numpy(), rows, slots, files)
        return logits

    def _writer(self) -> None:
        while True:
            done, host, rows, slots, files = self.pending.get()
            done.synchronize()
            self._write(host.numpy(), rows, slots, files)

    def _write(self, table: Any, rows: Any, slots: Any, files: Any) -> None:
        values = table[rows][:, [self.N, self.SUM, self.MIN, self.FIRED]]
        for f in np.unique(files):
            mm = self.maps.get(int(f))
            if mm is None:
                try:
                    mm = self.maps[int(f)] = np.load(self.files[int(f)], mmap_mode="r+")
                except OSError:
                    continue  # the worker is gone; nothing to report to
            sel = files == f
            mm[slots[sel]] = values[sel]


def install_output_ids_opt_out() -> None:
    """Stop the monitor from costing vLLM a host sync per step.

    vLLM assumes any custom logits processor reads every request's output token ids, so with one
    loaded it keeps them current for the sampler: under asynchronous scheduling that means
    waiting for the previous step's sampled tokens to reach the host and patching each request's
    list, on every step, before sampling. The monitor reads no token ids (only whether a row has
    produced its first token, which the list's length tells and vLLM keeps up to date anyway), so
    where it is the only custom processor the input batch is told it needs none.
    """
    try:
        from vllm.v1.worker.gpu_input_batch import InputBatch
    except ImportError:
        return
    stock = InputBatch.__init__
    if getattr(stock, "__vqueue__", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        stock(self, *args, **kwargs)
        procs = getattr(getattr(self, "logitsprocs", None), "all", None)
        if not getattr(self, "logitsprocs_need_output_token_ids", False) or procs is None:
            return
        custom = [p for p in procs if not type(p).__module__.startswith("vllm.")]
        if custom and all(isinstance(p, ConfidenceMonitor) for p in custom):
            self.logitsprocs_need_output_token_ids = False
            logging.getLogger("vllm.vqueue").info(
                "vqueue: the confidence monitor needs no output token ids"
            )

    __init__.__vqueue__ = True  # type: ignore[attr-defined]
    InputBatch.__init__ = __init__  # type: ignore[method-assign]


def _step(x: Any, st: Any, cfg: Any, fresh: Any) -> tuple[Any, Any]:
    """One step of the rule for every row: the new counters, and which rows to abort now.

    ``st`` columns: tokens seen, sum of top-1 logprobs, min, low streak, fired; ``cfg``: on,
    threshold, window, grace, abort, marker. A ``fresh`` row (no output token yet) restarts.
    """
    import torch

    m = x.amax(dim=-1)
    top1 = -torch.log(torch.exp(x - m.unsqueeze(1)).sum(dim=-1))  # max - logsumexp
    st = torch.where(fresh.unsqueeze(1), torch.zeros_like(st), st)
    n, total, low, streak, fired = st.unbind(1)
    low = torch.where(n == 0, top1, torch.minimum(low, top1))
    total = total + top1
    n = n + 1.0
    streak = torch.where(top1 < cfg[:, 1], streak + 1.0, torch.zeros_like(streak))
    hit = (cfg[:, 0] > 0) & (streak >= cfg[:, 2]) & (n > cfg[:, 3])
    fired = torch.maximum(fired, hit.float())
    return torch.stack([n, total, low, streak, fired], dim=1), hit & (cfg[:, 4] > 0)
