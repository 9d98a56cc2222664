"""vLLM's loop check, answered the same way every ``EVERY`` tokens at a cost that does not grow
with the cycle lengths it covers (``compat``: loop-check; the plugin installs it in the engine's
scheduler process).

vLLM stops a request whose output ends in ``min_count`` copies of one pattern of ``min..max``
tokens (``SamplingParams.repetition_detection``). Its check runs in the scheduler for every new
token of every running request, trying each pattern size in turn in Python, so its cost grows
with the range: the engine loop is the bottleneck of a small model, and a worker could afford
cycles of up to 32 tokens there. Array items and list entries that loop run 40 to 200 tokens.

``check_sequence_repetition`` here answers only when the output's length is a multiple of
``EVERY`` (elsewhere: no loop yet), and then exactly as vLLM's own function would. A step of a
thousand running requests calls the check a thousand times, so what a call costs is paid per
token of every request; a loop runs on once it has started, so it is ended at most
``EVERY - 1`` tokens after vLLM's check would have ended it. It keeps each request's tokens in
a byte buffer (four bytes a token) and looks for earlier occurrences of its last ``PROBE``
tokens within ``max`` tokens (one C scan of the buffer). Only their distances can be the
period of a repeating tail (the tail's last tokens recur exactly one period back), and each
distance is confirmed by one comparison of two byte slices. Ordinary text seldom repeats eight
tokens within a few hundred, so a check costs a request an append and a scan, whatever the
range. ``tests/test_loops.py`` holds it to vLLM's function.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

EVERY = 8  # tokens: the check answers when the output's length is a multiple of this
PROBE = 8  # tokens: enough that ordinary text seldom repeats them within a cycle's reach
_STATE = "_vqueue_tail"  # the request's buffer, kept on its own RepetitionDetectionParams


class _Tail:
    """A request's output tokens as bytes (``array('i')``), the last of them only."""

    __slots__ = ("buf", "last", "seen", "tokens")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens  # the request's own list: a state found on another is stale
        self.buf = bytearray()
        self.seen = 0  # tokens of the request appended so far
        self.last = 0  # the last of them, which a list cleared and refilled no longer holds


def check_sequence_repetition(token_ids: Sequence[int], params: Any) -> bool:
    """vLLM's ``check_sequence_repetition`` (``vllm.v1.core.sched.utils``) where the output's
    length is a multiple of ``EVERY``, else False: whether the output ends in ``min_count``
    copies of a pattern of ``min_pattern_size..max_pattern_size`` tokens. Called for each new
    token of a request, with the request's own token list and its own params object, on which
    the buffer lives from call to call (vLLM gives a request whose output it clears new params,
    and the buffer is also read afresh when the list no longer holds what it appended)."""
    n = len(token_ids)
    if n % EVERY:
        return False
    lo, hi, count = max(params.min_pattern_size, 1), params.max_pattern_size, params.min_count
    state = params.__dict__
    tail: _Tail | None = state.get(_STATE)
    if tail is not None and (
        tail.tokens is not token_ids
        or tail.seen > n
        or (tail.seen and token_ids[tail.seen - 1] != tail.last)
    ):
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
        buf += array("i", token_ids[start:n]).tobytes()
        tail.seen, tail.last = n, token_ids[n - 1]
        if len(buf) > 8 * (hi * count + PROBE):  # trimmed now and then, not every check
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


def install() -> None:
    """Put this check in place of vLLM's (the plugin, in the engine's processes), where
    ``check_stop`` finds it: a module global of ``vllm.v1.core.sched.utils``."""
    if use("vqueue") != "vqueue":
        import logging

        logging.getLogger("vllm.vqueue").info(
            "vqueue: the loop check looks for a repeating tail by its last tokens' earlier places"
        )


def use(which: str) -> str:
    """Which check the scheduler of this process calls: ``"vqueue"`` or ``"vllm"`` (its own);
    returns the one it replaced. ``benchmarks/loop_cost.py`` switches between them, in the
    engine core's process."""
    from vllm.v1.core.sched import utils

    now = utils.check_sequence_repetition
    was = "vqueue" if now is check_sequence_repetition else "vllm"
    if was == "vllm":
        _VLLM.setdefault("check", now)
    utils.check_sequence_repetition = (
        check_sequence_repetition if which == "vqueue" else _VLLM.get("check", now)
    )
    return was
