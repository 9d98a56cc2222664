"""Prompt building per job type, and reading the answer back (code blocks).

System prompts are deliberately short (the defaults live in ``Settings``): every system-prompt
token is prefilled for every job, so a verbose one delays every job's first token
(docs/benchmarks.md, short system prompts).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from schemas import ChatJob, ChatMessage, CodegenJob, ExtractJob, Settings, SummarizeJob

Messages = list[dict[str, Any]]


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
        messages = [_turn(m) for m in job.messages]
        if job.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": job.system})
        return messages
    # After the document, so that jobs sharing an instruction still share their prefix; a
    # small model heeds it there as well (docs/quality.md)
    lang = answer_language(job) if isinstance(job, SummarizeJob | ExtractJob) else None
    if isinstance(job, SummarizeJob):
        ask = "Summarize the following text"
        if job.max_words:
            ask += f" in at most {job.max_words} words"
        if job.style:
            ask += f" ({job.style})"
        user = f"{ask}.\n\n{job.text}"
        if lang:
            user += f"\n\nWrite the summary in {lang}."
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
            last = f"Text:\n{job.text}" + (f"\n\nWrite text values in {lang}." if lang else "")
            return [{"role": "system", "content": system}, *turns,
                    {"role": "user", "content": last}]  # fmt: skip
        user = f"{head}Text:\n{job.text}"
        if lang:
            user += f"\n\nWrite text values in {lang}."
    else:
        # shared code context first, so jobs about the same code share its prefix
        user = f"Existing code:\n```{job.language}\n{job.context}\n```\n\n" if job.context else ""
        user += f"{job.instruction}\n\nAnswer with one ```{job.language} code block."
    system = job.system if job.system is not None else settings.system_prompt(job.type)
    # "" keeps an empty system turn rather than none: Qwen2.5's and SmolLM2's templates insert
    # their own default system prompt (15-30 tokens) when a chat has no system turn at all.
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# Scripts that name one language. Han, Cyrillic, Arabic, Devanagari and Latin are shared by many
# (Cantonese, Ukrainian, Persian, Marathi, French...): text in those is not named, except Han
# without kana, which is Chinese in nearly every document a user sends.
_SCRIPTS = (
    ("Japanese", re.compile("[\u3040-\u30ff]")),  # kana: Japanese, Han or not
    ("Korean", re.compile("[\uac00-\ud7af\u1100-\u11ff]")),
    ("Chinese", re.compile("[\u4e00-\u9fff\u3400-\u4dbf]")),
    ("Thai", re.compile("[\u0e00-\u0e7f]")),
    ("Greek", re.compile("[\u0370-\u03ff]")),
    ("Hebrew", re.compile("[\u0590-\u05ff]")),
)
_LETTER = re.compile(r"[^\W\d_]")
# codes users may give for the answer's language, and the name the prompt uses
LANGUAGE_NAMES = {
    "zh": "Chinese", "zh-cn": "Simplified Chinese", "zh-tw": "Traditional Chinese",
    "ja": "Japanese", "ko": "Korean", "en": "English", "fr": "French", "de": "German",
    "es": "Spanish", "pt": "Portuguese", "it": "Italian", "nl": "Dutch", "ru": "Russian",
    "uk": "Ukrainian", "pl": "Polish", "tr": "Turkish", "ar": "Arabic", "hi": "Hindi",
    "vi": "Vietnamese", "th": "Thai", "el": "Greek", "he": "Hebrew", "id": "Indonesian",
}  # fmt: skip


def script_language(text: str, sample: int = 4000) -> str | None:
    """The language ``text`` is written in, where its script alone says so (Chinese, Japanese,
    Korean, Thai, Greek, Hebrew), from its first ``sample`` characters; None otherwise (Latin
    script included: telling French from English needs a model, and the job's ``language``
    says it instead). Kana anywhere makes Han text Japanese."""
    head = text[:sample]
    if head.isascii():  # most documents, on the per-job path: one C scan, no regex
        return None
    found = [(name, len(pattern.findall(head))) for name, pattern in _SCRIPTS]
    if not any(n for _, n in found):
        return None
    letters = len(_LETTER.findall(head))
    for name, n in found:
        if name == "Japanese" and n >= 0.05 * letters:
            return name
        if n >= 0.3 * letters:
            return name
    return None


def answer_language(job: SummarizeJob | ExtractJob) -> str | None:
    """The language the answer should be in: the job's ``language`` (a code becomes its name),
    else the document's where ``script_language`` names it. A small model asked in English
    about a Chinese text answers in English unless told (docs/quality.md)."""
    if job.language:
        return LANGUAGE_NAMES.get(job.language.lower(), job.language)
    return script_language(job.text)


# Invisible characters that only cost tokens: zero-width space/joiners, word joiner, BOM, soft
# hyphen. Control characters except tab, newline and carriage return.
_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Pasted styling in prose: non-breaking and other wide spaces, runs of blanks, blank-line runs.
_SPACES = re.compile("[\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_RUNS = re.compile("[ \t]{2,}")
_TRAILING = re.compile("[ \t]+\n")
_BLANK_LINES = re.compile("\n{3,}")
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _clean_already(text: str) -> bool:
    """True when ``clean`` would change nothing, found with substring scans (most documents):
    the substring scans cost a fraction of the seven regex passes on a long document."""
    return (
        text.isascii()
        and "\t" not in text
        and "  " not in text
        and " \n" not in text
        and "\n\n\n" not in text
        and "\r" not in text
        and not _ASCII_CONTROL.search(text)
    )


def clean(text: str, prose: bool = True) -> str:
    """``text`` without invisible and control characters (and, for prose, without pasted
    styling). Code keeps its whitespace: indentation is meaning there."""
    if _clean_already(text):
        return text
    text = _CONTROL.sub("", _INVISIBLE.sub("", text.replace("\r\n", "\n")))
    if prose:
        text = _SPACES.sub(" ", text)
        text = _BLANK_LINES.sub("\n\n", _TRAILING.sub("\n", _RUNS.sub(" ", text)))
    return text


# a fenced block of an instruction, fences included; an unclosed one runs to the end
_FENCED = re.compile(r"^[ \t]*```.*?(?:^[ \t]*```[^\n]*$|\Z)", re.DOTALL | re.MULTILINE)
_INDENTED = re.compile(r"^[ \t]+\S", re.MULTILINE)


def clean_instruction(text: str) -> str:
    """An instruction, which may hold code: its fenced blocks keep their whitespace, and so
    does the rest wherever a line of it is indented (a signature with its docstring, pasted
    code without fences); only the prose between is cleaned as prose. Characters that are
    invisible or control are removed everywhere, as in ``clean``."""
    if _clean_already(text):
        return text
    out, at = [], 0
    for m in _FENCED.finditer(text):
        out += [_clean_part(text[at : m.start()]), clean(m.group(0), prose=False)]
        at = m.end()
    out.append(_clean_part(text[at:]))
    return "".join(out)


def _clean_part(text: str) -> str:
    return clean(text, prose=not _INDENTED.search(text))


_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:\n```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block; an unclosed fence (output cut at max_tokens) runs to the end;
    no fence at all means the whole answer is code."""
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip("\n")


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A chat message as chat templates take it: an earlier call's arguments as an object, not
    the JSON text OpenAI sends (vLLM's server converts them the same way), where they parse."""
    turn = message.model_dump(exclude_none=True)
    for call in turn.get("tool_calls", []):
        try:
            call["function"]["arguments"] = json.loads(call["function"].get("arguments", ""))
        except ValueError:
            pass  # left as the text it is
    return turn


def fold_system(messages: Messages) -> Messages:
    """The chat without a system turn, its text leading the first user turn: for chat templates
    that refuse a system role (Gemma's, some Mistral ones). ``messages`` itself when there is
    no system turn to fold."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return messages
    system, user = messages[0]["content"], messages[1]["content"]
    merged = f"{system}\n\n{user}" if system else user
    return [{"role": "user", "content": merged}, *messages[2:]]


class Encoder:
    """The tokenizer's two ways to encode text, safe from many threads at once: ``plain`` (the
    chat template's own text, whose markers are special tokens) and ``literal`` (a job's text,
    whose ``<|im_start|>`` is just characters).

    transformers switches between the two by setting a flag on the one Rust tokenizer it holds
    (``encode_special_tokens``) right before each encode, and encodes with Python's GIL
    released; task threads building prompts at once then flip it under each other. With the
    Qwen2.5 tokenizer and four threads, 47 of 400 encodings came out wrong: a template marker
    spelled out as characters, or a job's text opening a turn. Here each way has a copy of the
    Rust tokenizer with its flag fixed, and encodes through ``encode_batch``, which releases the
    GIL while it works. A tokenizer without a Rust backend (a slow one) is called under a lock.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._ways: dict[bool, Any] = {}
        if backend is not None and hasattr(backend, "encode_special_tokens"):
            from tokenizers import Tokenizer

            spec = backend.to_str()
            for literal in (False, True):
                way = Tokenizer.from_str(spec)
                way.encode_special_tokens = literal
                self._ways[literal] = way

    @classmethod
    def of(cls, tokenizer: Any) -> Encoder:
        """The encoder kept on ``tokenizer`` (built once: the two copies of Qwen2.5's Rust
        tokenizer took a second on a 2-core host); ``tokenizer`` itself when it is one."""
        if isinstance(tokenizer, Encoder):
            return tokenizer
        kept = getattr(tokenizer, "_vqueue_encoder", None)
        if kept is None:
            kept = cls(tokenizer)
            try:
                tokenizer._vqueue_encoder = kept
            except AttributeError:  # a tokenizer class with __slots__: build it each time
                pass
        return kept

    def plain(self, text: str) -> list[int]:
        return self._encode(text, False)

    def literal(self, text: str) -> list[int]:
        return self._encode(text, True)

    def completion(self, text: str) -> list[int]:
        """A bare prompt as vLLM's completions endpoint encodes it: its markers are special
        tokens, and the tokenizer adds its own (a BOS token, where the model has one)."""
        return self._encode(text, False, add_special=True)

    def _encode(self, text: str, literal: bool, add_special: bool = False) -> list[int]:
        way = self._ways.get(literal)
        if way is not None:
            return list(way.encode_batch([text], add_special_tokens=add_special)[0].ids)
        with self._lock:
            return list(
                self.tokenizer.encode(
                    text, add_special_tokens=add_special, split_special_tokens=literal
                )
            )

    @property
    def decodes_outputs(self) -> bool:
        """Whether ``output_text`` can stand in for vLLM's own detokenizing: a Rust tokenizer,
        and a ``tokenizers`` whose ``DecodeStream`` takes the prompt (0.22 and later)."""
        if self._ways.get(False) is None:
            return False
        try:
            from tokenizers.decoders import DecodeStream

            DecodeStream(ids=[], skip_special_tokens=True)
        except (ImportError, TypeError):
            return False
        return True

    def output_text(self, prompt_ids: list[int], ids: Sequence[int], stopped: bool) -> str:
        """The text vLLM's frontend would have made of a request's output ``ids``, made here
        instead (``EngineHost`` sends requests with ``detokenize=False``): a ``DecodeStream``
        primed with the prompt, stepped token by token, special tokens skipped, and the token
        that ended a ``stopped`` request (EOS, a stop token id) left out. That is vLLM's
        ``FastIncrementalDetokenizer`` with the defaults (``skip_special_tokens``), the same in
        0.26 and 0.32: the prompt gives the first token its context (a SentencePiece
        tokenizer's leading space), and a character split over tokens comes out whole."""
        from tokenizers.decoders import DecodeStream

        way = self._ways[False]
        if stopped and ids:
            ids = ids[:-1]
        stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
        parts = []
        for t in ids:
            try:
                piece = stream.step(way, t)
            except (OverflowError, TypeError):  # an id outside the vocabulary: vLLM drops it
                piece = None
            except Exception as exc:
                if not str(exc).startswith("Invalid prefix encountered"):
                    raise
                # non-monotonic UTF-8 breaks the stream's state; vLLM starts a fresh one
                stream = DecodeStream(skip_special_tokens=True)
                piece = stream.step(way, t)
            if piece:
                parts.append(piece)
        return "".join(parts)


def special_token_in(tokenizer: Any, value: Any) -> str | None:
    """The first of the tokenizer's special tokens (``<|im_start|>``, ...) written inside any
    string of ``value`` (keys included), else None. Tools are rendered into the template's own
    text, which is tokenized with its markers read as such; a tool that spells one would open
    a turn of its own, so it is refused instead."""
    if isinstance(tokenizer, Encoder):
        tokenizer = tokenizer.tokenizer
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False):
            specials.add(str(added.content))
    specials.discard("")
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v
        elif isinstance(v, str):
            found = next((t for t in specials if t in v), None)
            if found:
                return found
    return None


def render(
    tokenizer: Any,
    messages: Messages,
    nonce: str = "0",
    known: tuple[str, list[int]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the model's own chat template.

    Message contents are tokenized on their own with special tokens split, so a job's text that
    contains ``<|im_start|>system`` (or any role marker) reads as those characters, never as the
    marker, and cannot open a turn of its own. The template around them is tokenized as usual;
    since contents sit between a newline or a marker and a marker, the ids of ordinary text are
    the same as tokenizing the whole rendered prompt at once.

    ``known``: a document and its ids, already encoded (to measure or cut it): where the last
    message holding it has it, those ids are used rather than encoding it again. On a 32K-token
    document that is half the worker's tokenizing; the text either side is encoded apart, which
    can split the one boundary differently (a newline run), never the text.

    A template that refuses the system turn gets it folded into the first user turn.
    ``tools``: OpenAI's function tools, given to the template as vLLM's server gives them (a
    template that has no place for them leaves them out); the caller refuses tools that spell
    a special token (``special_token_in``). ``tokenizer``: the model's, or its ``Encoder``.
    """
    enc = Encoder.of(tokenizer)
    tokenizer = enc.tokenizer
    # an empty content stays empty, as the template would see it (an assistant turn that only
    # called tools is rendered without a content line)
    slots = [f"VQSLOT{nonce}{i}X" if m["content"] else "" for i, m in enumerate(messages)]
    skeleton = [{**m, "content": slot} for m, slot in zip(messages, slots, strict=True)]
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(
            skeleton, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception:  # noqa: BLE001  # jinja2's TemplateError ("System role not supported")
        folded = fold_system(messages)
        if folded is messages:
            raise
        return render(enc, folded, nonce, known, tools)

    content = enc.literal

    holder = -1
    if known is not None and known[0]:
        holder = next((i for i in reversed(range(len(messages)))
                       if known[0] in messages[i]["content"]), -1)  # fmt: skip
    ids: list[int] = []
    pos = 0
    for i, (m, slot) in enumerate(zip(messages, slots, strict=True)):
        if not slot:
            continue
        at = text.find(slot, pos)
        if at < 0:  # a template that rewrites content: refuse rather than mis-tokenize
            raise ValueError("the chat template altered a message; cannot build the prompt")
        ids += enc.plain(text[pos:at])
        if i == holder and known is not None:
            doc, doc_ids = known
            where = m["content"].find(doc)
            ids += content(m["content"][:where]) if where else []
            ids += doc_ids
            after = m["content"][where + len(doc) :]
            ids += content(after) if after else []
        else:
            ids += content(m["content"])
        pos = at + len(slot)
    ids += enc.plain(text[pos:])
    return ids


def tokenizer_threads(setting: int) -> int:
    """How many task threads may tokenize at once: the setting, else a quarter of the cores this
    process may use, 2 to 8. Tokenizing releases the GIL, so without a bound hundreds of task
    threads encode long documents on every core at once, and vLLM's engine-core and GPU worker
    processes, which need a core each to schedule and launch kernels, wait for one."""
    if setting > 0:
        return setting
    from .vllm_ext.guided import usable_cores  # stdlib only at import: cheap, and once

    return max(2, min(8, usable_cores() // 4))


class PromptTokenizer:
    """The model's tokenizer as jobs use it: chat prompts (``render``), and documents encoded
    and decoded to cut them to a token limit. The engine host holds one; tests use the same
    with the real tokenizer. At most ``threads`` calls tokenize at once (``tokenizer_threads``).
    """

    def __init__(self, tokenizer: Any, nonce: str = "0", threads: int = 0) -> None:
        self.tokenizer, self.nonce = tokenizer, nonce
        self.encoder = Encoder.of(tokenizer)
        self._gate = threading.BoundedSemaphore(tokenizer_threads(threads))

    def chat_prompt(
        self,
        messages: Messages,
        known: tuple[str, list[int]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        with self._gate:
            return render(self.encoder, messages, self.nonce, known, tools)

    def completion_prompt(self, text: str) -> list[int]:
        with self._gate:
            return self.encoder.completion(text)

    def encode(self, text: str) -> list[int]:
        with self._gate:
            return self.encoder.literal(text)

    def decode(self, ids: list[int]) -> str:
        with self._gate:
            return str(self.tokenizer.decode(ids))

    def with_specials(self, text: str) -> list[int]:
        """``text``'s ids between the tokenizer's own special tokens (BERT's ``[CLS]`` and
        ``[SEP]``, a last-token pooler's end token): an embedding model's prompt, as vLLM's
        embeddings endpoint tokenizes it."""
        with self._gate:
            return list(self.tokenizer(text).input_ids)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token on its own, as vLLM's logprobs name them (``convert_ids_to_tokens``, then
        each token made a string alone): a byte-level token that is part of a character reads
        as a replacement character, as in vLLM's server; its ``bytes`` are those of that text."""
        t = self.tokenizer
        return [t.convert_tokens_to_string([tok]) for tok in t.convert_ids_to_tokens(list(ids))]

    @property
    def decodes_outputs(self) -> bool:
        return self.encoder.decodes_outputs

    def output_text(self, prompt_ids: list[int], ids: Sequence[int], stopped: bool) -> str:
        return self.encoder.output_text(prompt_ids, ids, stopped)
