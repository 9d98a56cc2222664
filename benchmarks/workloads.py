"""Deterministic benchmark workloads, as vqueue job dicts.

The same jobs feed every system: vqueue submits them; the raw-vLLM and Transformers baselines
render them with ``worker.prompts.build_messages`` so every system sees identical prompts.
Texts are seeded pseudo-English sized in tokens with the model's tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

WORDS = (
    "the of and to in is was for on that with as by at from this be are or an have it not "
    "which but were all their has been one more also had when can there other into only after "
    "most new first these two some time system data report market customer order service team "
    "project policy model value price growth risk energy water city school health court study "
    "result process change level group member company program budget contract account invoice "
    "network server request payment quarter revenue product design quality support research"
).split()

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string"},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "total": {"type": "number"},
            "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
            "paid": {"type": "boolean"},
        },
        "required": ["total", "currency", "paid"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
        },
        "required": ["title", "tags", "priority"],
        "additionalProperties": False,
    },
]

Tokens = Callable[[str], int]


class TextMaker:
    """Seeded pseudo-English with a measured words-to-tokens ratio."""

    def __init__(self, count_tokens: Tokens, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        sample = self.words(2000)
        self.tokens_per_word = count_tokens(sample) / 2000

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def tokens(self, n: int) -> str:
        return self.words(max(1, round(n / self.tokens_per_word)))

    @classmethod
    def of_model(cls, model: str, seed: int = 0) -> TextMaker:
        """Texts measured in ``model``'s own tokens (its tokenizer: a local path or an id)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        return cls(lambda s: len(tok.encode(s, add_special_tokens=False)), seed)


def fixed(out_tokens: int) -> dict[str, Any]:
    """Sampling that makes a random-weights model emit exactly ``out_tokens`` tokens."""
    return {"max_tokens": out_tokens, "min_tokens": out_tokens, "ignore_eos": True}


def mixed(t: TextMaker, n: int, out: int = 128) -> list[dict[str, Any]]:
    """Summarize / extract / codegen in turn, ~500-token inputs."""
    jobs: list[dict[str, Any]] = []
    for i in range(n):
        kind = ("summarize", "extract", "codegen")[i % 3]
        if kind == "summarize":
            jobs.append({"id": f"m{i}", "type": "summarize", "text": t.tokens(500), **fixed(out)})
        elif kind == "extract":
            # guided JSON cannot be forced past its end, so only max_tokens is fixed
            jobs.append(
                {
                    "id": f"m{i}",
                    "type": "extract",
                    "text": t.tokens(450),
                    "json_schema": SCHEMAS[i % len(SCHEMAS)],
                    "max_tokens": out,
                }
            )
        else:
            jobs.append(
                {
                    "id": f"m{i}",
                    "type": "codegen",
                    "language": "python",
                    "instruction": t.tokens(100),
                    "context": t.tokens(350),
                    **fixed(out),
                }
            )
    return jobs


def prefix_heavy(
    t: TextMaker,
    prefixes: int,
    per_prefix: int,
    prefix_tokens: int = 1000,
    suffix_tokens: int = 200,
    out: int = 128,
    seed: int = 1,
) -> list[dict[str, Any]]:
    """``prefixes`` shared documents, ``per_prefix`` questions each, shuffled."""
    docs = [t.tokens(prefix_tokens) for _ in range(prefixes)]
    jobs = [
        {
            "id": f"p{d}-{k}",
            "type": "summarize",
            "text": docs[d] + "\n\nQuestion: " + t.tokens(suffix_tokens),
            **fixed(out),
        }
        for d in range(prefixes)
        for k in range(per_prefix)
    ]
    random.Random(seed).shuffle(jobs)
    return jobs


def long_context(
    t: TextMaker, n: int, in_tokens: int = 8000, out: int = 128
) -> list[dict[str, Any]]:
    return [
        {"id": f"l{i}", "type": "summarize", "text": t.tokens(in_tokens), **fixed(out)}
        for i in range(n)
    ]


def json_heavy(t: TextMaker, n: int, out: int = 256) -> list[dict[str, Any]]:
    return [
        {
            "id": f"x{i}",
            "type": "extract",
            "text": t.tokens(300),
            "json_schema": SCHEMAS[i % len(SCHEMAS)],
            "max_tokens": out,
        }
        for i in range(n)
    ]
