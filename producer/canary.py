"""Canary-gated batches: a sample spread over the input runs first, and the rest is sent only
if its answers look sane (``vqueue submit --canary 2%``).

A batch that goes wrong usually goes wrong everywhere: a schema the model loops on, a template
whose answers all run to ``max_tokens``, a prompt answered in the wrong language. The canary
finds that out on a few jobs instead of a million. Its jobs are the batch's own lines, so
its answers are kept and the full feed skips them (an id with a result is not sent again).
What it checks, each against a ``VQUEUE_CANARY_*`` threshold (``schemas.settings``): the
share failed, ran away (``loop``, ``schema_incomplete``), in another script than the input,
low in confidence (each share taken at the low end of its 95% interval: a canary is a small
sample), and the answers' mean length over their ``max_tokens``.
"""

from __future__ import annotations

import json
import math
import random
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from schemas import BatchStatus, CanaryReport, Envelope, JobResult, Settings

from .inputs import Parsed, read_lines

if TYPE_CHECKING:
    from .client import Client

T = TypeVar("T")

# answers and inputs with fewer letters than this are not judged for their language, nor those
# whose main script holds less than this share of their letters (a mixed text has no one language)
MIN_LETTERS = 20
MAIN_SCRIPT_SHARE = 0.8
RUNAWAY = ("loop", "schema_incomplete")


def parse_share(text: str) -> float:
    """``"2%"`` or ``"0.02"`` as a share in (0, 1]; ``ValueError`` otherwise."""
    raw = text.strip()
    value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    if not 0 < value <= 1:
        raise ValueError(f"{text!r} is not a share of the input between 0% and 100%")
    return value


def spacing(lines: int, share: float, min_jobs: int) -> int:
    """Take every ``spacing``-th of ``lines`` input lines: about ``share`` of them, at least
    ``min_jobs`` (every line, if there are fewer), spread over the whole input."""
    want = min(lines, max(round(lines * share), min_jobs))
    return max(lines // max(want, 1), 1)


def count_lines(path: str) -> int:
    """Non-blank lines of the input at ``path`` (a canary is spread over all of them)."""
    with open(path, "rb") as fh:
        return sum(1 for raw in read_lines(fh) if raw.strip())


def pick(items: Iterable[T], share: float, min_jobs: int, lines: int, seed: str) -> Iterator[T]:
    """The canary's lines of ``items`` (an input's ``lines`` non-blank lines, raw or parsed):
    one at random in each run of n, so that about ``share`` of them, at least ``min_jobs``,
    spread over all of it. A fixed place in each run would see one kind of line of an input
    whose kinds take turns. ``seed`` (the batch id) picks the same lines again for a canary
    that resumes."""
    every = spacing(lines, share, min_jobs)
    rng = random.Random(seed)
    chosen = 0
    for i, item in enumerate(items):
        if i % every == 0:
            chosen = rng.randrange(every)
        if i % every == chosen:
            yield item


def first_owners(
    chosen: dict[int, Parsed],
    lines: Iterable[tuple[int, bytes]],
    parse: Callable[[int, bytes], Parsed],
) -> list[Parsed]:
    """The canary's parsed lines (by line number), each in its id's first valid line: the feed
    keeps that line and reports later ones as duplicates, so a canary that ran a later line
    would answer the id with another line's job. ``lines`` is the input as numbered raw lines;
    only those before the last chosen one are read, and only the few whose id is a chosen
    one's are parsed whole."""
    owner: dict[str, tuple[int, Parsed]] = {}
    for n in sorted(chosen):
        p = chosen[n]
        if p.job is not None and p.job.id not in owner:
            owner[p.job.id] = (n, p)
    last = max((n for n, _ in owner.values()), default=0)
    for n, raw in lines:
        if n >= last:
            break
        ident = _line_id(raw)
        if ident is None or ident not in owner or n >= owner[ident][0]:
            continue
        p = parse(n, raw)
        if p.job is not None and p.job.id == ident:  # an invalid line owns nothing
            owner[ident] = (n, p)
    return [p for _, p in sorted(owner.values(), key=lambda x: x[0])]


def _line_id(raw: bytes) -> str | None:
    """A line's job id as ``producer.inputs`` reads it (``custom_id``, else ``id``), or None."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    ident = obj.get("custom_id", obj.get("id")) if isinstance(obj, dict) else None
    return ident if isinstance(ident, str) else None


def run(
    client: Client,
    batch: str,
    jobs: list[Envelope],
    tick: Callable[[BatchStatus], None] | None = None,
    poll_s: float = 0.5,
) -> tuple[int, CanaryReport]:
    """Send the canary's ``jobs`` into the open ``batch``, wait until the batch's jobs all have
    answers, and judge them: how many were sent, and the report. ``tick`` sees the batch's
    status after each look and may raise to stop waiting (a deadline, the batch gone)."""
    from .errors import BatchNotFound

    handle = client.submit_many(jobs, batch=batch, seal=False)
    while True:
        st = client.store.status(batch)
        if st is None:
            raise BatchNotFound(f"batch {batch} is gone")
        if tick is not None:
            tick(st)
        if st.done >= st.total:
            break
        time.sleep(poll_s)
    sent = len(jobs) - handle.skipped
    return sent, judge(jobs, client.store.iter_all(batch), client.settings)


def script(text: str) -> str | None:
    """The script the text's letters are written in (``LATIN``, ``CJK``, ``CYRILLIC``, ...);
    None with fewer than ``MIN_LETTERS`` letters, or no script holding ``MAIN_SCRIPT_SHARE`` of
    them. Han, kana and hangul count as one: a Chinese question answered in Japanese is not
    what this catches."""
    counts: dict[str, int] = {}
    letters = 0
    for ch in text:
        if not ch.isalpha():
            continue
        letters += 1
        name = unicodedata.name(ch, "")
        word = name.split(" ", 1)[0]
        if word in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL"):
            word = "CJK"
        counts[word] = counts.get(word, 0) + 1
    if letters < MIN_LETTERS:
        return None
    main = max(counts, key=counts.__getitem__)
    return main if counts[main] >= MAIN_SCRIPT_SHARE * letters else None


def _input_text(env: Envelope) -> str:
    job = env.job
    for field in ("text", "instruction", "prompt"):
        value = getattr(job, field, None)
        if isinstance(value, str):
            return value
    messages = getattr(job, "messages", None) or []
    users = [m.content for m in messages if m.role == "user" and isinstance(m.content, str)]
    return users[-1] if users else ""


def _answer_text(result: JobResult) -> str:
    if isinstance(result.data, dict | list):
        return " ".join(_strings(result.data))
    return result.text or ""


def _strings(value: object) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def lower_bound(k: int, n: int, z: float = 1.96) -> float:
    """The lower end of the Wilson score interval of ``k`` in ``n`` (95%): the share a sample
    shows at the least. A canary is judged on it, so that one unlucky job in ten (10%, at
    least 2%) does not pause a batch, while two loops in ten (at least 6%) do."""
    if n == 0:
        return 0.0
    p, q = k / n, z * z / n
    centre = p + q / 2
    margin = z * math.sqrt(p * (1 - p) / n + q / (4 * n))
    return max((centre - margin) / (1 + q), 0.0)


def _asked_long(env: Envelope, cap: int, share: float) -> bool:
    """The job asked for its length (``ignore_eos``, or ``min_tokens`` near ``max_tokens``):
    answers that run to ``max_tokens`` then are what it wanted."""
    job = env.job
    return bool(getattr(job, "ignore_eos", False)) or getattr(job, "min_tokens", 0) >= share * cap


def judge(jobs: Sequence[Envelope], results: Iterable[JobResult], s: Settings) -> CanaryReport:
    """The canary's report on ``results`` (the batch's, one per job of ``jobs``)."""
    by_id = {env.job.id: env for env in jobs}
    n = failed = runaway = low = judged = wrong = free = 0
    length = 0.0
    for res in results:
        env = by_id.get(res.id)
        if env is None:
            continue
        n += 1
        failed += res.status == "failed"
        if env.job.type == "embed":  # a vector has no length, language or confidence to judge
            continue
        runaway += res.error is not None and res.error.type in RUNAWAY
        low += res.low_confidence
        cap = env.job.max_tokens or s.default_max_tokens(env.job.type)
        if not _asked_long(env, cap, s.canary_max_length):
            free += 1
            length += min(res.usage.completion_tokens / cap, 1.0)
        if env.job.type != "codegen":  # code is written in Latin letters whatever is asked
            asked, said = script(_input_text(env)), script(_answer_text(res))
            if asked and said:
                judged += 1
                wrong += asked != said

    def share(k: int) -> float:
        return k / n if n else 0.0

    report = CanaryReport(
        jobs=n,
        failed=share(failed),
        runaway=share(runaway),
        wrong_language=wrong / judged if judged else 0.0,
        low_confidence=share(low),
        length=length / free if free else 0.0,
    )
    checks = (
        ("failed", failed, n, s.canary_max_failed, "failed"),
        ("ran away (loop, schema_incomplete)", runaway, n, s.canary_max_runaway, "runaway"),
        ("answered in another language", wrong, judged, s.canary_max_wrong_language,
         "wrong_language"),
        ("had low confidence", low, n, s.canary_max_low_confidence, "low_confidence"),
    )  # fmt: skip
    for what, k, of, limit, name in checks:
        least = lower_bound(k, of)
        if least > limit:
            env_var = f"VQUEUE_CANARY_MAX_{name.upper()}"
            report.reasons.append(
                f"{k} of {of} {what}, at least {least:.0%} at 95% confidence, over {limit:.0%} "
                f"({env_var})"
            )
    if report.length > s.canary_max_length:
        report.reasons.append(
            f"answers ran to {report.length:.0%} of max_tokens on average, over "
            f"{s.canary_max_length:.0%} (VQUEUE_CANARY_MAX_LENGTH)"
        )
    return report
