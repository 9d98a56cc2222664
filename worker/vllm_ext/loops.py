"""vLLM's loop check, answered the same way at a cost that does not grow with the cycle lengths
it covers (``compat``: loop-check; the plugin installs it in the engine's scheduler process).

vLLM stops a request whose output ends in ``min_count`` copies of one pattern of ``min..max``
tokens (``SamplingParams.repetition_detection``). Its check runs in the scheduler for every new
token of every running request, trying each pattern size in turn in Python, so its cost grows
with the range: the engine loop is the bottleneck of a small model, and a worker could afford
cycles of up to 32 tokens there. Array items and list entries that loop run 40 to 200 tokens.

``check_sequence_repetition`` here keeps each request's tokens in a byte buffer (four bytes a
token) and looks for earlier occurrences of its last ``PROBE`` tokens within ``max`` tokens (one
C scan of the buffer). Only their distances can be the period of a repeating tail (the tail's
last tokens recur exactly one period back), and each distance is confirmed by one comparison of
two byte slices. Ordinary text seldom repeats eight tokens within a few hundred, so a step costs
each request an append and a scan, whatever the range. The answer is vLLM's own for every input
and setting (``tests/test_loops.py`` holds it to vLLM's function).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

PROBE = 8  # tokens: enough that ordinary text seldom repeats them within a cycle's reach
_ORDER: Any = sys.byteorder  # as array("i") lays a token out, so both ways of appending agree
_STATE = "_vqueue_tail"  # the request's buffer, kept on its own RepetitionDetectionParams


class _Tail:
    """A request's output tokens as bytes (``array('i')``), the last of them only."""

    __slots__ = ("buf", "seen", "tokens")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens  # the request's own list: a state found on another is stale
        self.buf = bytearray()
        self.seen = 0  # tokens of the request appended so far


def check_sequence_repetition(token_ids: Sequence[int], params: Any) -> bool:
    """vLLM's ``check_sequence_repetition`` (``vllm.v1.core.sched.utils``): whether the output
    ends in ``min_count`` copies of a pattern of ``min_pattern_size..max_pattern_size`` tokens.
    Called for each new token of a request, with the request's own token list and its own
    params object, on which the buffer lives from call to call."""
    lo, hi, count = max(params.min_pattern_size, 1), params.max_pattern_size, params.min_count
    n = len(token_ids)
    state = params.__dict__
    tail: _Tail | None = state.get(_STATE)
    if tail is not None and (tail.tokens is not token_ids or tail.seen > n):
        tail = state[_STATE] = _Tail(token_ids)  # its output was cleared, or not its own
    if hi <= 0 or count < 2 or lo > hi or lo * count > n:
        return False
    if tail is None:
        tail = state[_STATE] = _Tail(token_ids)
    buf = tail.buf
    if tail.seen < n:
        start = max(tail.seen, n - hi * count - PROBE)  # older tokens are never compared
        if start > tail.seen:
            buf.clear()
        if n - start == 1:  # a step's token: what nearly every call appends
            buf += token_ids[n - 1].to_bytes(4, _ORDER, signed=True)
        else:
            buf += array("i", token_ids[start:n]).tobytes()
        tail.seen = n
        if len(buf) > 8 * (hi * count + PROBE):  # trimmed now and then, not every token
            del buf[: len(buf) - 4 * (hi * count + PROBE)]
    k = min(PROBE, lo)  # a tail of count >= 2 copies of p >= lo tokens repeats its last lo
    size, width = len(buf), 4 * k
    probe = buf[size - width :]
    # an occurrence starting s tokens before the probe's start is a candidate period s
    low = max(size - width - 4 * hi, 0)
    end = size - 4 * lo  # the occurrence must end at least lo tokens before the buffer does
    while end - low >= width:
        at = buf.rfind(probe, low, end)
        if at < 0:
            return False
        end = at + width - 1  # the next search finds an earlier start
        if at % 4:
            continue  # bytes that straddle two tokens
        period = (size - width - at) // 4
        span = 4 * period * count
        if (
            period * count <= n
            and buf[size - span + 4 * period :] == buf[size - span : -4 * period]
        ):
            return True
    return False


_VLLM: dict[str, Any] = {}  # vLLM's own check, kept when it is replaced
_CALLS = [0]  # calls of the counting check (``use("count")``)


def install() -> None:
    """Put this check in place of vLLM's (the plugin, in the engine's processes), where
    ``check_stop`` finds it: a module global of ``vllm.v1.core.sched.utils``."""
    if use("vqueue") != "vqueue":
        import logging

        logging.getLogger("vllm.vqueue").info(
            "vqueue: the loop check looks for a repeating tail by its last tokens' earlier places"
        )


def use(which: str) -> str:
    """Which check the scheduler of this process calls: ``"vqueue"``, ``"vllm"`` (its own), or
    ``"count"`` (this one, counting its calls, which ``calls`` returns); returns the one it
    replaced. ``benchmarks/loop_cost.py`` switches between them, in the engine core's process."""
    from vllm.v1.core.sched import utils

    now = utils.check_sequence_repetition
    was = "vqueue" if now is check_sequence_repetition else "count" if now is _counted else "vllm"
    if was == "vllm":
        _VLLM.setdefault("check", now)
    utils.check_sequence_repetition = {
        "vqueue": check_sequence_repetition,
        "count": _counted,
        "vllm": _VLLM.get("check", now),
    }[which]
    return was


def calls() -> int:
    return _CALLS[0]


def _counted(token_ids: Sequence[int], params: Any) -> bool:
    _CALLS[0] += 1
    return check_sequence_repetition(token_ids, params)
