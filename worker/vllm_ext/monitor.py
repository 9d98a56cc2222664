"""The confidence monitor inside vLLM's engine process: the per-step rule on the logits, as one
Triton kernel on a GPU, and the ways it is put into whichever model runner vLLM builds.

Asking vLLM for ``logprobs`` costs a large share of throughput on the GPU (a full log-softmax,
a top-k and a host copy per token, then Python objects per token in the frontend;
docs/early-stop.md). The monitor instead runs
inside the engine step, on the logits before sampling: per watched row it reads the logits once
for the top-1 logprob (max minus logsumexp), keeps running counters on the device, and never
synchronizes with the host. The worker's side (the board it reads, the marker token, what a
request asks for) is ``worker.confidence``.

How it gets into the engine (``compat`` says which, per vLLM release):

- ``V1Monitor``: V1's public logits-processor interface, named in ``logits_processors``;
- ``V2Monitor``: Model Runner V2's public interface (vLLM 0.32 on), named the same way;
- ``install_v2_hook``: vLLM 0.26's V2 sampler, which has no interface, patched by the plugin.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Any

import numpy as np

from worker.confidence import COLUMNS, KEY

log = logging.getLogger(__name__)

V1LogitsProcessor: Any
V2LogitsProcessor: Any
try:  # the V1 interface: every supported release
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
except ImportError:  # pragma: no cover  # not a vLLM this package runs with
    V1LogitsProcessor = object
try:  # the V2 interface: vLLM 0.32 on
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError:
    V2LogitsProcessor = None


class _Watch:
    """The monitor's state and step, kept per *request slot*: an index a request holds for its
    whole stay in the engine (Model Runner V2's own request index; V1's adapter hands them out),
    so reordering the batch never moves a counter. Each step gets the row -> slot mapping.

    The engine step is host-bound on a small model, so a steady step costs the host one kernel
    launch and nothing else: request settings live in a host table that reaches the device as
    one asynchronous copy only on steps where it changed, and on a GPU the kernel writes each
    watched row's numbers straight into the worker's memory-mapped board (registered with CUDA
    as host memory the device can write), so no copy, event or thread is needed to report them.
    """

    # table columns: on, threshold, window, grace, abort, marker, fresh (counters restart), the
    # board (index into the boards registered here, -1 none) and the row in it
    ON, THRESHOLD, WINDOW, GRACE, ABORT, MARKER, FRESH, BOARD, ROW = range(9)
    # state columns (device): tokens seen, sum of top-1 logprobs, min, low streak, fired
    N, SUM, MIN, STREAK, FIRED = range(5)

    def __init__(self, slots: int, vocab: int, device: Any, pin: bool, lens: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.lens = lens  # rows come with their lengths; rows still prefilling are not counted
        self.table = np.zeros((slots, 9), dtype=np.float32)
        self.table[:, self.BOARD] = -1.0
        self.on = np.zeros(slots, dtype=bool)
        self.d_table = torch.from_numpy(self.table.copy()).to(device)
        self.state = torch.zeros((slots, 5), dtype=torch.float32, device=device)
        self.paths: list[str] = []
        self.boards: list[Any] = []  # the workers' boards, memory-mapped
        self.d_boards = torch.zeros(1, dtype=torch.int64, device=device)  # their device addresses
        self.active = 0
        self.changed = False
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.pin = self.cuda and pin
        self.kernel: Any = None
        self.zero_copy = False  # the kernel writes the boards itself
        if self.cuda:
            try:
                self.kernel = _triton_step()
                self.zero_copy = self._probe(vocab)
            except Exception as exc:  # eager is correct, only slower
                log.warning("confidence monitor: no Triton kernel (%s); running eager", exc)
                self.kernel = None
            if self.zero_copy:  # vLLM's logger tree, so the line shows in the engine's log
                logging.getLogger("vllm.vqueue").info(
                    "vqueue: the confidence monitor's kernel writes the workers' boards itself"
                )
            else:
                log.warning(
                    "confidence monitor: the device cannot write the board directly; its "
                    "numbers are copied to the host after every step, which waits for the step"
                )

    def watch(self, slot: int, args: dict[str, Any]) -> None:
        """Start watching the request in ``slot``, its counters from zero."""
        board = self._board(str(args["file"]))
        self.table[slot] = (
            1.0,
            args["threshold"],
            args["window"],
            args["grace"],
            args["abort"],
            args["marker"],
            1.0,
            board,
            args["slot"],
        )
        if not self.on[slot]:
            self.on[slot] = True
            self.active += 1
        self.changed = True

    def drop(self, slot: int) -> None:
        if self.on[slot]:
            self.on[slot] = False
            self.active -= 1
            self.table[slot, self.ON] = 0.0
            self.changed = True

    def started(self, slot: int) -> None:
        """The request has its first output token: stop restarting its counters."""
        if self.table[slot, self.FRESH]:
            self.table[slot, self.FRESH] = 0.0
            self.changed = True

    def step(
        self, logits: Any, rows: Any, host_rows: Any, lens: Any = None, pre: Any = None
    ) -> None:
        """Watch rows ``[:len(logits)]``; ``rows`` maps each to its slot (-1: none) on the device
        and ``host_rows`` on the host. With ``lens``, a row's position and ``pre`` each slot's
        prefill length: a row still prefilling is not counted (its token is thrown away)."""
        if self.changed:
            self.d_table = self.to_device(self.table)
            self.changed = False
        b = logits.shape[0]
        if self.kernel is not None and logits.stride(1) == 1:
            self._launch(
                logits, rows, lens, pre, self.state, self.d_table, self.d_boards, self.zero_copy
            )
        else:
            _step(logits, rows, lens, pre, self.state, self.d_table)
        if not self.zero_copy:
            self._write(np.asarray(host_rows[:b]))

    def _launch(
        self,
        logits: Any,
        rows: Any,
        lens: Any,
        pre: Any,
        state: Any,
        table: Any,
        boards: Any,
        zero_copy: bool,
    ) -> None:
        self.kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            logits.shape[1],
            rows,
            lens if lens is not None else rows,
            pre if pre is not None else rows,
            state,
            table,
            boards,
            HAS_LENS=lens is not None,
            BOARDS=zero_copy,
            BLOCK=4096,
            num_warps=8,
        )

    def to_device(self, host: Any) -> Any:
        t = self.torch.from_numpy(host.copy())
        if self.pin:  # a pinned copy per transfer: the caching host allocator keeps it alive
            t = t.pin_memory()
        return t.to(self.device, non_blocking=self.pin)

    def _board(self, path: str) -> int:
        if path in self.paths:
            return self.paths.index(path)
        board = _mapped(path, register=self.zero_copy)
        if board is None:
            return -1  # the worker is gone, or its board cannot be registered: nothing to report
        self.paths.append(path)
        self.boards.append(board)
        if self.zero_copy:
            self.d_boards = self.torch.tensor(
                [b.ctypes.data for b in self.boards], dtype=self.torch.int64
            ).to(self.device)
        return len(self.boards) - 1

    def _write(self, rows: Any) -> None:
        """The host's copy of the watched rows' numbers, where the device does not write them."""
        slots = rows[rows >= 0]
        slots = slots[self.on[slots]]
        if not len(slots):
            return
        values = self.state[slots][:, [self.N, self.SUM, self.MIN, self.FIRED]].cpu().numpy()
        cfg = self.table[slots]
        for f in np.unique(cfg[:, self.BOARD]):
            if f >= 0:
                sel = cfg[:, self.BOARD] == f
                self.boards[int(f)][cfg[sel, self.ROW].astype(np.int64)] = values[sel]

    def _probe(self, vocab: int) -> bool:
        """Compile the kernel now, not on a job's step, and check that it can write a board
        straight into host memory (a file mapped here and registered with CUDA)."""
        torch = self.torch
        path = os.path.join(
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
            f"vqueue-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        )
        board = np.lib.format.open_memmap(path, "w+", np.float32, (1, COLUMNS))
        try:
            dev = self.device
            rows = torch.zeros(1, dtype=torch.int32, device=dev)  # the kinds vLLM passes
            lens = torch.ones(1, dtype=torch.int64, device=dev) if self.lens else None
            pre = torch.ones(1, dtype=torch.int32, device=dev) if self.lens else None
            table = torch.tensor([[1.0, -1e9, 1, 0, 0, 0, 1, 0, 0]], device=dev)
            state = torch.zeros((1, 5), device=dev)
            logits = torch.zeros((1, vocab), device=dev)
            ok = _register(board)
            boards = torch.tensor([board.ctypes.data if ok else 0], device=dev)
            self._launch(logits, rows, lens, pre, state, table, boards, False)
            if ok:
                self._launch(logits, rows, lens, pre, state, table, boards, True)
                torch.cuda.synchronize(self.device)
                ok = float(board[0, 0]) == 1.0
                _unregister(board)
            return ok
        finally:
            del board
            os.unlink(path)


# boards mapped in this process, by path: mapped once and kept, so a registered mapping is never
# unmapped under the device (nor its address reused by another mapping while still registered)
_MAPPED: dict[str, Any] = {}


def _mapped(path: str, register: bool) -> Any:
    board = _MAPPED.get(path)
    if board is None:
        try:
            board = np.load(path, mmap_mode="r+")
        except OSError:
            return None
        if register and not _register(board):
            log.warning("confidence monitor: cannot register %s with CUDA; its requests are "
                        "watched but their numbers are not reported", path)  # fmt: skip
            return None
        _MAPPED[path] = board
    return board


def _register(board: Any) -> bool:
    """Page-lock a memory-mapped board for the device (whole pages), so a kernel can write it."""
    import torch

    start = board.ctypes.data & ~4095
    size = (board.ctypes.data + board.nbytes - start + 4095) & ~4095
    if torch.cuda.cudart().cudaHostRegister(start, size, 0).value == 0:
        return True
    try:  # the failure is also left as CUDA's last error, which the next launch would raise
        torch.zeros(1, device="cuda").add_(1)
    except Exception:
        pass
    return False


def _unregister(board: Any) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(board.ctypes.data & ~4095)


class V1Monitor(V1LogitsProcessor):  # type: ignore[misc,valid-type]
    """The monitor in vLLM's V1 model runner, through its public logits-processor interface
    (named in ``logits_processors`` by the worker: ``compat`` monitor-v1). V1 reports the batch
    as rows that requests join, leave, move between and swap; this keeps the row -> slot
    mapping and hands the rest to ``_Watch``."""

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        rows = vllm_config.scheduler_config.max_num_seqs
        vocab = vllm_config.model_config.get_vocab_size()
        self.watch = _Watch(rows, vocab, device, bool(is_pin_memory), lens=False)
        self.rows = np.full(rows, -1, dtype=np.int32)  # batch row -> slot
        self.d_rows: Any = None
        self.rows_changed = True
        self.free = list(range(rows - 1, -1, -1))
        self.prefilling: dict[int, list[int]] = {}  # slot -> output ids, until the first one

    def is_argmax_invariant(self) -> bool:
        return False  # forcing the marker changes greedy picks too

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        _validate(sampling_params)

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self._release(row)
        for row, params, _prompt, output in batch_update.added:
            self._release(row)
            args = (params.extra_args or {}).get(KEY) if params is not None else None
            if args:
                slot = self.free.pop()
                self.watch.watch(slot, args)
                self.rows[row] = slot
                self.prefilling[slot] = output
                self.rows_changed = True
        for a, b, direction in batch_update.moved:
            if direction.name == "SWAP":
                self.rows[[a, b]] = self.rows[[b, a]]
            else:  # a's request now lives at b; a is empty
                self._release(b)
                self.rows[b], self.rows[a] = self.rows[a], -1
            self.rows_changed = True

    def _release(self, row: int) -> None:
        slot = int(self.rows[row])
        if slot >= 0:
            self.watch.drop(slot)
            self.prefilling.pop(slot, None)
            self.free.append(slot)
            self.rows[row] = -1
            self.rows_changed = True

    def apply(self, logits: Any) -> Any:
        if self.watch.active <= 0:
            return logits
        # V1 runs a prefilling row's chunks through here too: its counters restart every step
        # until the step whose token is kept, which is the one before its first output shows
        for slot in [s for s, out in self.prefilling.items() if out]:
            self.watch.started(slot)
            del self.prefilling[slot]
        if self.rows_changed:
            self.d_rows = self.watch.to_device(self.rows)
            self.rows_changed = False
        self.watch.step(logits, self.d_rows, self.rows)
        return logits


class SlotMonitor:
    """The monitor in vLLM's Model Runner V2, which keys every request's state by a slot it
    holds for its whole stay, so requests never move: driven by ``V2Monitor`` (vLLM's public
    V2 interface, 0.32 on) or, on 0.26, which has none, from V2's sampler (``install_v2_hook``)."""

    def __init__(self, slots: int, vocab: int, device: Any, pin: bool, prefill_len: Any) -> None:
        self.watch = _Watch(slots, vocab, device, pin, lens=True)
        self.prefill_len = prefill_len  # vLLM's own, per slot; its device copy changes per step
        self.new: list[int] = []

    def add_request(self, slot: int, sampling_params: Any) -> bool:
        self.watch.drop(slot)  # the slot's last occupant
        args = (sampling_params.extra_args or {}).get(KEY) if sampling_params else None
        if not args:
            return False
        self.watch.watch(slot, args)
        self.new.append(slot)
        return True

    def apply(self, logits: Any, rows: Any, host_rows: Any, pos: Any) -> Any:
        """``rows``: each logits row's slot; ``pos``: the position each row samples for."""
        if self.watch.active <= 0:
            return logits
        self.watch.step(logits, rows, host_rows, pos, self.prefill_len.gpu)
        for slot in self.new:  # zeroed by this step; a slot still prefilling waits uncounted
            self.watch.started(slot)
        self.new.clear()
        return logits


def _validate(sampling_params: Any) -> None:
    args = (sampling_params.extra_args or {}).get(KEY)
    if args is not None and not isinstance(args, dict):
        raise ValueError(f"extra_args[{KEY!r}] must be a dict")


if V2LogitsProcessor is not None:

    class V2Monitor(V2LogitsProcessor):  # type: ignore[misc,valid-type]
        """The monitor in Model Runner V2 through vLLM's public V2 logits-processor interface
        (0.32 on: ``compat`` monitor-v2), named in ``logits_processors`` by the worker. V2 calls
        it after the bias, penalty, bad-words and grammar stages and before temperature."""

        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            from vllm.utils.platform_utils import is_pin_memory_available

            self.monitor = SlotMonitor(
                req_states.max_num_reqs,
                req_states.vocab_size,
                req_states.device,
                is_pin_memory_available(),
                req_states.prefill_len,
            )

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            _validate(sampling_params)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            return self.monitor.add_request(req_idx, sampling_params)

        def apply(self, logits: Any, ctx: Any) -> Any:
            return self.monitor.apply(logits, ctx.expanded_idx_mapping, ctx.idx_mapping_np, ctx.pos)


def install_v2_hook() -> None:
    """vLLM 0.26 only (``compat``: monitor-v2-hook; the plugin installs it only where the
    sampler's source is 0.26's): 0.26's Model Runner V2 has no interface for a custom logits
    processor, and naming one in ``logits_processors`` sends the engine to the slower V1 runner
    (docs/benchmarks.md). So the monitor is called from V2's sampler, on
    the logits after the grammar mask and before penalties and temperature."""
    from vllm.v1.worker.gpu.sample import sampler

    Sampler: Any = sampler.Sampler
    if getattr(Sampler.__init__, "__vqueue__", False):
        return
    stock_init, stock_add, stock_apply = (
        Sampler.__init__,
        Sampler.add_request,
        Sampler.apply_sampling_params,
    )

    def __init__(
        self: Any,
        max_num_reqs: int,
        vocab_size: int,
        device: Any,
        req_states: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        stock_init(self, max_num_reqs, vocab_size, device, req_states, *args, **kwargs)
        from vllm.utils.platform_utils import is_pin_memory_available

        self.vqueue_monitor = SlotMonitor(
            max_num_reqs, vocab_size, device, is_pin_memory_available(), req_states.prefill_len
        )

    def add_request(self: Any, req_idx: int, prompt_len: int, sampling_params: Any) -> None:
        stock_add(self, req_idx, prompt_len, sampling_params)
        self.vqueue_monitor.add_request(req_idx, sampling_params)

    def apply_sampling_params(
        self: Any,
        logits: Any,
        expanded_idx_mapping: Any,
        idx_mapping_np: Any,
        pos: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # the expanded mapping has one entry per logits row; the host one, one per request,
        # matches it unless speculative decoding adds rows, which the host side never needs
        self.vqueue_monitor.apply(logits, expanded_idx_mapping, idx_mapping_np, pos)
        return stock_apply(self, logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs)

    __init__.__vqueue__ = True  # type: ignore[attr-defined]
    Sampler.__init__ = __init__
    Sampler.add_request = add_request
    Sampler.apply_sampling_params = apply_sampling_params
    logging.getLogger("vllm.vqueue").info(
        "vqueue: the confidence monitor runs in Model Runner V2's sampler (vLLM 0.26's hook)"
    )


def _step(x: Any, rows: Any, lens: Any, pre: Any, state: Any, table: Any) -> None:
    """The rule for every row of ``x``, eagerly (the CPU, or no Triton): ``_triton_step``'s
    twin, which the tests hold it to. ``table`` columns are ``_Watch``'s."""
    import torch

    b = x.shape[0]
    slot = rows[:b].long()
    at = slot.clamp(min=0)
    cfg = table[at]
    on = (slot >= 0) & (cfg[:, 0] > 0)
    counting = on if lens is None else on & (lens[:b].long() + 1 >= pre[at].long())
    fresh = (cfg[:, 6] > 0).unsqueeze(1)
    st = torch.where(fresh, torch.zeros_like(state[at]), state[at])
    m = x.amax(dim=-1)
    top1 = -torch.log(torch.exp(x - m.unsqueeze(1)).sum(dim=-1))  # max - logsumexp
    n, total, low, streak, fired = st.unbind(1)
    low = torch.where(n == 0, top1, torch.minimum(low, top1))
    total = total + top1
    n = n + 1.0
    streak = torch.where(top1 < cfg[:, 1], streak + 1.0, torch.zeros_like(streak))
    hit = counting & (streak >= cfg[:, 2]) & (n > cfg[:, 3])
    fired = torch.maximum(fired, hit.float())
    new = torch.stack([n, total, low, streak, fired], dim=1)
    # counted rows take the step; a fresh row still prefilling starts from zero
    state[at[on]] = torch.where(counting.unsqueeze(1), new, st)[on]
    force = hit & (cfg[:, 4] > 0)
    # the marker outweighs every other token by far, so greedy, sampling, top-p and penalties
    # all pick it
    marker = cfg[:, 5].long().unsqueeze(1)
    keep = x.gather(1, marker)
    x.scatter_(1, marker, torch.where(force.unsqueeze(1), torch.full_like(keep, 1e9), keep))


_TRITON: Any = None


def _triton_step() -> Any:
    """The rule as one Triton kernel, one program per logits row: a single pass over the row's
    logits (online max and sum of exponentials), then the counters, the board and the marker.
    Built on first use, so importing this module never needs Triton."""
    global _TRITON
    if _TRITON is not None:
        return _TRITON
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def step(  # type: ignore[no-untyped-def]
        x_ptr, x_stride, vocab, rows_ptr, lens_ptr, pre_ptr, state_ptr, cfg_ptr, boards_ptr,
        HAS_LENS: tl.constexpr, BOARDS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        slot = tl.load(rows_ptr + row).to(tl.int64)
        cfg = cfg_ptr + tl.maximum(slot, 0) * 9
        if (slot >= 0) & (tl.load(cfg) > 0):  # watched rows only: the others cost nothing
            if HAS_LENS:  # a row still prefilling samples a token that is thrown away
                counting = tl.load(lens_ptr + row) + 1 >= tl.load(pre_ptr + slot)
            else:
                counting = slot >= 0
            fresh = tl.load(cfg + 6) > 0
            st = state_ptr + slot * 5
            if counting:
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
                n = tl.where(fresh, 0.0, tl.load(st))
                total = tl.where(fresh, 0.0, tl.load(st + 1))
                low = tl.where(fresh, 0.0, tl.load(st + 2))
                streak = tl.where(fresh, 0.0, tl.load(st + 3))
                fired = tl.where(fresh, 0.0, tl.load(st + 4))
                low = tl.where(n == 0, top1, tl.minimum(low, top1))
                total = total + top1
                n = n + 1.0
                streak = tl.where(top1 < tl.load(cfg + 1), streak + 1.0, 0.0)
                hit = (streak >= tl.load(cfg + 2)) & (n > tl.load(cfg + 3))
                fired = tl.maximum(fired, tl.where(hit, 1.0, 0.0))
                tl.store(st, n)
                tl.store(st + 1, total)
                tl.store(st + 2, low)
                tl.store(st + 3, streak)
                tl.store(st + 4, fired)
                if BOARDS:  # straight into the worker's board, in host memory
                    board = tl.load(cfg + 7).to(tl.int64)
                    if board >= 0:
                        at = tl.load(boards_ptr + board).to(tl.pointer_type(tl.float32))
                        at += tl.load(cfg + 8).to(tl.int64) * 4
                        tl.store(at, n)
                        tl.store(at + 1, total)
                        tl.store(at + 2, low)
                        tl.store(at + 3, fired)
                if hit & (tl.load(cfg + 4) > 0):
                    tl.store(base + tl.load(cfg + 5).to(tl.int64), 1e9)
            elif fresh:
                for c in range(5):
                    tl.store(st + c, 0.0)

    _TRITON = step
    return step
