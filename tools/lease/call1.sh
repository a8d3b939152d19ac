#!/usr/bin/env bash
# First call of a device lease for the README's model table (the `run` tool; carry .gpu-site and .cache/tlpack):
#   PCVR_MEASURED_TREE=$(git rev-parse --short HEAD) bash tools/lease/call1.sh
# On an H200: the smoke, then the graph cells of tools/lease/plans/$PLAN.txt (default models_graph20: torch graph
# and Triton graph of five models, both phases; dualq's four ids are models_dualq4, whose builds take 400-470 s:
# a call of their own, PREWARM=480). On an H100 (a call naming the H200 can land there): the host profile of graph
# inference, then interformer's torch graph inference, the one such H100 cell besides dualq's still untimed.
# SMOKE_S, PREWARM, MODELS_S, BUDGET, STEPS override the limits and steps. The runs come back in $OUT and stay on
# the machine (results/h200_session/) for the next call: tools/lease/call2.sh.
set -u
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
export PCVR_MEASURED_TREE=${PCVR_MEASURED_TREE:?set PCVR_MEASURED_TREE}
if [[ "$card" == *H200* ]]; then
  SMOKE_S=${SMOKE_S:-100} MODELS_IDS=tools/lease/plans/${PLAN:-models_graph20}.txt MODELS_PRECOMPILE=0 \
    MODELS_PREWARM=${PREWARM:-190} MODELS_S=${MODELS_S:-290} MODELS_JSON=models_graph BUDGET=${BUDGET:-575} \
    bash tools/h200_session.sh ${STEPS:-smoke perf_models}
else  # an H100: the host profile of graph inference (card-independent in kind), then interformer's torch graph infer
  PROFILE_HOST_MODELS=onetrans,symbiosis PROFILE_HOST_BACKENDS=torch:graph,triton:graph PROFILE_HOST_PHASE=infer \
    PROFILE_HOST_S=${PROFILE_HOST_S:-290} MODELS_IDS=tools/lease/plans/models_interformer_torch_infer.txt \
    MODELS_PRECOMPILE=0 MODELS_PREWARM=${PREWARM:-100} MODELS_S=${MODELS_S:-170} MODELS_JSON=models_h100 \
    BUDGET=${BUDGET:-575} bash tools/h200_session.sh profile_host perf_models
fi
