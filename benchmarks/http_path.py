"""What the HTTP API costs: the same JSONL file through ``vqueue submit --wait`` and through
``vqueue serve`` with the official ``openai`` SDK (upload, create, poll, download the output),
on one worker, in alternating rounds.

    python -m benchmarks.http_path --model /tmp/models/qwen05 --out $OUT/http    # a GPU
    .venv/bin/python -m benchmarks.http_path --stub --out /tmp/http              # the queue alone

Each path is timed from the first byte sent to the last result on disk. Equal work: the same
lines (summaries with a fixed number of output tokens), and the script exits 1 unless both paths
return every job, completed, with the same output-token total. ``--stub`` replaces the engine
with an instant STUB (``benchmarks/stub_engine.py``), which leaves only the two paths' own
costs. Prints a table and writes http-path.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from . import free_port
from . import workloads as wl
from .gpu_suite import launch_worker, stop, worker_env

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--stub", action="store_true", help="an instant stub engine, no model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--in-tokens", type=int, default=500)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"http-{uuid.uuid4().hex[:6]}"
    env = worker_env(
        tag, a.model, a.redis, VQUEUE_FILES_DIR=str(out / "files"), VQUEUE_API_POLL_S="0.2"
    )
    if a.stub:
        env["VQUEUE_ENGINE_CLASS"] = "benchmarks.stub_engine:StubEngine"
        texts = wl.TextMaker(lambda s: len(s) // 4)
    else:
        from worker.models import resolve_model

        texts = wl.TextMaker.of_model(resolve_model(a.model))
    fixed = {"max_tokens": a.out_tokens, "min_tokens": a.out_tokens, "ignore_eos": True}

    def make_file(name: str) -> Path:  # fresh texts each run: nothing cached by the last
        path = out / name
        with open(path, "w") as f:
            for i in range(a.jobs):
                job = {"id": f"j{i}", "type": "summarize", "text": texts.tokens(a.in_tokens)}
                f.write(json.dumps({**job, **fixed}) + "\n")
        return path

    wlog = out / "worker.log"
    proc, log, start_s = launch_worker(f"{tag}@w", env, wlog, a.redis, "-l", "WARNING")
    server, port = start_serve(env, out / "serve.log")
    rows: list[dict[str, Any]] = []
    try:
        key = subprocess.run(
            [sys.executable, "-m", "producer.cli", "keys", "create", "bench"],
            cwd=ROOT, env=env, capture_output=True, check=True,
        ).stdout.decode().strip()  # fmt: skip
        _wait_up(port)
        import openai

        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        _cli(env, make_file("warm.jsonl"), out / "warm-out.jsonl")  # the engine warmed up
        for r in range(a.rounds):
            for path in ("cli", "http") if r % 2 == 0 else ("http", "cli"):
                src = make_file(f"in-{r}-{path}.jsonl")
                dst = out / f"out-{r}-{path}.jsonl"
                t0 = time.perf_counter()
                if path == "cli":
                    _cli(env, src, dst)
                else:
                    _http(sdk, src, dst)
                wall = time.perf_counter() - t0
                rows.append({"round": r, "path": path, "wall_s": wall, **_count(dst, path)})
                rows[-1]["jobs_per_s"] = rows[-1]["completed"] / wall
                print(json.dumps(rows[-1]), flush=True)
                (out / "http-path.json").write_text(json.dumps(
                    {"stub": a.stub, "model": a.model, "jobs": a.jobs, "worker_start_s": start_s,
                     "rows": rows}, indent=2))  # fmt: skip
    finally:
        server.terminate()
        stop(proc, log, 120)
    print("| round | path | jobs/s | completed | output tokens |\n|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['round']} | {x['path']} | {x['jobs_per_s']:.1f} | {x['completed']} | "
              f"{x['tokens']} |")  # fmt: skip
    walls = {p: sum(x["wall_s"] for x in rows if x["path"] == p) for p in ("cli", "http")}
    print(f"the HTTP path at {walls['cli'] / walls['http']:.1%} of vqueue submit's speed")
    bad = [x for x in rows if x["completed"] != a.jobs]
    tokens = {x["tokens"] for x in rows}
    if bad or (not a.stub and len(tokens) > 1):
        print(f"not equal work: {bad or tokens}", file=sys.stderr)
        sys.exit(1)


def start_serve(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A ``vqueue serve`` on a free port with ``env``, its output in ``log``."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    return server, port


def _wait_up(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("vqueue serve did not come up")


def _cli(env: dict[str, str], src: Path, dst: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", str(src), "--wait", "--out", str(dst)],
        cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _http(sdk: Any, src: Path, dst: Path) -> None:
    with open(src, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="24h")
    while (b := sdk.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled"):
        time.sleep(0.2)
    if b.status != "completed" or not b.output_file_id:
        raise RuntimeError(f"batch ended {b.status}: {b.errors}")
    sdk.files.content(b.output_file_id).write_to_file(dst)


def _count(path: Path, kind: str) -> dict[str, int]:
    completed = tokens = 0
    for line in path.read_text().splitlines():
        x = json.loads(line)
        r = x["response"]["body"] if kind == "http" else x
        if r.get("status") == "completed":
            completed += 1
            tokens += r["usage"]["completion_tokens"]
    return {"completed": completed, "tokens": tokens}


if __name__ == "__main__":
    main()
