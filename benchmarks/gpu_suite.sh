#!/bin/bash
# The throughput suite on the lent H200, one device call per model shape (docs/benchmarks.md).
# From the project root, after `source .gpu/b/env.sh` (../shared/gpu/README.md):
#     bash benchmarks/gpu_suite.sh small   # Qwen2.5-0.5B shape: mixed, prefix, long, long32k, json
#     bash benchmarks/gpu_suite.sh 7b      # Qwen2.5-7B shape (dummy weights): mixed, long
# Results under $OUT (suite-*/suite.json, suite.md, the logs).
# SCALE multiplies every workload's job count, SCALE_OF one's (prefix=2,long32k=1).
# WORKLOADS runs some of them (one call's 600 s do not hold all five at full size; merge the
# calls' suite.json with `python -m benchmarks.gpu_suite --merge A B --out DIR`).
# ROUNDS: paired rounds (3). KV_GIB sizes each engine's KV cache (small: 24; 7b: 20) and UTIL
# its share of the card (0.28): four engines of the small shape fit an 80 GB card at KV_GIB=13
# UTIL=0.2. For the 7B shape: raw vLLM and the worker both stay loaded, about
# 15 GiB of weights and 4 GiB of graphs and activations each beside it, so an 80 GB card needs
# KV_GIB=12.
# START_TOGETHER=1 starts raw vLLM and the worker at once (--start-together): one engine start
# less per call, which on a cold machine is what keeps three rounds out of one call.
# SYSTEMS picks a subset (LLM.chat, the slower raw path on every workload, costs a minute of
# engine start and a third of each round): SYSTEMS="raw AsyncLLM,vqueue".
set -u
OUT=${OUT:-/tmp/out}
SYSTEMS=${SYSTEMS:-raw LLM.chat,raw AsyncLLM,vqueue}
mkdir -p "$OUT"
redis-server --daemonize yes --port 6379 --save "" >/dev/null || true  # already running: fine
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$OUT/gpu-$1.txt" 2>&1
case "$1" in
small)
  python3 -m benchmarks.gpu_suite --model /tmp/models/qwen05 --out "$OUT/suite-05b" \
    --rounds "${ROUNDS:-3}" --scale "${SCALE:-0.6}" --scale-of "${SCALE_OF:-}" \
    --budget-s "${BUDGET:-470}" --systems "$SYSTEMS" \
    --workloads "${WORKLOADS:-mixed,prefix,long,long32k,json}" \
    ${KV_GIB:+--kv-cache-bytes $((KV_GIB * 1024 ** 3))} ${UTIL:+--gpu-memory-utilization $UTIL} \
    ${START_TOGETHER:+--start-together} ;;
7b)
  python3 -m benchmarks.shapes qwen2.5-7b /tmp/models/qwen7b --tokenizer /tmp/models/qwen25-tokenizer
  python3 -m benchmarks.gpu_suite --model /tmp/models/qwen7b --load-format dummy \
    --workloads mixed,long --max-model-len 10240 --kv-cache-bytes $((${KV_GIB:-20} * 1024 ** 3)) \
    --out "$OUT/suite-7b" --rounds 3 --scale "${SCALE:-0.3}" --budget-s "${BUDGET:-480}" \
    --systems "$SYSTEMS" ${START_TOGETHER:+--start-together} ;;
*) echo "usage: $0 small|7b" >&2; exit 2 ;;
esac
