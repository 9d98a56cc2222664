"""Prompt building per job type, and reading the answer back (code blocks).

System prompts are deliberately short: every system-prompt token is prefilled for every job, and
the seed notes measured a verbose 300-character one adding ~0.2 s to the first token.
"""

from __future__ import annotations

import json
import re

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
