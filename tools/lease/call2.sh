#!/usr/bin/env bash
# Second call of the lease, on the same warm machine (carry as for call1.sh):
#   PCVR_MEASURED_TREE=<the tree of call 1> bash tools/lease/call2.sh
# the ids of PLAN that call 1 did not time (its runs kept in results/h200_session/), then the end-to-end
# throughput case (loader + captured step on the 300x data, generated there first) and perf_embedding.
set -u
export PCVR_MEASURED_TREE=${PCVR_MEASURED_TREE:?set PCVR_MEASURED_TREE}
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
done_runs=$(ls results/h200_session/models_graph*.json 2>/dev/null | tr '\n' ' ')
echo "done runs: $done_runs"
MODELS_IDS=tools/lease/plans/${PLAN:-models_graph20}.txt MODELS_DONE="$done_runs" MODELS_PRECOMPILE=0 \
  MODELS_PREWARM=${PREWARM:-120} MODELS_S=${MODELS_S:-200} MODELS_JSON=models_graph2 \
  THROUGHPUT_K="captured and baseline" THROUGHPUT_S=${THROUGHPUT_S:-200} BUDGET=${BUDGET:-575} \
  bash tools/h200_session.sh ${STEPS:-perf_models throughput perf_embedding}
