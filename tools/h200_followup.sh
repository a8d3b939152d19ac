#!/usr/bin/env bash
# One H200 session's follow-up run (device tool, carry .gpu-site): the attention suite (precompile, GPU
# accuracy, benchmarks), the norm accuracy suite re-run after its tolerance/recompile fixes, and the
# bf16 orthogonal-AdamW variant. Each step has its own time limit so a slow step cannot starve the rest;
# `timeout -s INT` lets pytest-benchmark still write its JSON. Logs and JSON go to $OUT.
set -u
. .gpu-site/activate.sh
export PYTHONUNBUFFERED=1 PCVR_ATTENTION_PRECOMPILED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout 75 python3 -m pcvr_lib.kernels.attention.precompile --workers 16 \
  "tilelang:64:fp16,bf16:key_lengths:0:0" "tilelang:64:bf16:none,causal,causal_kl,causal_valid:0:0" \
  "tilelang:64:fp16,bf16:none:0:1" "tilelang:128:fp16,bf16:none:0:2" "tilelang:32:bf16:key_lengths:0:0" \
  "tilelang:64:bf16:causal_valid:1:0" \
  "triton:64:fp16,bf16:none,key_lengths,causal,causal_kl,causal_valid:0:0" \
  "triton:64:bf16:none,key_lengths,causal,causal_kl,causal_valid:0:1" "triton:64:fp16:none,key_lengths,causal_valid:0:1" \
  "triton:32,128:bf16:key_lengths:0:0" "triton:128:fp16,bf16:none:0:2" "triton:64:fp16,bf16:key_lengths,causal_valid:1:0" \
  > "$OUT/precompile.log" 2>&1
echo "precompile rc=$?"
timeout -s INT 35 python3 -m pytest accuracy_tests/test_attention.py -q -p no:cacheprovider -k gpu --tb=line \
  > "$OUT/attention_accuracy.log" 2>&1
echo "attention accuracy rc=$?"; tail -3 "$OUT/attention_accuracy.log"
timeout -s INT 75 python3 -m pytest perf_tests/test_kernels_attention.py -q -p no:cacheprovider \
  --benchmark-json="$OUT/attention.json" --tb=line > "$OUT/attention_perf.log" 2>&1
echo "attention perf rc=$?"; tail -3 "$OUT/attention_perf.log"
timeout -s INT 40 python3 -m pytest perf_tests/test_optimizers.py -q -p no:cacheprovider -k "cuda and orthogonal" \
  --benchmark-json="$OUT/optim_orthogonal.json" --tb=line > "$OUT/optim.log" 2>&1
echo "optim rc=$?"; tail -2 "$OUT/optim.log"
timeout -s INT 90 python3 -m pytest accuracy_tests/test_norms.py -q -p no:cacheprovider --tb=line \
  > "$OUT/norms_accuracy.log" 2>&1
echo "norms accuracy rc=$?"; tail -4 "$OUT/norms_accuracy.log"
python3 -m pcvr_lib report "$OUT/optim_orthogonal.json" --view optim 2>&1 | tail -12
python3 -m pcvr_lib report "$OUT/attention.json" --view cases
