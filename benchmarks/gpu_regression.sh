#!/usr/bin/env bash
# The GPU checks that vqueue's engine optimizations did not regress on the H200's vLLM (0.26),
# as docs/vllm-compat.md and docs/benchmarks.md report them. Run on the device, after
# `source .gpu/b/env.sh` (shared/gpu/README.md), in two calls that each fit the device's
# 10-minute limit:
#   bash benchmarks/gpu_regression.sh plan-monitor-guided   # worker --check, monitor_raw, guided 0.5B
#   bash benchmarks/gpu_regression.sh guided-7b             # guided JSON on a 7B-shaped model
# Results land under $OUT (JSONL per run, and monitor-raw.json / guided-raw.json summaries).
set -uo pipefail
part=${1:?which part}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export VQUEUE_MODEL=${VQUEUE_MODEL:-/tmp/models/qwen05}
# vqueue runs from PYTHONPATH here: make its vLLM plugin findable by its entry point
PYTHONPATH=$(python3 -c "from benchmarks import plugin_env; print(plugin_env()['PYTHONPATH'])")
export PYTHONPATH
case "$part" in
  plan-monitor-guided)
    # what a worker's engine would run with here: vLLM 0.26, Model Runner V2, the 0.26 hook
    python3 -m producer.cli worker --check --json > "$OUT/check.json" 2> "$OUT/check.err"
    cat "$OUT/check.json"
    python3 -m benchmarks.monitor_raw --model /tmp/models/qwen05 --out "$OUT/monitor" \
      --jobs 1000 --tokens 128 --rounds 3 2>&1 | grep -E '^\{|Error|error' | tail -40
    python3 -m benchmarks.guided_raw --model /tmp/models/qwen05 --out "$OUT/q05" \
      --variants parallel --rounds 3 2>&1 | grep -E '^\{|Error|error|^--' | tail -40
    ;;
  guided-7b)
    mkdir -p /tmp/models/qwen7b
    cp /tmp/models/qwen25-tokenizer/* /tmp/models/qwen7b/
    python3 - <<'PY'
import json
json.dump({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
           "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
           "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
           "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
           "use_sliding_window": False, "vocab_size": 152064},
          open("/tmp/models/qwen7b/config.json", "w"))
PY
    python3 -m benchmarks.guided_raw --model /tmp/models/qwen7b --dummy-weights --out "$OUT/q7" \
      --variants parallel --rounds 3 2>&1 | grep -E '^\{|Error|error|^--' | tail -40
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
