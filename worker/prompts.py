"""Prompt building per job type, and reading the answer back (code blocks).

System prompts are deliberately short (the defaults live in ``Settings``): every system-prompt
token is prefilled for every job, and the seed notes measured a verbose 300-character one adding
~0.2 s to the first token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from schemas import ChatJob, CodegenJob, ExtractJob, Settings, SummarizeJob

Messages = list[dict[str, str]]


def build_messages(
    job: SummarizeJob | ExtractJob | CodegenJob | ChatJob,
    settings: Settings,
    examples: Sequence[Any] = (),
) -> Messages:
    """The chat for ``job``: a system turn (the job's own ``system``, else the per-type
    setting; "" leaves it empty), then one user turn that puts what jobs share first.

    An extract job's template ``examples`` (text, output) come first as finished exchanges:
    the instruction and schema open the first, each later turn is only "Text: ...", and the
    job's own text is the last such turn. All of it but that last turn is a shared prefix."""
    if isinstance(job, ChatJob):
        messages = [m.model_dump() for m in job.messages]
        if job.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": job.system})
        return messages
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
        head = f"{ask}\nJSON Schema: {schema}\n\n"
        if examples:
            turns: Messages = []
            for i, ex in enumerate(examples):
                turns.append(
                    {"role": "user", "content": f"{head if i == 0 else ''}Text:\n{ex.text}"}
                )
                turns.append({"role": "assistant", "content": json.dumps(ex.output)})
            system = job.system if job.system is not None else settings.system_prompt(job.type)
            return [{"role": "system", "content": system}, *turns,
                    {"role": "user", "content": f"Text:\n{job.text}"}]  # fmt: skip
        user = f"{head}Text:\n{job.text}"
    else:
        # shared code context first, so jobs about the same code share its prefix
        user = f"Existing code:\n```{job.language}\n{job.context}\n```\n\n" if job.context else ""
        user += f"{job.instruction}\n\nAnswer with one ```{job.language} code block."
    system = job.system if job.system is not None else settings.system_prompt(job.type)
    # "" keeps an empty system turn rather than none: Qwen2.5's and SmolLM2's templates insert
    # their own default system prompt (15-30 tokens) when a chat has no system turn at all.
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# Invisible characters that only cost tokens: zero-width space/joiners, word joiner, BOM, soft
# hyphen. Control characters except tab, newline and carriage return.
_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Pasted styling in prose: non-breaking and other wide spaces, runs of blanks, blank-line runs.
_SPACES = re.compile("[\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_RUNS = re.compile("[ \t]{2,}")
_TRAILING = re.compile("[ \t]+\n")
_BLANK_LINES = re.compile("\n{3,}")


def clean(text: str, prose: bool = True) -> str:
    """``text`` without invisible and control characters (and, for prose, without pasted
    styling). Code keeps its whitespace: indentation is meaning there."""
    text = _CONTROL.sub("", _INVISIBLE.sub("", text.replace("\r\n", "\n")))
    if prose:
        text = _SPACES.sub(" ", text)
        text = _BLANK_LINES.sub("\n\n", _TRAILING.sub("\n", _RUNS.sub(" ", text)))
    return text


_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:\n```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block; an unclosed fence (output cut at max_tokens) runs to the end;
    no fence at all means the whole answer is code."""
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip("\n")


def fold_system(messages: Messages) -> Messages:
    """The chat without a system turn, its text leading the first user turn: for chat templates
    that refuse a system role (Gemma's, some Mistral ones). ``messages`` itself when there is
    no system turn to fold."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return messages
    system, user = messages[0]["content"], messages[1]["content"]
    merged = f"{system}\n\n{user}" if system else user
    return [{"role": "user", "content": merged}, *messages[2:]]


def render(tokenizer: Any, messages: Messages, nonce: str = "0") -> list[int]:
    """Token ids of ``messages`` rendered with the model's own chat template.

    Message contents are tokenized on their own with special tokens split, so a job's text that
    contains ``<|im_start|>system`` (or any role marker) reads as those characters, never as the
    marker, and cannot open a turn of its own. The template around them is tokenized as usual;
    since contents sit between a newline or a marker and a marker, the ids of ordinary text are
    the same as tokenizing the whole rendered prompt at once.

    A template that refuses the system turn gets it folded into the first user turn.
    """
    slots = [f"VQSLOT{nonce}{i}X" for i in range(len(messages))]
    skeleton = [{**m, "content": slot} for m, slot in zip(messages, slots, strict=True)]
    try:
        text = tokenizer.apply_chat_template(skeleton, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001  # jinja2's TemplateError ("System role not supported")
        folded = fold_system(messages)
        if folded is messages:
            raise
        return render(tokenizer, folded, nonce)
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


class PromptTokenizer:
    """The model's tokenizer as jobs use it: chat prompts (``render``), and documents encoded
    and decoded to cut them to a token limit. The engine host holds one; tests use the same
    with the real tokenizer."""

    def __init__(self, tokenizer: Any, nonce: str = "0") -> None:
        self.tokenizer, self.nonce = tokenizer, nonce

    def chat_prompt(self, messages: Messages) -> list[int]:
        return render(self.tokenizer, messages, self.nonce)

    def encode(self, text: str) -> list[int]:
        return list(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))
