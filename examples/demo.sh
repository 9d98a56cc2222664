#!/usr/bin/env bash
# `make demo`: start one worker on the embedded model, push examples/jobs.jsonl through the real
# queue, print the results as a table, stop the worker. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
VQ=.venv/bin/vqueue
export VQUEUE_QUEUE=${VQUEUE_QUEUE:-vqueue-demo}
work=$(mktemp -d -t vqueue-demo.XXXXXX)
"$VQ" worker -n "demo-$$@%h" -c 16 >"$work/worker.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null && wait $pid 2>/dev/null; true' EXIT

echo "demo: starting a worker (log: $work/worker.log); the engine takes a minute to load" >&2
until "$VQ" ping >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "demo: the worker exited; its log ends with:" >&2; tail -30 "$work/worker.log" >&2; exit 1
  fi
  sleep 2
done

batch=$("$VQ" submit examples/jobs.jsonl --wait --out "$work/results.jsonl" --errors "$work/errors.jsonl")
echo
"$VQ" results "$batch" --table
echo
echo "demo: results in $work/results.jsonl, failures in $work/errors.jsonl" >&2
