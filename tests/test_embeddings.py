"""Embedding jobs on a real pooling worker (all-MiniLM-L6-v2, the embedded embedding model, on
vLLM's pooling runner), beside a real generating worker on the same queue: OpenAI
``/v1/embeddings`` lines through ``vqueue serve`` and the ``openai`` SDK, vqueue's own ``embed``
jobs through ``vqueue submit``, each vector checked against sentence-transformers on the same
texts (docs/jobs.md, docs/http-api.md)."""

from __future__ import annotations

import base64
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from .conftest import Procs, WorkerProc, free_port, run_cli, wait_for, worker_env

pytestmark = pytest.mark.engine

QUEUE = "embeddings"
EMBEDDER = "all-minilm-l6-v2"
GENERATOR = "smollm2-135m-instruct"
# declared Matryoshka dimensions (VQUEUE_HF_OVERRIDES), so that lines may ask for `dimensions`
DIMS = [384, 128, 64]
TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Redis keeps the queue; vLLM computes the vectors.",
    "Ein Satz auf Deutsch, damit nicht alles Englisch ist.",
]


@pytest.fixture(scope="module")
def workers(module_procs: Procs, redis_client: Any) -> tuple[WorkerProc, WorkerProc]:
    """A pooling worker and a generating one, on one queue; the result cache on for both."""
    pooling = module_procs.worker(
        "embedder", QUEUE, VQUEUE_MODEL=EMBEDDER, VQUEUE_RESULT_CACHE="true",
        VQUEUE_HF_OVERRIDES=json.dumps({"matryoshka_dimensions": DIMS}),
        VQUEUE_MAX_MODEL_LEN=None,  # the model's own length
    )  # fmt: skip
    generating = module_procs.worker("generator", QUEUE, VQUEUE_MODEL=GENERATOR)
    pooling.wait_ready(redis_client)
    generating.wait_ready(redis_client)
    return pooling, generating


@pytest.fixture(scope="module")
def reference() -> Any:
    """sentence-transformers on the same weights: the vectors vLLM's must equal."""
    from sentence_transformers import SentenceTransformer

    from worker.models import resolve_model

    return SentenceTransformer(resolve_model(EMBEDDER), device="cpu")


def _cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _line(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": EMBEDDER, **body}}  # fmt: skip


def _serve(procs: Procs, tmp: Path) -> openai.OpenAI:
    made = run_cli("keys", "create", "embed-team")
    assert made.returncode == 0, made.stderr
    port = free_port()
    env = worker_env(QUEUE, VQUEUE_FILES_DIR=str(tmp / "files"), VQUEUE_API_POLL_S="0.2")
    log = open(tmp / "serve.log", "w")  # noqa: SIM115
    procs.popen([sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
                env=env, stdout=log, stderr=log)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2):
                return True
        except OSError:
            return False

    wait_for(up, 60, "vqueue serve to answer")
    return openai.OpenAI(base_url=url + "/v1", api_key=made.stdout.decode().strip(),
                         max_retries=0)  # fmt: skip


def test_an_embeddings_batch_through_the_sdk_equals_sentence_transformers(
    workers: Any, reference: Any, procs: Procs, tmp_path: Path
) -> None:
    # Given `vqueue serve` and a batch file of /v1/embeddings lines: a string, a list of
    # strings, base64 vectors, fewer dimensions, and a line naming the generating model
    sdk = _serve(procs, tmp_path)
    lines = [
        _line("one", input=TEXTS[0]),
        _line("many", input=TEXTS),
        _line("b64", input=TEXTS[1], encoding_format="base64"),
        _line("short", input=TEXTS[2], dimensions=64),
        _line("wrong", input=TEXTS[0]) | {"body": {"model": GENERATOR, "input": TEXTS[0]}},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    # When it runs to its end
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    b = wait_for(lambda: (x := sdk.batches.retrieve(b.id)).status in ("completed", "failed")
                 and x, 600, "the batch to end")  # fmt: skip
    assert b.status == "completed", b
    out = {x["custom_id"]: x for x in map(json.loads, sdk.files.content(b.output_file_id).text
                                          .splitlines())}  # fmt: skip
    # Then every vector is sentence-transformers' for the same text (cosine >= 0.9999) in
    # OpenAI's embeddings response body, usage counting the prompt tokens
    want = reference.encode(TEXTS, normalize_embeddings=True)
    one = out["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == EMBEDDER
    assert one["data"][0]["object"] == "embedding" and len(one["data"][0]["embedding"]) == 384
    assert _cosine(one["data"][0]["embedding"], want[0]) >= 0.9999
    assert one["usage"]["prompt_tokens"] == len(reference.tokenizer(TEXTS[0])["input_ids"])
    many = out["many"]["response"]["body"]["data"]
    assert [d["index"] for d in many] == [0, 1, 2, 3]
    assert all(_cosine(d["embedding"], w) >= 0.9999 for d, w in zip(many, want, strict=True))
    raw = base64.b64decode(out["b64"]["response"]["body"]["data"][0]["embedding"])
    assert _cosine(np.frombuffer(raw, dtype="<f4"), want[1]) >= 0.9999
    short = out["short"]["response"]["body"]["data"][0]["embedding"]
    assert len(short) == 64 and _cosine(short, want[2][:64]) >= 0.9999
    # and the line naming a generating model for embeddings failed alone, in OpenAI's shape
    wrong = out.get("wrong") or next(
        json.loads(x) for x in sdk.files.content(b.error_file_id).text.splitlines()
        if json.loads(x)["custom_id"] == "wrong"
    )  # fmt: skip
    assert wrong["response"]["status_code"] == 400, wrong
    assert wrong["response"]["body"]["error"]["code"] == "wrong_model_kind"


def test_a_file_mixing_chat_and_embed_lines_completes_on_both_kinds_of_worker(
    workers: Any, reference: Any, tmp_path: Path
) -> None:
    # Given one file of chat lines and embed jobs, some naming no model, on a queue with a
    # pooling and a generating worker
    lines = []
    for i, text in enumerate(TEXTS):
        lines.append({"id": f"e{i}", "type": "embed", "input": text})
        lines.append({"id": f"c{i}", "type": "chat", "max_tokens": 8,
                      "messages": [{"role": "user", "content": text}]})  # fmt: skip
    lines.append({"custom_id": "o1", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": [TEXTS[0], TEXTS[1]]}})  # fmt: skip
    src, dst = tmp_path / "mixed.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # When it is submitted and waited for
    done = run_cli("submit", str(src), "--wait", "--out", str(dst), queue=QUEUE, timeout=600)
    # Then every line completed, each on the worker of its kind
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = {r.get("custom_id") or r["id"]: r for r in map(json.loads, dst.open())}
    assert len(results) == len(lines)
    want = reference.encode(TEXTS, normalize_embeddings=True)
    for i in range(len(TEXTS)):
        e, c = results[f"e{i}"], results[f"c{i}"]
        assert e["status"] == "completed" and "embedder" in e["worker"], e
        assert _cosine(e["embeddings"][0], want[i]) >= 0.9999
        assert c["status"] == "completed" and "generator" in c["worker"] and c["text"], c
    o1 = results["o1"]["response"]["body"]["data"]
    assert len(o1) == 2 and _cosine(o1[1]["embedding"], want[1]) >= 0.9999


def test_a_text_over_the_model_length_is_refused_or_cut_by_its_truncation_policy(
    workers: Any, reference: Any, tmp_path: Path
) -> None:
    # Given a text far over the model's 256 tokens (sentence-transformers' max_seq_length)
    long = " ".join(f"word{i}" for i in range(600))
    lines = [
        {"id": "reject", "type": "embed", "input": long},
        {"id": "head", "type": "embed", "input": long, "truncation": "head"},
        {"id": "head-again", "type": "embed", "input": long, "truncation": "head"},
    ]
    src, dst = tmp_path / "long.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    # When they run
    done = run_cli("submit", str(src), "--wait", "--out", str(dst), queue=QUEUE, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = {r["id"]: r for r in map(json.loads, dst.open())}
    # Then by default it fails alone, naming the limit, as OpenAI's and vLLM's servers refuse it
    assert results["reject"]["error"]["type"] == "input_too_long", results["reject"]
    assert "limit is 256" in results["reject"]["error"]["message"]
    # and cut at its head it is what sentence-transformers embeds (which keeps the head too),
    # the tokens cut counted
    head = results["head"]
    assert head["status"] == "completed" and head["input_tokens_truncated"] > 0, head
    assert results["head-again"]["input_tokens_truncated"] == head["input_tokens_truncated"]
    want = reference.encode([long], normalize_embeddings=True)[0]
    assert _cosine(head["embeddings"][0], want) >= 0.9999
    # and of the same job twice, whichever ran first, the other is answered from the result
    # cache, with the same vector
    again = results["head-again"]
    assert {head["cached"], again["cached"]} == {True, False}, (head, again)
    assert again["embeddings"] == head["embeddings"]
