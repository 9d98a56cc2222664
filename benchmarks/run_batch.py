"""vqueue against vLLM's own ``run_batch`` on one OpenAI batch file, both engines warm.

    python -m benchmarks.run_batch --model /tmp/models/qwen05 --out $OUT/run-batch --rounds 5

One OpenAI chat file: ``--lines`` requests of about ``--prompt-tokens`` tokens, each answered
with exactly ``--max-tokens`` tokens (vLLM's ``min_tokens`` and ``ignore_eos`` in the body, which
vqueue takes as vLLM's server does). Both sides run that file in alternating rounds, their
engines loaded once and resident side by side:

- ``raw run-batch``: vLLM's ``run_batch(engine_client, args)`` (``vllm.entrypoints.openai
  .run_batch`` on 0.26, ``vllm.entrypoints.launchers.run_batch`` on 0.32), in a process that
  built its engine client once with a worker's engine arguments and runs each round on it;
- ``vqueue``: ``vqueue submit FILE --wait --out OUT`` against one worker.

A round's seconds run from the command (or call) to the last output line written. The output
files' completion tokens are summed on both sides: a ratio of unequal work means nothing, so
the run exits 1 when they differ. Writes run-batch.json; prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from schemas import Settings

from . import plugin_env
from .gpu_suite import own_worker, stop
from .workloads import TextMaker

ROOT = Path(__file__).resolve().parent.parent
RAW, VQUEUE = "raw run-batch", "vqueue"


def write_file(path: Path, model: str, t: TextMaker, lines: int, prompt: int, out: int) -> None:
    """The batch file both sides run: chat requests as OpenAI's guide writes them, with vLLM's
    fields that fix each answer's length."""
    with open(path, "w") as fh:
        for i in range(lines):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Summarize: " + t.tokens(prompt)}],
                "max_tokens": out, "min_tokens": out, "ignore_eos": True, "temperature": 0,
            }  # fmt: skip
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": body}  # fmt: skip
            fh.write(json.dumps(line) + "\n")


def output_tokens(path: Path) -> tuple[int, int]:
    """(requests answered, completion tokens) of an OpenAI batch output file."""
    done = tokens = 0
    for raw in path.read_text().splitlines():
        response = json.loads(raw).get("response") or {}
        usage = (response.get("body") or {}).get("usage")
        if response.get("status_code") == 200 and usage:
            done += 1
            tokens += usage["completion_tokens"]
    return done, tokens


# ---------------------------------------------------------------------- vLLM's run_batch
def _vllm_run_batch() -> tuple[Any, Any, Any]:
    """vLLM's run_batch module, its arguments' parser and ``build_async_engine_client``,
    wherever this vLLM keeps them (0.26 and 0.32 differ)."""
    import importlib

    for name in ("vllm.entrypoints.launchers.run_batch", "vllm.entrypoints.openai.run_batch"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "run_batch") and hasattr(mod, "make_arg_parser"):
            break
    else:
        raise SystemExit("this vLLM has no run_batch module this benchmark knows")
    try:
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    except ImportError:
        from vllm.entrypoints.openai.api_server import build_async_engine_client
    return mod, mod.make_arg_parser, build_async_engine_client


def serve_raw(a: argparse.Namespace) -> None:
    """The raw side's process: one engine client, then a round for each ``RUN in out`` line on
    stdin, answered ``DONE seconds`` on stdout."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from worker.vllm_ext.configure import engine_kwargs

    mod, make_parser, build_client = _vllm_run_batch()
    args = make_parser(FlexibleArgumentParser()).parse_args(
        ["--model", a.model, "-i", "-", "-o", "-"]
    )
    for k, v in engine_kwargs(settings_for(a), a.model).items():  # a worker's engine, stock vLLM
        setattr(args, k, v)
    args.served_model_name = [args.served_model_name]  # the server's list of names

    async def serve() -> None:
        async with build_client(args, usage_context=UsageContext.OPENAI_BATCH_RUNNER) as client:
            print("READY", flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                _, src, dst = line.split()
                args.input_file, args.output_file = src, dst
                t = time.perf_counter()
                await mod.run_batch(client, args)
                print("DONE", time.perf_counter() - t, flush=True)

    asyncio.run(serve())


class RawBatch:
    def __init__(self, a: argparse.Namespace) -> None:
        argv = [sys.executable, "-m", "benchmarks.run_batch", *sys.argv[1:], "--serve-raw"]
        self.log = open(Path(a.out) / "raw.log", "w")  # noqa: SIM115
        env = dict(plugin_env(), VLLM_LOGGING_STREAM="ext://sys.stderr")
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
        )  # fmt: skip
        self.started = time.perf_counter()
        self.start_s = 0.0

    def ready(self) -> None:
        """Wait until its engine is loaded (it loads beside the worker's)."""
        self._expect("READY")
        self.start_s = time.perf_counter() - self.started

    def _expect(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        raise RuntimeError(f"vLLM's run_batch process ended (exit {self.proc.wait()}); raw.log")

    def run(self, src: Path, dst: Path) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"RUN {src} {dst}\n")
        self.proc.stdin.flush()
        return float(self._expect("DONE"))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class VqueueBatch:
    def __init__(self, a: argparse.Namespace) -> None:
        env = dict(VQUEUE_MAX_MODEL_LEN=str(a.max_model_len),
                   VQUEUE_GPU_MEMORY_UTILIZATION=str(a.gpu_memory_utilization),
                   VQUEUE_LOAD_FORMAT=a.load_format)  # fmt: skip
        if a.kv_cache_bytes:
            env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
        w = own_worker("rb", a.model, a.redis, Path(a.out) / "vqueue-worker.log", "-l", "WARNING",
                       **env)  # fmt: skip
        self.w, self.start_s = w, w.start_s
        self.tag = w.name.split("@")[0]

    def run(self, src: Path, dst: Path) -> float:
        env = dict(os.environ, VQUEUE_BROKER_URL=self.w.client.settings.broker_url,
                   VQUEUE_QUEUE=self.tag, VQUEUE_KEY_PREFIX=self.tag)  # fmt: skip
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "producer.cli", "submit", str(src), "--wait",
                        "--out", str(dst), "-q", "--take"], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        return time.perf_counter() - t

    def close(self) -> None:
        stop(self.w.proc, self.w.log, 120)


def settings_for(a: argparse.Namespace) -> Settings:
    return Settings(_env_file=None, model=a.model, max_model_len=a.max_model_len,
                    gpu_memory_utilization=a.gpu_memory_utilization,
                    kv_cache_memory_bytes=a.kv_cache_bytes or None,
                    load_format=a.load_format)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_raw:
        serve_raw(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    served = settings_for(a).served_names()[0]
    t = TextMaker.of_model(a.model)
    src, warm = out / "input.jsonl", out / "warm.jsonl"
    write_file(src, served, t, a.lines, a.prompt_tokens, a.max_tokens)
    write_file(warm, served, t, min(64, a.lines), a.prompt_tokens, a.max_tokens)
    raw = RawBatch(a)
    vq = VqueueBatch(a)
    raw.ready()
    sides = {RAW: raw, VQUEUE: vq}
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"args": vars(a), "start_s": {RAW: raw.start_s, VQUEUE: vq.start_s}}
    try:
        for name, side in sides.items():  # first runs (CUDA graphs, compilation) off the books
            side.run(warm, out / f"warm-{name.split()[0]}.jsonl")
        for r in range(a.rounds):
            order = [RAW, VQUEUE] if r % 2 == 0 else [VQUEUE, RAW]
            for name in order:
                dst = out / f"out-{name.split()[0]}-{r}.jsonl"
                secs = sides[name].run(src, dst)
                done, tokens = output_tokens(dst)
                rows.append({"round": r, "system": name, "seconds": round(secs, 3),
                             "done": done, "completion_tokens": tokens,
                             "jobs_per_s": round(done / secs, 2)})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                dst.unlink()  # the next round writes its own; the counts are kept
            report["rows"] = rows
            (out / "run-batch.json").write_text(json.dumps(report, indent=1))
    finally:
        raw.close()
        vq.close()
    pairs = [(a_, b_) for a_ in rows for b_ in rows if a_["round"] == b_["round"]
             and a_["system"] == VQUEUE and b_["system"] == RAW]  # fmt: skip
    speedups = [b_["seconds"] / a_["seconds"] for a_, b_ in pairs]
    equal = all(a_["completion_tokens"] == b_["completion_tokens"] == a.lines * a.max_tokens
                for a_, b_ in pairs)  # fmt: skip
    report.update(speedup_median=round(statistics.median(speedups), 3),
                  speedup_min=round(min(speedups), 3), equal_work=equal)  # fmt: skip
    (out / "run-batch.json").write_text(json.dumps(report, indent=1))
    print(f"{'round':>5}  {'raw run-batch s':>15}  {'vqueue s':>9}  {'vqueue / run-batch':>18}")
    for (v, rb), x in zip(pairs, speedups, strict=True):
        print(f"{v['round']:>5}  {rb['seconds']:>15.2f}  {v['seconds']:>9.2f}  {x:>17.3f}x")
    print(f"median {report['speedup_median']}x, lowest {report['speedup_min']}x; "
          f"equal work: {equal}")  # fmt: skip
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
