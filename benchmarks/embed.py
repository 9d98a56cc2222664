"""vqueue's embedding path against vLLM's own engine on the same texts, both engines warm.

    python -m benchmarks.embed --model /tmp/models/bert-base --out $OUT/embed --rounds 5
    python -m benchmarks.embed --shape bert-base --tokenizer-from DIR --out $OUT/embed

One file of ``--lines`` OpenAI ``/v1/embeddings`` lines, each ``--inputs`` texts of about
``--prompt-tokens`` tokens. Both sides embed it in alternating rounds, their engines loaded once
and resident side by side (``--gpu-memory-utilization`` each):

- ``raw AsyncLLM``: a process that built vLLM's ``AsyncLLM`` once with a pooling worker's engine
  arguments; a round reads the file, tokenizes each text as vLLM's embeddings endpoint does (the
  tokenizer's own special tokens, no template) and sends every one to ``AsyncLLM.encode`` at
  once, as ``LLM.embed`` does with a list of texts;
- ``vqueue``: ``vqueue submit FILE --wait --out OUT`` against one worker on the same model.

A round's seconds run from the call (or command) to the last vector in hand (raw) or written
(vqueue). Prompt tokens are summed on both sides and the run exits 1 when they differ: a ratio of
unequal work means nothing. ``--shape bert-base`` writes a BERT-base-shaped model (12 layers,
hidden 768) with the tokenizer and pooling config of the folder ``--tokenizer-from`` (the
embedded all-MiniLM-L6-v2's, by default) and runs it with dummy weights. Writes embed.json;
prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from schemas import Settings

from . import plugin_env
from .gpu_suite import own_worker, stop

ROOT = Path(__file__).resolve().parent.parent
RAW, VQUEUE = "raw AsyncLLM", "vqueue"
# the tokenizer and pooling files a BERT-shaped folder takes from its source
_KEPT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
         "modules.json", "sentence_bert_config.json", "1_Pooling/config.json")  # fmt: skip
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512}  # fmt: skip


def bert_base(src: Path, out: Path) -> Path:
    """A BERT-base-shaped folder: ``src``'s config with BERT-base's sizes, its tokenizer and
    pooling files (sequences up to 512 tokens), no weights (``load_format=dummy``)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **BERT_BASE}, indent=1))
    for name in _KEPT:
        if (src / name).exists():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / name, out / name)
    st = out / "sentence_bert_config.json"
    st.write_text(json.dumps({**json.loads(st.read_text()), "max_seq_length": 512}))
    return out


def write_file(path: Path, model: str, lines: int, inputs: int, tokens: int) -> None:
    """The file both sides embed: distinct texts of about ``tokens`` word pieces each."""
    words = [
        "queue",
        "vector",
        "engine",
        "batch",
        "river",
        "signal",
        "harbor",
        "lantern",
        "meadow",
        "quartz",
        "falcon",
        "copper",
        "orbit",
        "summit",
        "canvas",
        "thunder",
    ]
    with open(path, "w") as fh:
        for i in range(lines):
            texts = []
            for j in range(inputs):
                seed = i * inputs + j
                body = [words[(seed * 7 + k * 13 + k * k) % len(words)] for k in range(tokens - 4)]
                texts.append(f"document {seed}: " + " ".join(body))
            line = {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": texts if inputs > 1 else texts[0]},
            }
            fh.write(json.dumps(line) + "\n")


def prompt_tokens(path: Path) -> tuple[int, int]:
    """(requests answered, prompt tokens) of an embeddings output file."""
    done = tokens = 0
    for line in path.read_text().splitlines():
        body = ((json.loads(line).get("response") or {}).get("body")) or {}
        if "data" in body:
            done += 1
            tokens += body["usage"]["prompt_tokens"]
    return done, tokens


def settings_for(a: argparse.Namespace) -> Settings:
    return Settings(_env_file=None, model=a.model, runner="pooling",
                    gpu_memory_utilization=a.gpu_memory_utilization,
                    load_format=a.load_format)  # fmt: skip


def serve_raw(a: argparse.Namespace) -> None:
    """The raw side's process: one ``AsyncLLM``, then a round for each ``RUN file`` line on
    stdin, answered ``DONE seconds requests tokens`` on stdout."""
    from vllm import AsyncEngineArgs
    from vllm.pooling_params import PoolingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from worker.vllm_ext.configure import engine_kwargs

    args = AsyncEngineArgs(**engine_kwargs(settings_for(a), a.model))
    engine = AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)

    async def one(ids: list[int], rid: str) -> int:
        final: Any = None
        async for out in engine.encode({"prompt_token_ids": ids}, PoolingParams(task="embed"),
                                       rid):  # fmt: skip
            final = out
        _ = final.outputs.data.float().cpu().numpy().tolist()  # the vector in hand, as floats
        return len(ids)

    async def serve() -> None:
        tokenizer = engine.get_tokenizer()
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        n = 0
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            src = line.split()[1]
            t = time.perf_counter()
            texts = []
            for raw in Path(src).read_text().splitlines():
                x = json.loads(raw)["body"]["input"]
                texts += x if isinstance(x, list) else [x]
            tasks = []
            for text in texts:
                n += 1
                tasks.append(one(tokenizer(text).input_ids, f"r{n}"))
            counts = await asyncio.gather(*tasks)
            print("DONE", time.perf_counter() - t, len(texts), sum(counts), flush=True)
        engine.shutdown()

    asyncio.run(serve())


class Raw:
    def __init__(self, a: argparse.Namespace) -> None:
        argv = [sys.executable, "-m", "benchmarks.embed", *sys.argv[1:], "--serve-raw",
                "--model", a.model, "--load-format", a.load_format]  # fmt: skip
        self.log = open(Path(a.out) / "raw.log", "w")  # noqa: SIM115
        env = dict(plugin_env(), VLLM_LOGGING_STREAM="ext://sys.stderr")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.started = time.perf_counter()
        self.start_s = 0.0

    def ready(self) -> None:
        self._expect("READY")
        self.start_s = time.perf_counter() - self.started

    def _expect(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        raise RuntimeError(f"the raw AsyncLLM process ended (exit {self.proc.wait()}); raw.log")

    def run(self, src: Path, dst: Path) -> tuple[float, int, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"RUN {src}\n")
        self.proc.stdin.flush()
        secs, _texts, tokens = self._expect("DONE").split()
        lines = len(src.read_text().splitlines())
        return float(secs), lines, int(tokens)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Vqueue:
    def __init__(self, a: argparse.Namespace) -> None:
        env = dict(VQUEUE_GPU_MEMORY_UTILIZATION=str(a.gpu_memory_utilization),
                   VQUEUE_LOAD_FORMAT=a.load_format, VQUEUE_RUNNER="pooling")  # fmt: skip
        w = own_worker("emb", a.model, a.redis, Path(a.out) / "vqueue-worker.log", "-l",
                       "WARNING", **env)  # fmt: skip
        self.w, self.start_s = w, w.start_s
        self.tag = w.name.split("@")[0]

    def run(self, src: Path, dst: Path) -> tuple[float, int, int]:
        env = dict(os.environ, VQUEUE_BROKER_URL=self.w.client.settings.broker_url,
                   VQUEUE_QUEUE=self.tag, VQUEUE_KEY_PREFIX=self.tag)  # fmt: skip
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "producer.cli", "submit", str(src), "--wait",
                        "--out", str(dst), "-q", "--take"], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        secs = time.perf_counter() - t
        done, tokens = prompt_tokens(dst)
        dst.unlink()
        return secs, done, tokens

    def close(self) -> None:
        stop(self.w.proc, self.w.log, 120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--shape", choices=["bert-base"], help="a model of this shape, dummy weights")
    ap.add_argument("--tokenizer-from", default="", help="the folder --shape takes them from")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lines", type=int, default=4000)
    ap.add_argument("--inputs", type=int, default=4, help="texts a line")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_raw:
        serve_raw(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.shape:
        from worker.models import resolve_model

        src = Path(a.tokenizer_from or resolve_model("all-minilm-l6-v2"))
        a.model, a.load_format = str(bert_base(src, out / "model")), "dummy"
    served = settings_for(a).served_names()[0]
    src, warm = out / "input.jsonl", out / "warm.jsonl"
    write_file(src, served, a.lines, a.inputs, a.prompt_tokens)
    write_file(warm, served, min(64, a.lines), a.inputs, a.prompt_tokens)
    raw, vq = Raw(a), Vqueue(a)
    raw.ready()
    sides = {RAW: raw, VQUEUE: vq}
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"args": vars(a), "start_s": {RAW: raw.start_s, VQUEUE: vq.start_s}}
    try:
        for name, side in sides.items():  # first runs off the books
            side.run(warm, out / f"warm-{name.split()[0]}.jsonl")
        for r in range(a.rounds):
            for name in [RAW, VQUEUE] if r % 2 == 0 else [VQUEUE, RAW]:
                secs, done, tokens = sides[name].run(src, out / f"out-{name.split()[0]}.jsonl")
                texts = done * a.inputs
                rows.append({"round": r, "system": name, "seconds": round(secs, 3),
                             "requests": done, "texts": texts, "prompt_tokens": tokens,
                             "texts_per_s": round(texts / secs, 1)})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            report["rows"] = rows
            (out / "embed.json").write_text(json.dumps(report, indent=1))
    finally:
        raw.close()
        vq.close()
    pairs = [(v, w) for v in rows for w in rows if v["round"] == w["round"]
             and v["system"] == VQUEUE and w["system"] == RAW]  # fmt: skip
    ratios = [w["seconds"] / v["seconds"] for v, w in pairs]
    equal = all(v["prompt_tokens"] == w["prompt_tokens"] and v["requests"] == a.lines
                for v, w in pairs)  # fmt: skip
    report.update(ratio_median=round(statistics.median(ratios), 3),
                  ratio_min=round(min(ratios), 3), equal_work=equal)  # fmt: skip
    (out / "embed.json").write_text(json.dumps(report, indent=1))
    print(f"{'round':>5}  {'raw AsyncLLM s':>14}  {'vqueue s':>9}  {'vqueue / raw':>12}")
    for (v, w), x in zip(pairs, ratios, strict=True):
        print(f"{v['round']:>5}  {w['seconds']:>14.2f}  {v['seconds']:>9.2f}  {x:>11.1%}")
    print(f"vqueue at {report['ratio_median']:.1%} of raw (median), lowest "
          f"{report['ratio_min']:.1%}; equal work: {equal}")  # fmt: skip
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
