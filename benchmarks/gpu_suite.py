"""The GPU suite: raw vLLM vs vqueue end to end vs a Transformers loop, same jobs, one GPU.

    python -m benchmarks.gpu_suite all --model /tmp/models/qwen05 --out $OUT

``all`` runs, one after the other so each has the GPU alone:
  raw      vLLM offline ``LLM.chat`` on all prompts of a workload at once (the ceiling), in a
           subprocess so its GPU memory is returned before the worker starts;
  vqueue   one ``vqueue worker --gpus 0`` process; the Python producer submits every job of a
           workload and collects every result (wall = first submit to last result);
  hf       the seed notes' Transformers ``generate`` loop, batch 1, fp16, on a small sample;
then writes suite.json, suite.md (the table) and suite.png (the plot) under --out.
Workloads: mixed (summarize/extract/codegen), prefix-heavy, long-context (8K), JSON-heavy.
Output lengths are fixed with ignore_eos/min_tokens (random-weights models rarely stop); guided
JSON cannot be forced past its end, so extract jobs fix only max_tokens. Also runs on a CPU host
at a small --scale, which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from benchmarks import plugin_env
from schemas import Job, Settings

from . import workloads as wl

ROOT = Path(__file__).resolve().parent.parent
# prompts exactly as a worker with default settings renders them
_S = Settings(_env_file=None)
_jobs: TypeAdapter[Any] = TypeAdapter(Job)


# ------------------------------------------------------------------------------- helpers
class MemorySampler:
    """Peak GPU memory in use (nvidia-smi, MiB) while a block runs; None without a GPU."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if not shutil.which("nvidia-smi"):
            return
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout.split()
            if out:
                self.peak = max(self.peak or 0, int(out[0]))
            self._stop.wait(0.5)

    def __enter__(self) -> MemorySampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


def stop(proc: subprocess.Popen, log: Any, timeout: float) -> None:
    """SIGTERM (a worker drains, a server shuts down), SIGKILL after ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def launch_worker(
    name: str, env: dict[str, str], log_path: Path, redis_url: str, *extra: str
) -> tuple[subprocess.Popen, Any, float]:
    """A ``vqueue worker`` on GPU 0 (when there is one); returns once its heartbeat shows, with
    its process, its log file and the seconds it took to start."""
    import redis

    r = redis.Redis.from_url(redis_url)
    log = open(log_path, "w")  # noqa: SIM115
    argv = [sys.executable, "-m", "producer.cli", "worker", "-n", name, *extra]
    if shutil.which("nvidia-smi"):
        argv += ["--gpus", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    while not r.exists(f"vqueue:worker:{name}"):
        if proc.poll() is not None or time.perf_counter() - t0 > 600:
            stop(proc, log, 30)
            raise RuntimeError(f"worker did not start (exit {proc.poll()}); see {log_path}")
        time.sleep(0.5)
    return proc, log, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def build(model: str, scale: float, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    t = wl.TextMaker(lambda s: len(tok.encode(s, add_special_tokens=False)))

    def n(x: int) -> int:
        return max(3, round(x * scale))

    makers = {
        "mixed": lambda: wl.mixed(t, n(2000)),
        "prefix": lambda: wl.prefix_heavy(
            t,
            prefixes=max(2, round(50 * min(1, scale * 4))),
            per_prefix=max(2, round(40 * min(1, scale * 4))),
        ),
        "long": lambda: wl.long_context(t, n(300), in_tokens=8000 if scale >= 0.1 else 1500),
        "json": lambda: wl.json_heavy(t, n(1000)),
    }
    return {k: makers[k]() for k in names}


def warmup(a: argparse.Namespace) -> list[dict[str, Any]]:
    """A few jobs of each type first: CUDA graphs, grammar compilation, allocator warm."""
    return wl.mixed(
        wl.TextMaker(lambda s: len(s) // 4, seed=9), max(3, round(48 * min(1, a.scale * 10)))
    )


def settings_for(a: argparse.Namespace) -> Settings:
    return Settings(
        _env_file=None,
        model=a.model,
        max_model_len=a.max_model_len,
        gpu_memory_utilization=a.gpu_memory_utilization,
    )


def summarize(
    name: str,
    system: str,
    wall: float,
    jobs: int,
    out_tokens: int,
    prompt_tokens: int,
    ttft: list[float],
    mem: int | None,
    failed: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "workload": name,
        "system": system,
        "jobs": jobs,
        "failed": failed,
        "wall_s": wall,
        "jobs_per_s": jobs / wall,
        "out_tok_per_s": out_tokens / wall,
        "out_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "gpu_mem_mib": mem,
        **extra,
    }


# ---------------------------------------------------------------------------------- raw
def run_raw(a: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm import LLM

    from worker.prompts import build_messages
    from worker.runner import sampling_params

    from . import engine_setup

    loads = build(a.model, a.scale, a.workloads)
    t0 = time.perf_counter()
    kwargs, _env, plan = engine_setup(settings_for(a), a.model)  # built in this process
    llm = LLM(**kwargs, disable_log_stats=False)
    start_s = time.perf_counter() - t0
    rows = []

    def go(name: str, jobs: list[dict[str, Any]], constrained: bool = True) -> None:
        models = [_jobs.validate_python(j) for j in jobs]
        msgs = [build_messages(m, _S) for m in models]
        params = [sampling_params(m, m.max_tokens or 256) for m in models]
        if not constrained:  # identical prompts (schema text included), no guided decoding
            for p in params:
                p.structured_outputs = None
        with MemorySampler() as mem:
            t = time.perf_counter()
            outs = llm.chat(msgs, params, use_tqdm=False)
            wall = time.perf_counter() - t
        ttft = [
            o.metrics.first_token_latency
            for o in outs
            if getattr(o, "metrics", None) is not None and o.metrics.first_token_latency
        ]
        rows.append(
            summarize(
                name if constrained else f"{name}-unconstrained",
                "raw vLLM",
                wall,
                len(outs),
                sum(len(o.outputs[0].token_ids) for o in outs),
                sum(len(o.prompt_token_ids or []) for o in outs),
                ttft,
                mem.peak,
                engine_start_s=start_s,
            )
        )
        print(json.dumps(rows[-1]), flush=True)

    go("warmup", warmup(a))
    rows.pop()
    for name, jobs in loads.items():
        go(name, jobs)
        if name == "json":
            go(name, jobs, constrained=False)
    return rows


# ------------------------------------------------------------------------------- vqueue
def run_vqueue(a: argparse.Namespace) -> list[dict[str, Any]]:
    import redis

    from producer import Client

    url = a.redis
    r = redis.Redis.from_url(url)
    r.flushdb()
    loads = build(a.model, a.scale, a.workloads)
    env = dict(
        plugin_env(),
        VQUEUE_BROKER_URL=url,
        VQUEUE_QUEUE="bench",
        VQUEUE_MODEL=a.model,
        VQUEUE_MAX_MODEL_LEN=str(a.max_model_len),
        VQUEUE_HEARTBEAT_S="1",
        VQUEUE_GPU_MEMORY_UTILIZATION=str(a.gpu_memory_utilization),
    )
    if a.kv_cache_bytes:
        env["VQUEUE_KV_CACHE_MEMORY_BYTES"] = str(a.kv_cache_bytes)
    if a.profile:  # the real engine plus a sampling profiler thread (benchmarks/profiled_engine.py)
        env["VQUEUE_ENGINE_CLASS"] = "benchmarks.profiled_engine:ProfiledEngine"
        env["VQUEUE_BENCH_PROFILE"] = str(Path(a.out) / "worker-profile.txt")
    log = open(Path(a.out) / "vqueue-worker.log", "w")  # noqa: SIM115
    argv = [sys.executable, "-m", "producer.cli", "worker", "-n", "bench@gpu", "-l", "WARNING"]
    if shutil.which("nvidia-smi"):
        argv += ["--gpus", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows: list[dict[str, Any]] = []
    try:
        while not r.exists("vqueue:worker:bench@gpu"):
            if proc.poll() is not None or time.perf_counter() - t0 > a.start_timeout:
                raise RuntimeError(
                    f"worker did not start (exit {proc.poll()}); see vqueue-worker.log"
                )
            time.sleep(0.5)
        start_s = time.perf_counter() - t0
        client = Client(Settings(_env_file=None, broker_url=url, queue="bench"))

        def go(name: str, jobs: list[dict[str, Any]]) -> None:
            with MemorySampler() as mem:
                t = time.perf_counter()
                batch = client.submit_many(jobs)
                submit_s = time.perf_counter() - t
                res = list(batch.results(timeout=a.timeout))
                wall = time.perf_counter() - t
            done = [x for x in res if x.status == "completed"]
            ttft = [
                x.timings.first_token_at - x.timings.enqueued_at
                for x in done
                if x.timings.first_token_at
            ]
            wait = [(x.timings.started_at or 0) - x.timings.enqueued_at for x in done]
            rows.append(
                summarize(
                    name,
                    "vqueue",
                    wall,
                    len(res),
                    sum(x.usage.completion_tokens for x in res),
                    sum(x.usage.prompt_tokens for x in res),
                    ttft,
                    mem.peak,
                    failed=len(res) - len(done),
                    engine_start_s=start_s,
                    submit_s=submit_s,
                    queue_wait_p50_s=pct(wait, 50),
                    errors=sorted({x.error.type for x in res if x.error}),
                )
            )
            print(json.dumps(rows[-1]), flush=True)

        go("warmup", warmup(a))
        rows.pop()
        for name, jobs in loads.items():
            go(name, jobs)
    finally:
        stop(proc, log, 120)
    return rows


# ----------------------------------------------------------------------------------- hf
def run_hf(a: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.prompts import build_messages

    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float16 if cuda else torch.float32
    )
    model = model.to("cuda" if cuda else "cpu").eval()
    sample = [j for j in build(a.model, a.scale, ["mixed"])["mixed"] if j["type"] != "extract"]
    sample = sample[: a.hf_jobs]
    ttft: list[float] = []
    out_tokens = prompt_tokens = 0
    t = time.perf_counter()
    for j in sample:
        job = _jobs.validate_python(j)
        text = tok.apply_chat_template(
            build_messages(job, _S), add_generation_prompt=True, tokenize=False
        )
        enc = tok(text, return_tensors="pt", add_special_tokens=False).to(model.device)
        n = job.max_tokens or 128
        with torch.no_grad():
            t1 = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, do_sample=False)
            ttft.append(time.perf_counter() - t1)
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out_tokens += out.shape[1] - enc["input_ids"].shape[1]
        prompt_tokens += enc["input_ids"].shape[1]
    wall = time.perf_counter() - t - sum(ttft)  # the first-token probes are not part of the loop
    mem = int(torch.cuda.max_memory_allocated() / 2**20) if cuda else None
    row = summarize(
        "mixed",
        "Transformers generate",
        wall,
        len(sample),
        out_tokens,
        prompt_tokens,
        ttft,
        mem,
        note="batch 1, fp16, sample of the mixed workload",
    )
    print(json.dumps(row), flush=True)
    return [row]


# ------------------------------------------------------------------------------- server
def run_server(a: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's OpenAI-compatible server under a concurrent streaming client (mixed workload)."""
    import asyncio
    import urllib.request

    import aiohttp

    from worker.prompts import build_messages

    port = 8011
    so = json.dumps({"backend": "guidance", "disable_any_whitespace": True})
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        a.model,
        "--port",
        str(port),
        "--max-model-len",
        str(a.max_model_len),
        "--gpu-memory-utilization",
        str(a.gpu_memory_utilization),
        "--structured-outputs-config",
        so,
        "--enable-prefix-caching",
    ]
    if a.kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(a.kv_cache_bytes)]
    log = open(Path(a.out) / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - t0 > a.start_timeout:
                    raise RuntimeError("server did not start; see server.log") from None
                time.sleep(1)
        start_s = time.perf_counter() - t0
        jobs = [_jobs.validate_python(j) for j in build(a.model, a.scale, ["mixed"])["mixed"]]

        def body(job: Any) -> dict[str, Any]:
            b: dict[str, Any] = {
                "model": a.model,
                "messages": build_messages(job, _S),
                "max_tokens": job.max_tokens,
                "temperature": job.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if job.ignore_eos:
                b.update(ignore_eos=True, min_tokens=job.min_tokens)
            if getattr(job, "json_schema", None):
                b["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "out", "schema": job.json_schema},
                }
            return b

        async def one(session: Any, sem: Any, job: Any, out: list) -> None:
            async with sem:
                t = time.perf_counter()
                first, tokens = None, 0
                async with session.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body(job)
                ) as resp:
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices"):
                            first = time.perf_counter() - t
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                out.append((first, tokens, resp.status))

        async def drive(batch: list[Any]) -> tuple[float, list]:
            out: list = []
            sem = asyncio.Semaphore(512)
            timeout = aiohttp.ClientTimeout(total=None)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                t = time.perf_counter()
                await asyncio.gather(*(one(session, sem, j, out) for j in batch))
                return time.perf_counter() - t, out

        asyncio.run(drive([_jobs.validate_python(j) for j in warmup(a)]))
        with MemorySampler() as mem:
            wall, out = asyncio.run(drive(jobs))
        row = summarize(
            "mixed",
            "vLLM OpenAI server",
            wall,
            len(out),
            sum(x[1] for x in out),
            0,
            [x[0] for x in out if x[0] is not None],
            mem.peak,
            failed=sum(1 for x in out if x[2] != 200),
            engine_start_s=start_s,
            note="streaming client, 512 concurrent requests",
        )
        print(json.dumps(row), flush=True)
        return [row]
    finally:
        stop(proc, log, 60)


# ------------------------------------------------------------------------------- report
def report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> str:
    raw = {r["workload"]: r for r in rows if r["system"] == "raw vLLM"}
    lines = [
        "| workload | system | jobs | failed | wall s | jobs/s | output tok/s | TTFT p50 s | "
        "TTFT p99 s | vs raw vLLM | queue overhead ms/job | peak GPU MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = raw.get(r["workload"])
        ratio = overhead = "-"
        if base and r["system"] == "vqueue":
            ratio = f"{r['jobs_per_s'] / base['jobs_per_s']:.1%}"
            overhead = f"{1000 * (r['wall_s'] - base['wall_s']) / r['jobs']:.2f}"
            r["ratio_vs_raw"] = r["jobs_per_s"] / base["jobs_per_s"]

        def f(x: Any, fmt: str = ".2f") -> str:
            return "-" if x is None else format(x, fmt)

        lines.append(
            f"| {r['workload']} | {r['system']} | {r['jobs']} | {r.get('failed', 0)} | "
            f"{f(r['wall_s'])} | {f(r['jobs_per_s'], '.1f')} | {f(r['out_tok_per_s'], ',.0f')} | "
            f"{f(r['ttft_p50_s'])} | {f(r['ttft_p99_s'])} | {ratio} | {overhead} | "
            f"{f(r['gpu_mem_mib'], 'd') if r['gpu_mem_mib'] else '-'} |"
        )
    table = "\n".join(lines)
    (out / "suite.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "suite.md").write_text(table + "\n")
    try:
        plot(rows, out / "suite.png")
    except Exception as exc:  # a plot is nice to have; the table is the result
        print(f"no plot: {exc}", file=sys.stderr)
    return table


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = [
            next((r["out_tok_per_s"] for r in rows if r["workload"] == n and r["system"] == s), 0)
            for n in names
        ]
        ax.bar([k + i * w for k in range(len(names))], vals, w, label=s)
    ax.set_xticks([k + w * (len(systems) - 1) / 2 for k in range(len(names))], names)
    ax.set_ylabel("output tokens / s")
    ax.set_yscale("log")
    ax.set_title("vqueue end to end vs raw vLLM vs Transformers (one GPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["all", "raw", "vqueue", "hf", "server", "report"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply job counts")
    ap.add_argument("--workloads", default="mixed,prefix,long,json")
    ap.add_argument("--systems", default="raw,vqueue,hf")
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-bytes", type=int, default=0)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--hf-jobs", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument(
        "--profile", action="store_true", help="sample the worker's stacks (worker-profile.txt)"
    )
    a = ap.parse_args()
    a.workloads = a.workloads.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    step = {"raw": run_raw, "vqueue": run_vqueue, "hf": run_hf, "server": run_server}
    if a.step not in ("all", "report"):
        rows = step[a.step](a)
        (out / f"{a.step}.json").write_text(json.dumps(rows, indent=2))
        return
    rows: list[dict[str, Any]] = []
    for s in a.systems.split(",") if a.step == "all" else []:
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks.gpu_suite", s, *sys.argv[2:]]
        done = subprocess.run(cmd, cwd=ROOT)
        print(f"== {s}: exit {done.returncode} in {time.perf_counter() - t:.0f}s", flush=True)
    # the table gathers every step's JSON in --out, so steps run in separate calls merge too
    for s in ("raw", "vqueue", "server", "hf"):
        if (out / f"{s}.json").exists():
            rows += json.loads((out / f"{s}.json").read_text())
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.gpu_suite " + " ".join(sys.argv[1:]),
        "gpu": subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if shutil.which("nvidia-smi")
        else "none (CPU)",
    }
    try:
        import vllm

        meta["vllm"] = vllm.__version__
    except Exception:
        pass
    print(report(rows, meta, out))


if __name__ == "__main__":
    main()
