#!/bin/bash
# Where a worker's time goes under short jobs on the lent H200: py-spy, GIL holders only, over the
# worker and its children (its intake processes, vLLM's frontend, engine core and GPU worker),
# while one worker runs
# benchmarks/gpu_priority.py's bulk batch (~500-token summaries, 128 output tokens each).
# From the project root, after `source .gpu/b/env.sh` (../shared/gpu/README.md), with py-spy on
# PATH (its manylinux wheel's binary copied into .gpu/b/bin):
#     bash benchmarks/gpu_profile.sh
# Writes $OUT/profile/gil.txt (py-spy's raw collapsed stacks: one line per stack, the process
# and thread first, then the frames, then the sample count);
#     python3 -m benchmarks.gil_profile $OUT/profile/gil.txt
# sums it by process and by stack; $OUT/profile/wall.txt (one intake process, all threads, idle
# included) by thread with --by-thread.
set -u
OUT=${OUT:-/tmp/out}
WORKERS=${WORKERS:-4}
mkdir -p "$OUT/profile"
redis-server --daemonize yes --port 6379 --save "" >/dev/null || true
timeout "${RUN_S:-240}" python3 -m benchmarks.gpu_priority --model /tmp/models/qwen05 \
  --out "$OUT/profile" --bulk "${BULK:-3000}" --policies priority >"$OUT/profile/run.log" 2>&1 &
RUN=$!
# The worker takes 85-135 s to start there (py-spy attached from its start saw only imports,
# 2026-12-01): wait for the heartbeats of the worker and its intake processes (WORKERS, 4 by
# default on a GPU), then let the bulk batch get going, then sample it.
for _ in $(seq 600); do
  python3 -c "import redis, sys; sys.exit(len(list(redis.Redis().scan_iter('*:worker:*'))) < $WORKERS)" \
    && break  # (the device kit has redis-server, not redis-cli)
  sleep 0.5
done
sleep "${LAG_S:-6}"
WPID=$(pgrep -o -f "producer.cli worker|celery.*worker")  # the oldest: the first process
py-spy record --pid "$WPID" --subprocesses --gil --nonblocking --rate "${RATE:-50}" \
  --duration "${DUR_S:-20}" --format raw -o "$OUT/profile/gil.txt" >"$OUT/profile/py-spy.log" 2>&1
# then one intake process, every thread, waiting included: where its consumer's wall clock goes
IPID=$(pgrep -n -f "celery.*-intake1@")
[ -n "$IPID" ] && py-spy record --pid "$IPID" --idle --threads --nonblocking --rate "${RATE:-50}" \
  --duration "${WALL_S:-10}" --format raw -o "$OUT/profile/wall.txt" >>"$OUT/profile/py-spy.log" 2>&1
wait $RUN
tail -5 "$OUT/profile/run.log"
