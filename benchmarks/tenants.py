"""Whether one tenant can slow another through ``vqueue serve``: tenant b's small batch, timed
alone and then while tenant a floods the server (slow schemas that fill the schema checks, a
schema line that once aborted the server, and big batches to validate), in alternating rounds.

    .venv/bin/python -m benchmarks.tenants --out /tmp/tenants

One worker on the instant STUB engine (``benchmarks/stub_engine.py``): what is measured is the
server and the queue, not generation. b's batch is the same in every round (``--jobs`` short
summaries); its time runs from the upload to the batch's end. Prints a table, writes
tenants.json (and ``--results``), and exits 1 if a batch of b's did not complete or the
server's peak memory passed 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .gpu_suite import launch_worker, stop
from .http_path import ROOT, _wait_up, start_serve


def _slow_schema(i: int) -> dict[str, Any]:
    """A distinct schema whose grammar check takes about a second."""
    items = [
        {"type": "array", "maxItems": 32768, "items": {"type": "integer", "minimum": n}}
        for n in range(100 * i, 100 * i + 8)
    ]
    return {"anyOf": items}


def _batch(sdk: Any, path: Path, lines: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with open(path, "rb") as fh:
        f = sdk.files.create(file=fh, purpose="batch")
    return str(
        sdk.batches.create(
            input_file_id=f.id, endpoint="/v1/vqueue/jobs", completion_window="1h"
        ).id
    )


def _until_done(sdk: Any, bid: str, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = sdk.batches.retrieve(bid)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.05)
    raise RuntimeError(f"batch {bid} did not end in {timeout:.0f}s")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=50, help="tenant b's batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flood-lines", type=int, default=20000, help="each of a's two big batches")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--results", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"tenants-{uuid.uuid4().hex[:6]}"
    env = dict(
        VQUEUE_BROKER_URL=a.redis, VQUEUE_QUEUE=tag, VQUEUE_KEY_PREFIX=tag, VQUEUE_HEARTBEAT_S="1",
        VQUEUE_RESULT_CACHE="false",
        VQUEUE_FILES_DIR=str(out / "files"), VQUEUE_API_POLL_S="0.2",
        VQUEUE_ENGINE_CLASS="benchmarks.stub_engine:StubEngine",
        VQUEUE_URGENT_CONCURRENCY="0",  # the stub engine runs no urgent process
    )  # fmt: skip
    env = {**os.environ, **env}
    proc, log, _ = launch_worker(f"{tag}@w", env, out / "worker.log", a.redis, "-l", "WARNING")
    server, port = start_serve(env, out / "serve.log")
    rows: list[dict[str, Any]] = []
    try:
        import openai

        keys = {}
        for t in ("a", "b"):
            keys[t] = subprocess.run(
                [sys.executable, "-m", "producer.cli", "keys", "create", f"{tag}-{t}"],
                cwd=ROOT, env=env, capture_output=True, check=True,
            ).stdout.decode().strip()  # fmt: skip
        _wait_up(port)
        url = f"http://127.0.0.1:{port}/v1"
        sdk = {t: openai.OpenAI(base_url=url, api_key=k, max_retries=0) for t, k in keys.items()}
        mine = [{"id": f"b{i}", "type": "summarize", "text": f"a short note {i}"}
                for i in range(a.jobs)]  # fmt: skip
        _until_done(sdk["b"], _batch(sdk["b"], out / "warm.jsonl", mine))

        def flood(r: int) -> list[str]:
            """a's batches: four of six slow schemas each, the line that aborted the server,
            and two big batches to check and submit."""
            ids = []
            billion = {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000_000}
            for k in range(4):
                lines = [
                    {
                        "id": f"s{k}-{i}",
                        "type": "extract",
                        "text": "x",
                        "json_schema": _slow_schema(1000 * r + 10 * k + i),
                    }
                    for i in range(6)
                ]
                lines.append(
                    {"id": f"x{k}", "type": "extract", "text": "x", "json_schema": billion}
                )
                ids.append(_batch(sdk["a"], out / f"flood-{r}-{k}.jsonl", lines))  # fmt: skip
            for k in range(2):
                lines = [{"id": f"big{k}-{i}", "type": "summarize", "text": f"document {i}"}
                         for i in range(a.flood_lines)]  # fmt: skip
                ids.append(_batch(sdk["a"], out / f"big-{r}-{k}.jsonl", lines))
            return ids

        for r in range(a.rounds):
            for case in ("alone", "flooded") if r % 2 == 0 else ("flooded", "alone"):
                flooding: list[str] = []
                if case == "flooded":
                    t = threading.Thread(target=lambda f=flooding, n=r: f.extend(flood(n)))
                    t.start()
                    time.sleep(0.5)  # a's uploads and checks are under way when b's comes
                t0 = time.perf_counter()
                b = _until_done(sdk["b"], _batch(sdk["b"], out / f"b-{r}-{case}.jsonl", mine))
                wall = time.perf_counter() - t0
                if case == "flooded":
                    t.join()
                    for bid in flooding:  # the flood ends before the next round
                        _until_done(sdk["a"], bid, 900)
                done = b.request_counts.completed
                rows.append({"round": r, "case": case, "wall_s": round(wall, 3),
                             "status": b.status, "completed": done})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        peak = _peak_rss_mb(server.pid)
    finally:
        server.terminate()
        stop(proc, log, 60)
    alone = statistics.median(x["wall_s"] for x in rows if x["case"] == "alone")
    flooded = statistics.median(x["wall_s"] for x in rows if x["case"] == "flooded")
    report = {"jobs": a.jobs, "rounds": a.rounds, "flood_lines": a.flood_lines, "rows": rows,
              "alone_s": alone, "flooded_s": flooded, "flooded_over_alone": flooded / alone,
              "server_peak_rss_mb": round(peak), "measured_at": time.strftime("%Y-%m-%dT%H:%M"),
              "command": " ".join(["python -m benchmarks.tenants", *sys.argv[1:]])}  # fmt: skip
    print("| case | b's batch, median s |\n|---|---|")
    print(f"| alone | {alone:.2f} |\n| beside a's flood | {flooded:.2f} |")
    print(f"flooded / alone: {flooded / alone:.2f}; the server's peak RSS {peak:.0f} MiB")
    for path in filter(None, [out / "tenants.json", a.results]):
        path.write_text(json.dumps(report, indent=2) + "\n")
    bad = [x for x in rows if x["status"] != "completed" or x["completed"] != a.jobs]
    if bad or peak > 1024:
        print(f"failed: {bad or f'peak RSS {peak:.0f} MiB'}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
