#!/usr/bin/env bash
# Issue 12 (Attention II), kernel part, on the H200: one `run` (device tool; carry .gpu-site and .cache/tlpack).
#   bash tools/h200_attention_ii.sh accuracy   # precompile + the GPU accuracy cases of the new head sizes and masks
#   bash tools/h200_attention_ii.sh perf       # the models' shapes (set=model) -> $OUT/attention_models.json
#   bash tools/h200_attention_ii.sh accuracy perf
# Logs and JSON go to $OUT; `pcvr report --view cases` of the JSON is printed last.
#
# The TileLang kernels come from the carried cache, built on a CPU machine (no GPU needed):
#   TILELANG_CACHE_DIR=$PWD/.cache/tilelang python3 -m pcvr_lib.kernels.precompile flash_attention --arch sm_90a
#   mkdir -p .cache/tlpack && tar -C .cache -cJf .cache/tlpack/tl.tar.xz tilelang
# (a variant missing from it compiles in the precompile step below, 30-80 s each on the H200 host).
set -u
. .gpu-site/activate.sh
export PYTHONUNBUFFERED=1 PCVR_ATTENTION_PRECOMPILED=1 TILELANG_CACHE_DIR=$PWD/.cache/tilelang
T0=$(date +%s)
mkdir -p .cache
[ -f .cache/tlpack/tl.tar.xz ] && tar -C .cache -xJf .cache/tlpack/tl.tar.xz
PYTEST="python3 -m pytest -q -p no:cacheprovider --tb=short"

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, print one line
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout -k 15 -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc ($(( $(date +%s) - t ))s): $(grep -E '(passed|failed|error|variants)' "$OUT/$name.log" | tail -1)"
}

for s in "$@"; do
  case $s in
    accuracy)
      # every attention variant of the suites (Triton run once per variant, TileLang from the cache or compiled)
      step precompile 90 python3 -m pcvr_lib.kernels.precompile flash_attention --run-triton --workers 15
      step accuracy 60 $PYTEST accuracy_tests/test_attention.py -k "gpu and (D16 or D48 or window or roles)" ;;
    perf)
      step perf_models 200 $PYTEST perf_tests/test_kernels_attention.py -k model --benchmark-only \
        --benchmark-json="$OUT/attention_models.json" ;;
    *) echo "unknown step $s (accuracy, perf)"; exit 2 ;;
  esac
done
grep -E "^(FAILED|ERROR)" "$OUT"/*.log | head -20
[ -f "$OUT/attention_models.json" ] && python3 -m pcvr_lib report "$OUT/attention_models.json" --view cases
