"""Prompt building per job type, and reading the answer back (code blocks).

System prompts are deliberately short: every system-prompt token is prefilled for every job, and
the seed notes measured a verbose 300-character one adding ~0.2 s to the first token.
"""

from __future__ import annotations

import json
import re
from typing import Any

from schemas import ChatJob, CodegenJob, ExtractJob, SummarizeJob

Messages = list[dict[str, str]]

SYSTEM = {
    "summarize": "You summarize text accurately and concisely.",
    "extract": "You extract facts from text as JSON.",
    "codegen": "You write correct, complete code.",
}


def build_messages(job: SummarizeJob | ExtractJob | CodegenJob | ChatJob) -> Messages:
    if isinstance(job, ChatJob):
        return [m.model_dump() for m in job.messages]
    if isinstance(job, SummarizeJob):
        ask = "Summarize the following text"
        if job.max_words:
            ask += f" in at most {job.max_words} words"
        if job.style:
            ask += f" ({job.style})"
        user = f"{ask}.\n\n{job.text}"
    elif isinstance(job, ExtractJob):
        # The schema is in the prompt too: guided decoding enforces its shape, but the model
        # fills the values far better when it can read the field names and descriptions.
        ask = job.instruction or "Extract the information described by this JSON Schema."
        schema = json.dumps(job.json_schema, separators=(",", ":"))
        user = f"{ask}\nJSON Schema: {schema}\n\nText:\n{job.text}"
    else:
        # shared code context first, so jobs about the same code share its prefix
        user = f"Existing code:\n```{job.language}\n{job.context}\n```\n\n" if job.context else ""
        user += f"{job.instruction}\n\nAnswer with one ```{job.language} code block."
    return [{"role": "system", "content": SYSTEM[job.type]}, {"role": "user", "content": user}]


_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:\n```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block; an unclosed fence (output cut at max_tokens) runs to the end;
    no fence at all means the whole answer is code."""
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip("\n")


def render(tokenizer: Any, messages: Messages, nonce: str = "0") -> list[int]:
    """Token ids of ``messages`` rendered with the model's own chat template.

    Message contents are tokenized on their own with special tokens split, so a job's text that
    contains ``<|im_start|>system`` (or any role marker) reads as those characters, never as the
    marker, and cannot open a turn of its own. The template around them is tokenized as usual;
    since contents sit between a newline or a marker and a marker, the ids of ordinary text are
    the same as tokenizing the whole rendered prompt at once.
    """
    slots = [f"VQSLOT{nonce}{i}X" for i in range(len(messages))]
    skeleton = [{**m, "content": slot} for m, slot in zip(messages, slots, strict=True)]
    text = tokenizer.apply_chat_template(skeleton, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    pos = 0
    for m, slot in zip(messages, slots, strict=True):
        at = text.find(slot, pos)
        if at < 0:  # a template that rewrites content: refuse rather than mis-tokenize
            raise ValueError("the chat template altered a message; cannot build the prompt")
        ids += tokenizer.encode(text[pos:at], add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        pos = at + len(slot)
    ids += tokenizer.encode(text[pos:], add_special_tokens=False)
    return ids
