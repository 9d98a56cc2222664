"""Logprob early stop: the engine-side monitor and the worker-side board it reports to.

Asking vLLM for ``logprobs`` costs 44% of throughput on the GPU (a full log-softmax, a top-k and
a host copy per token, then Python objects per token in the frontend). The monitor instead runs
inside the engine step as a vLLM logits processor: per monitored row it reads the logits once
for the top-1 logprob (max minus logsumexp), keeps running counters on the device, and never
synchronizes with the host. On a GPU that is one Triton kernel per step.

When a row's top-1 logprob stays under the threshold for ``window`` consecutive tokens past the
grace period, the monitor forces the row's next token to a *marker* token that the request lists
in ``stop_token_ids``. vLLM then finishes the request in that same step (``stop_reason`` is the
marker), so the slot is free at once and the frontend learns why without any side channel.

The per-attempt numbers (tokens seen, sum and minimum of the top-1 logprob, whether the rule
fired) go to a small memory-mapped file, one row per attempt slot, which the worker reads when
the request finishes. On a GPU the counters are copied to pinned memory without waiting, and a
background thread writes them to the file once the copy has landed.

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

    The engine step is host-bound on a small model, so the monitor is built to cost the step as
    few host microseconds as possible. A steady step (no request added, removed or moved) is one
    kernel launch, one asynchronous copy of the counters to pinned memory and an event: the
    batch's changes are folded on the host into one table (settings and where each row's state
    comes from), which reaches the device as one asynchronous copy only when it changed, and the
    kernel reads each row's logits once (an online max and sum) and updates its counters and the
    marker in place. The host never waits for the device.
    """

    # settings table columns: on, threshold, window, grace, abort, marker, fresh (no output token
    # yet: counters restart), src (the row its state comes from after moves; -1: a new row)
    ON, THRESHOLD, WINDOW, GRACE, ABORT, MARKER, FRESH, SRC = range(8)
    # state columns (device): tokens seen, sum of top-1 logprobs, min, low streak, fired
    N, SUM, MIN, STREAK, FIRED = range(5)
    RING = 16  # pinned buffers the counters are copied to, written out by a thread

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.rows = rows = vllm_config.scheduler_config.max_num_seqs
        self.table = np.zeros((rows, 8), dtype=np.float32)
        self.table[:, self.SRC] = np.arange(rows)
        self.d_table = torch.from_numpy(self.table.copy()).to(device)
        self.state = torch.zeros((rows, 5), dtype=torch.float32, device=device)
        self.spare = torch.zeros_like(self.state)  # the gather after moves writes here
        self.slots = np.full(rows, -1, dtype=np.int64)
        self.file_ids = np.full(rows, -1, dtype=np.int64)
        self.files: list[str] = []
        self.outputs: list[list[int] | None] = [None] * rows
        self.prefilling: set[int] = set()  # rows with no output token yet
        self.active = 0
        self.changed = False  # the table must go to the device (and counters follow its src)
        self.watched = np.zeros(0, dtype=np.int64)  # rows with a slot, as of the last upload
        self.maps: dict[int, Any] = {}
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.pin = self.cuda and bool(is_pin_memory)
        self._kernel: Any = None
        if self.cuda:
            try:
                self._kernel = _triton_step()
                probe = torch.zeros((2, vllm_config.model_config.get_vocab_size()), device=device)
                for src in (self.state, self.spare):  # compile both now, not on a job's step
                    self._launch(probe, src, self.state, 0)
            except Exception as exc:  # eager is correct, only slower
                log.warning("confidence monitor: no Triton kernel (%s); running eager", exc)
                self._kernel = None
            self.ring = torch.zeros((self.RING, rows, 5), dtype=torch.float32)
            if self.pin:  # vLLM says where pinned memory is unavailable (WSL); copies then wait
                self.ring = self.ring.pin_memory()
            # blocking: the writer sleeps until the copy lands; a spinning wait would poll the
            # driver, whose lock every kernel launch of the engine step also takes
            self.events = [torch.cuda.Event(blocking=True) for _ in range(self.RING)]
            self.turn = 0
            # at most RING - 2 copies wait, so a buffer is never reused while being read
            self.pending: queue.Queue[Any] = queue.Queue(maxsize=self.RING - 2)
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
        self.table[i, self.ON] = 0.0
        self.table[i, self.SRC] = -1.0
        self.outputs[i] = None
        self.prefilling.discard(i)

    def _add(self, i: int, args: dict[str, Any], output: list[int]) -> None:
        path = str(args["file"])
        if path not in self.files:
            self.files.append(path)
        self.file_ids[i] = self.files.index(path)
        self.slots[i] = int(args["slot"])
        self.table[i, : self.SRC] = (1.0, args["threshold"], args["window"], args["grace"],
                                     args["abort"], args["marker"], 1.0)  # fmt: skip
        self.table[i, self.SRC] = -1.0
        self.outputs[i] = output
        self.prefilling.add(i)
        self.active += 1
        self.changed = True

    def _move(self, a: int, b: int, swap: bool) -> None:
        if swap:
            pair, rev = [a, b], [b, a]
            for arr in (self.table, self.slots, self.file_ids):
                arr[pair] = arr[rev]
            self.outputs[a], self.outputs[b] = self.outputs[b], self.outputs[a]
            pa, pb = a in self.prefilling, b in self.prefilling
            for i, p in ((a, pb), (b, pa)):
                (self.prefilling.add if p else self.prefilling.discard)(i)
        else:  # a's request now lives at b; a is empty
            if self.slots[b] >= 0:
                self.active -= 1
            for arr in (self.table, self.slots, self.file_ids):
                arr[b] = arr[a]
            self.table[a, self.ON], self.table[a, self.SRC] = 0.0, -1.0
            self.slots[a] = -1
            self.outputs[b], self.outputs[a] = self.outputs[a], None
            if a in self.prefilling:
                self.prefilling.add(b)
            else:
                self.prefilling.discard(b)
            self.prefilling.discard(a)
        self.changed = True

    # -- the step ------------------------------------------------------------------------------
    def apply(self, logits: Any) -> Any:
        if self.active <= 0 and not self.changed:
            return logits
        if self.prefilling:  # a row's first token came out of the last step: stop restarting it
            started = [i for i in self.prefilling if self.outputs[i]]
            if started:
                self.prefilling.difference_update(started)
                self.table[started, self.FRESH] = 0.0
                self.changed = True
        gather = self.changed
        if self.changed:
            self.d_table = self._to_device(self.table)
            self.table[:, self.SRC] = np.arange(self.rows)  # from now on each row is its own
            self.watched = np.nonzero(self.slots >= 0)[0]
            self.changed = False
        if self.active <= 0:
            return logits
        b = logits.shape[0]
        if gather:  # new rows start at zero, moved rows bring their counters along
            src, dst = self.state, self.spare
            self.state, self.spare = dst, src
        else:
            src = dst = self.state
        self._launch(logits, src, dst, b)
        rows = self.watched[self.watched < b]
        slots, files = self.slots[rows], self.file_ids[rows]
        if self.cuda:
            turn, self.turn = self.turn, (self.turn + 1) % self.RING
            self.ring[turn, :b].copy_(dst[:b], non_blocking=True)
            self.events[turn].record()
            self.pending.put((turn, rows, slots, files))
        else:
            self._write(dst.numpy(), rows, slots, files)
        return logits

    def _to_device(self, host: Any) -> Any:
        t = self.torch.from_numpy(host.copy())
        if self.pin:  # a pinned copy per transfer: the caching host allocator keeps it alive
            t = t.pin_memory()
        return t.to(self.device, non_blocking=self.pin)

    def _launch(self, logits: Any, src: Any, dst: Any, b: int) -> None:
        """The step for rows ``[:b]``: counters from ``src`` (by the table's src column when it
        is not ``dst``) to ``dst``, and the marker forced where the rule fires."""
        if self._kernel is not None and logits.stride(1) == 1:
            b = b or logits.shape[0]
            self._kernel[(b,)](
                logits, logits.stride(0), logits.shape[1], src, dst, self.d_table,
                int(src.data_ptr() != dst.data_ptr()), BLOCK=4096, num_warps=8,
            )  # fmt: skip
            return
        _step(logits[: b or None], src, dst, self.d_table)

    def _writer(self) -> None:
        while True:
            turn, rows, slots, files = self.pending.get()
            self.events[turn].synchronize()
            self._write(self.ring[turn].numpy(), rows, slots, files)

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


def _step(x: Any, src: Any, dst: Any, table: Any) -> None:
    """The rule for every row of ``x``, eagerly (the CPU, or no Triton): ``_triton_step``'s
    twin, which the tests hold it to. ``table`` columns are ``ConfidenceMonitor``'s."""
    import torch

    b = x.shape[0]
    cfg = table[:b]
    if src.data_ptr() != dst.data_ptr():
        at = cfg[:, 7].long()
        st = torch.where((at >= 0).unsqueeze(1), src[at.clamp(min=0)], torch.zeros_like(src[:b]))
    else:
        st = src[:b]
    st = torch.where((cfg[:, 6] > 0).unsqueeze(1), torch.zeros_like(st), st)
    m = x.amax(dim=-1)
    top1 = -torch.log(torch.exp(x - m.unsqueeze(1)).sum(dim=-1))  # max - logsumexp
    n, total, low, streak, fired = st.unbind(1)
    low = torch.where(n == 0, top1, torch.minimum(low, top1))
    total = total + top1
    n = n + 1.0
    streak = torch.where(top1 < cfg[:, 1], streak + 1.0, torch.zeros_like(streak))
    hit = (cfg[:, 0] > 0) & (streak >= cfg[:, 2]) & (n > cfg[:, 3])
    fired = torch.maximum(fired, hit.float())
    dst[:b] = torch.stack([n, total, low, streak, fired], dim=1)
    force = hit & (cfg[:, 4] > 0)
    # the marker outweighs every other token by far, so greedy, sampling, top-p and penalties
    # all pick it
    marker = cfg[:, 5].long().unsqueeze(1)
    keep = x.gather(1, marker)
    x.scatter_(1, marker, torch.where(force.unsqueeze(1), torch.full_like(keep, 1e9), keep))


_TRITON: Any = None


def _triton_step() -> Any:
    """The rule as one Triton kernel, one program per row: a single pass over the row's logits
    (online max and sum of exponentials), then the counters and the marker. Built on first use,
    so importing this module never needs Triton."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def step(x_ptr, x_stride, vocab, src_ptr, dst_ptr, cfg_ptr, gather, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0)
        cfg = cfg_ptr + row * 8
        if tl.load(cfg) > 0:  # watched rows only: the others cost nothing
            base = x_ptr + row.to(tl.int64) * x_stride
            neg = float("-inf")
            mx = tl.full([BLOCK], neg, tl.float32)
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                v = tl.load(base + offs, mask=offs < vocab, other=neg).to(tl.float32)
                new = tl.maximum(mx, v)
                safe = tl.where(new == neg, 0.0, new)  # a lane masked so far adds nothing
                acc = acc * tl.exp(mx - safe) + tl.exp(v - safe)
                mx = new
            top = tl.max(mx, axis=0)
            total_exp = tl.sum(acc * tl.exp(mx - tl.where(top == neg, 0.0, top)), axis=0)
            top1 = -tl.log(total_exp)  # max - logsumexp
            at = row
            if gather:
                at = tl.load(cfg + 7).to(tl.int32)
            st = src_ptr + at * 5
            keep = (at >= 0) & (tl.load(cfg + 6) == 0)
            n = tl.where(keep, tl.load(st, mask=at >= 0, other=0.0), 0.0)
            total = tl.where(keep, tl.load(st + 1, mask=at >= 0, other=0.0), 0.0)
            low = tl.where(keep, tl.load(st + 2, mask=at >= 0, other=0.0), 0.0)
            streak = tl.where(keep, tl.load(st + 3, mask=at >= 0, other=0.0), 0.0)
            fired = tl.where(keep, tl.load(st + 4, mask=at >= 0, other=0.0), 0.0)
            low = tl.where(n == 0, top1, tl.minimum(low, top1))
            total = total + top1
            n = n + 1.0
            streak = tl.where(top1 < tl.load(cfg + 1), streak + 1.0, 0.0)
            hit = (streak >= tl.load(cfg + 2)) & (n > tl.load(cfg + 3))
            fired = tl.maximum(fired, tl.where(hit, 1.0, 0.0))
            out = dst_ptr + row * 5
            tl.store(out, n)
            tl.store(out + 1, total)
            tl.store(out + 2, low)
            tl.store(out + 3, streak)
            tl.store(out + 4, fired)
            if hit & (tl.load(cfg + 4) > 0):
                tl.store(base + tl.load(cfg + 5).to(tl.int64), 1e9)

    _TRITON = step
    return step
