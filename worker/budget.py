"""A job's input fitted to its token budget: its text cleaned, and a document too long for the
context cut (its middle, or its end) so that the prompt and the answer's room fit."""

from __future__ import annotations

from typing import Any

from schemas import (
    ChatJob,
    Settings,
)

from .answers import field_of
from .errors import JobFailed
from .prompts import build_messages, clean, clean_instruction

# Below this many tokens of room an answer is useless; refuse rather than return a stub.
MIN_ANSWER_TOKENS = 16


def clean_job(job: Any) -> tuple[Any, int]:
    """The job with its texts cleaned (``prompts.clean``), and how many characters went."""
    updates: dict[str, Any] = {}
    for name, prose in (("text", True), ("context", False), ("prompt", False)):
        value = field_of(job, name)
        if value:
            updates[name] = clean(value, prose)
    if instruction := field_of(job, "instruction"):  # prose that may hold code
        updates["instruction"] = clean_instruction(instruction)
    if isinstance(job, ChatJob):
        updates["messages"] = [
            m.model_copy(update={"content": clean(m.content, prose=False)}) for m in job.messages
        ]
    removed = sum(len(getattr(job, k)) - len(v) for k, v in updates.items() if k != "messages")
    if "messages" in updates:
        removed += sum(
            len(a.content) - len(b.content)
            for a, b in zip(job.messages, updates["messages"], strict=True)
        )
    return (job.model_copy(update=updates) if removed else job), removed


# The field holding each type's document: what the input limit counts and truncation cuts.
DOCUMENT = {"summarize": "text", "extract": "text", "codegen": "context"}


_MARK = "\n[...]\n"  # where head_tail truncation removed the middle


def fit_input(
    job: Any, engine: Any, settings: Settings, want: int
) -> tuple[Any, int, tuple[str, list[int]] | None]:
    """Apply the job type's input limit with the model's tokenizer: the job, possibly with its
    document cut by the truncation policy, how many tokens were cut, and, when the document had
    to be encoded to tell, the document as it now stands with its ids (for ``render``'s
    ``known``, so that it is not encoded twice).

    The document may have at most ``max_input_tokens`` tokens, and no more than fit the context
    with ``want`` tokens left to answer. Past the type's limit, ``reject`` fails the job with
    ``input_too_long``; past the context, with ``prompt_too_long``.
    """
    if isinstance(job, ChatJob):  # never cut; run_job checks its rendered prompt's length
        return job, 0, None
    limit = job.max_input_tokens or settings.max_input_tokens(job.type)
    field = DOCUMENT[job.type]
    doc = getattr(job, field) or ""
    # the answer's room, and a few tokens of slack: a cut text may re-tokenize a little longer
    fits_context = settings.max_model_len - max(want, MIN_ANSWER_TOKENS) - 8
    if len(doc.encode()) <= min(limit, fits_context):  # a token is at least a byte
        return job, 0, None
    empty = job.model_copy(update={field: ""})
    overhead = len(engine.chat_prompt(build_messages(empty, settings)))
    room = fits_context - overhead
    ids = engine.encode(doc)
    if len(ids) <= min(limit, room):
        return job, 0, (doc, ids)
    policy = job.truncation or settings.truncation(job.type)
    if policy == "reject" or min(limit, room) < 1:
        if len(ids) > limit:
            raise JobFailed(
                "input_too_long",
                f"the {field} is {len(ids)} tokens; the {job.type} limit is {limit} "
                f"(VQUEUE_MAX_INPUT_TOKENS_{job.type.upper()} or the job's max_input_tokens)",
            )
        raise JobFailed(
            "prompt_too_long",
            f"the {field} is {len(ids)} tokens; {max(room, 0)} fit the model's context of "
            f"{settings.max_model_len} with {want} left to answer",
        )
    mark = engine.encode(_MARK)
    keep = max(min(limit, room) - len(mark), 1)
    if policy == "head":
        kept = ids[:keep]
        text = engine.decode(kept)
    elif policy == "tail":
        kept = ids[-keep:]
        text = engine.decode(kept)
    else:
        head, tail = ids[: keep // 2], ids[len(ids) - (keep - keep // 2) :]
        kept = head + mark + tail
        text = engine.decode(head) + _MARK + engine.decode(tail)
    return job.model_copy(update={field: text}), len(ids) - keep, (text, kept)
