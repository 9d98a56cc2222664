"""Guided JSON around the engine: output budgets from schemas, bounded grammar compilation, and
extraction templates turned into prompts.

vLLM compiles each request's grammar inside the engine process, where a pathological schema would
hold up every other request. The worker compiles each distinct schema once itself first, on a
small thread pool and under a time limit, and remembers the outcome by schema hash: a schema that
will not compile in time fails its jobs with ``schema_compile_timeout``, at the cost of a
dictionary lookup for every later job that brings it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from schemas import ExtractJob
from schemas.templates import BUILTIN, Template

from .errors import JobFailed

log = logging.getLogger(__name__)

# -- output budgets ---------------------------------------------------------------------------
# Upper bounds, in characters of compact JSON, for values a schema leaves unbounded.
_STRING_CHARS = 120
_FORMAT_CHARS = {"date": 12, "time": 20, "date-time": 32, "email": 64, "uuid": 38,
                 "ipv4": 17, "ipv6": 41, "hostname": 64, "uri": 120, "duration": 24}  # fmt: skip
_ARRAY_ITEMS = 6
_CHARS_PER_TOKEN = 3.0  # compact JSON in Llama/Qwen-style BPE vocabularies; on the safe side


def schema_token_budget(schema: dict[str, Any], cap: int) -> int:
    """A ``max_tokens`` for JSON satisfying ``schema``: its longest plausible output, with a
    quarter on top, between 32 and ``cap``. Every property is counted, optional ones too, and
    unbounded strings and arrays at generous sizes; a job cut off anyway is retried once with
    twice the room (``runner``)."""
    chars = _chars(schema, schema, 0)
    return max(32, min(cap, int(chars / _CHARS_PER_TOKEN * 1.25) + 16))


def _chars(node: Any, root: dict[str, Any], depth: int) -> int:
    if depth > 16 or not isinstance(node, dict):
        return 64
    if "$ref" in node and isinstance(node["$ref"], str) and node["$ref"].startswith("#/"):
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return _chars(target, root, depth + 1)
    if "const" in node:
        return len(json.dumps(node["const"]))
    if isinstance(node.get("enum"), list) and node["enum"]:
        return max(len(json.dumps(v)) for v in node["enum"])
    options = [o for k in ("anyOf", "oneOf", "allOf") for o in node.get(k, [])]
    if options:
        return max(_chars(o, root, depth + 1) for o in options)
    kinds = node.get("type", "object" if "properties" in node else "string")
    if isinstance(kinds, list):
        return max((_chars({**node, "type": k}, root, depth) for k in kinds), default=64)
    if kinds == "object":
        props = node.get("properties", {})
        return 2 + sum(
            len(json.dumps(k)) + 2 + _chars(v, root, depth + 1) for k, v in props.items()
        )
    if kinds == "array":
        items = node.get("items", {})
        n = node.get("maxItems", max(node.get("minItems", 0), _ARRAY_ITEMS))
        return 2 + n * (_chars(items, root, depth + 1) + 1)
    if kinds == "string":
        if "maxLength" in node:
            return int(node["maxLength"]) * 2 + 2  # escapes may double a character
        return _FORMAT_CHARS.get(node.get("format", ""), _STRING_CHARS)
    if kinds in ("integer", "number"):
        return 16
    if kinds == "boolean":
        return 5
    return 4  # null


# -- what the grammar is built from ------------------------------------------------------------
NUMBER_BOUND = 10**15  # beyond 2**53 JSON numbers are not exact in most parsers anyway


def generation_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema the grammar is compiled from: the job's, with integers and numbers that have
    no bounds given ±10**15. A small model otherwise writes digits until max_tokens (``"age":
    99999...``), which the grammar allows and validation never sees. Any value the bounded
    schema admits, the job's admits too; validation uses the job's own."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        kinds = out.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "integer" in kinds or "number" in kinds:
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = -NUMBER_BOUND
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = NUMBER_BOUND
        return out

    bounded: dict[str, Any] = walk(schema)
    return bounded


# -- grammar compilation ----------------------------------------------------------------------
class GrammarCheck:
    """Compiles each distinct schema once (llguidance, as vLLM's ``guidance`` backend does) with
    a time limit, and remembers the outcome by schema hash."""

    def __init__(self, tokenizer: Any, timeout_s: float, remember: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.remember = remember
        self._ll: Any = None
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, JobFailed | None] = OrderedDict()
        self._running: dict[str, concurrent.futures.Future[str | None]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    def check(self, schema: dict[str, Any]) -> None:
        """Returns if the schema compiles; raises ``JobFailed`` if not, or not in time."""
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        key = hashlib.sha256(text.encode()).hexdigest()
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                known = self._seen[key]
                if known is not None:
                    raise known
                return
            future = self._running.get(key)
            if future is None:  # jobs with the same new schema wait on one compilation
                future = self._running[key] = self._pool.submit(self._compile, text)
        started = time.monotonic()
        outcome: JobFailed | None
        try:
            error = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            outcome = JobFailed(
                "schema_compile_timeout",
                f"the schema's grammar did not compile within {self.timeout_s:g}s "
                "(VQUEUE_SCHEMA_COMPILE_TIMEOUT_S)",
            )
            # the stuck compilation keeps its thread; later schemas get fresh ones
            self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
            log.warning(
                "schema %s: compile timed out after %.1fs", key[:12], time.monotonic() - started
            )
        except Exception as exc:  # noqa: BLE001  # our check broke, not the schema: let vLLM decide
            log.warning("schema %s: compile check failed (%s); left to the engine", key[:12], exc)
            outcome = None
        else:
            outcome = JobFailed("schema_unsupported", error) if error else None
        with self._lock:
            self._running.pop(key, None)
            self._seen[key] = outcome
            while len(self._seen) > self.remember:
                self._seen.popitem(last=False)
        if outcome is not None:
            raise outcome

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now, while the worker starts. It takes
        about a second for a large vocabulary and holds the GIL throughout: built by the first
        schema job instead, it would stall every thread of that worker process (its consumer,
        its answers from the engine) just as the first JSON batch arrives."""
        if self.tokenizer is None:
            return
        try:
            self._tokenizer()
        except Exception as exc:  # noqa: BLE001  # the first check will say it again
            log.warning("the schema check cannot read the tokenizer: %s", exc)

    def _tokenizer(self) -> Any:
        import llguidance.hf

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer)
            return self._ll

    def _compile(self, text: str) -> str | None:
        import llguidance
        import llguidance.numpy as llnp

        ll = self._tokenizer()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(ll, grammar)
        # the first token mask is where the lexer does its work
        mask = llnp.allocate_token_bitmask(1, ll.vocab_size)
        llnp.fill_next_token_bitmask(matcher, mask, 0)
        return (
            f"the schema's grammar does not compile: {matcher.get_error()}"
            if matcher.is_error()
            else None
        )


# -- templates --------------------------------------------------------------------------------
class Templates:
    """Template lookup for the worker: built-ins, then those registered in Redis for the job's
    tenant or shared (re-read at most every ``ttl_s``, so a newly registered one reaches running
    workers quickly)."""

    def __init__(
        self, load: Callable[[str, str | None], Template | None], ttl_s: float = 10.0
    ) -> None:
        self._load = load
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, str | None], tuple[float, Template | None]] = {}

    def get(self, name: str, tenant: str | None = None) -> Template | None:
        if name in BUILTIN:
            return BUILTIN[name]
        hit = self._cache.get((name, tenant))
        if hit is not None and time.monotonic() - hit[0] < self._ttl_s:
            return hit[1]
        try:
            template = self._load(name, tenant)
        except ValidationError as exc:  # stored by an older vqueue, or edited by hand
            raise JobFailed(
                "unknown_template",
                f"the registered template {name!r} no longer reads as one "
                f"({exc.error_count()} problem(s), first: {exc.errors()[0]['msg']}); "
                "register it again with `vqueue templates add`",
            ) from None
        self._cache[(name, tenant)] = (time.monotonic(), template)
        return template


def apply_template(
    job: ExtractJob, templates: Templates | None, tenant: str | None = None
) -> tuple[ExtractJob, list[Any]]:
    """The job with its template's instruction and schema standing in for missing ones, and the
    template's worked examples (none without a template); ``tenant``: the job's, whose own
    templates and the shared ones it may name."""
    if job.template is None:
        return job, []
    template = templates.get(job.template, tenant) if templates else BUILTIN.get(job.template)
    if template is None:
        raise JobFailed(
            "unknown_template",
            f"no extraction template named {job.template!r} (`vqueue templates list`)",
        )
    updates: dict[str, Any] = {}
    if job.json_schema is None:
        updates["json_schema"] = template.json_schema
    if job.instruction is None:
        updates["instruction"] = template.instruction
    return job.model_copy(update=updates), list(template.examples)


# -- tool calls the model writes itself ----------------------------------------------------------
class ToolCallReader:
    """vLLM's tool-call parser (``Settings.tool_call_parser``, vLLM's ``--tool-call-parser``) for
    answers to chat jobs whose ``tool_choice`` is ``auto``: the calls a model writes in its own
    syntax (Hermes' ``<tool_call>{...}</tool_call>``, Llama's JSON, Mistral's ``[TOOL_CALLS]``)
    come back as OpenAI's tool calls, as ``vllm serve --enable-auto-tool-choice`` returns them.

    Through vLLM's parser registry (``vllm.tool_parsers.ToolParserManager``, the one its
    ``--tool-parser-plugin`` extends) and ``extract_tool_calls(text, ChatCompletionRequest)``,
    verified on vLLM 0.26 and 0.32 (docs/vllm-compat.md). A vLLM without them stops the worker
    at start (``ConfigError``), as an unknown parser name does."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from .vllm_ext.configure import ConfigError

        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.tool_parsers import ToolParserManager
        except ImportError as exc:
            raise ConfigError(
                f"VQUEUE_TOOL_CALL_PARSER={name}: this vLLM has no tool-call parsers where "
                f"vqueue looks for them (verified on 0.26 and 0.32): {exc}"
            ) from None
        try:
            self._parser = ToolParserManager.get_tool_parser(name)
        except Exception:  # noqa: BLE001  # vLLM raises KeyError or its own for an unknown name
            raise ConfigError(f"VQUEUE_TOOL_CALL_PARSER={name}: vLLM has no such tool-call "
                              "parser") from None  # fmt: skip
        self._request = ChatCompletionRequest
        self.name, self.tokenizer = name, tokenizer

    def read(self, text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[Any]]:
        """The answer's text before its calls (None when there is none), and its calls as
        ``(name, arguments JSON)`` pairs; no calls: the whole text, and an empty list."""
        request = self._request(
            model="vqueue", messages=[{"role": "user", "content": ""}], tools=tools,
            tool_choice="auto",
        )  # fmt: skip
        parser = self._parser(self.tokenizer, tools=request.tools)  # type: ignore[arg-type]
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [(c.function.name, c.function.arguments) for c in info.tool_calls]
        return info.content, calls
