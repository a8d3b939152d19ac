#!/usr/bin/env bash
# One H200 `run` (device tool; carry .gpu-site and .cache/tlpack): the steps named as arguments, in order,
# each with its own time limit so a slow step cannot starve the rest (`timeout -s INT`: a cut benchmark step
# still writes the JSON of its finished cases, marked cut). Logs and JSON go to $OUT; a short summary is printed last.
#
#   bash tools/h200_session.sh warm accuracy sweep                            # accuracy, tile sweeps + tune
#   bash tools/h200_session.sh warm perf_norms perf_embedding perf_attention  # the kernel snapshots
#   REPS=3 bash tools/h200_session.sh warm planted noise                      # planted slowdown + noise floor
# (BUDGET=seconds caps the whole command; steps: warm warm_norms accuracy accuracy_norms accuracy_attention
#  sweep norm_sweep tune host perf_norms perf_embedding perf_attention noise planted aa aa1 aa2 gate planted_host optim
#  gpu_timer host_ab smoke
#  accuracy_parallel perf_models throughput smoke_triton smoke_tilelang tune_long tune_small tune_one_tile tune_masks pcvr_ab
#  profile profile_host loader_cores loader_ceiling)
# pcvr_ab: tools/attention_pcvr_ab.py, our flash_attention against every SDPA backend at the PCVR shape, per call,
#   interleaved rounds in one process, ours / best SDPA with a paired 95% interval ($OUT/pcvr_ab.json; ~80 s).
# profile: tools/profile_models.py, device time per kernel of PROFILE_MODELS' train steps (symbiosis) on the
#   PROFILE_BACKENDS specs (torch:graph, triton:graph, triton:graph/rms_norm_backend=torch: our kernels with
#   torch's norms, which inductor fuses) at PROFILE_PRECISION (bf16); $OUT/profile_models.json. Each compiled
#   spec compiles for about a minute: PROFILE_S (300 s) holds three. A cut run keeps the specs it finished.
# profile_host: tools/profile_models.py --host, where each model's train step spends its host time, torch vs
#   triton backends ($OUT/profile_host.json; ~60-90 s); PROFILE_HOST_MODELS, PROFILE_HOST_BACKENDS (specs with
#   modes, e.g. torch:graph,triton:graph: each compiled spec builds for a minute or more) and PROFILE_HOST_PHASE
#   (train_step or infer) narrow it, PROFILE_HOST_S is its limit (150 s).
#
# noise: the gated kernel suite (torch.compile peers, sweeps and host parts left out) REPS times, one JSON
#   per repetition ($OUT/noise_repN.json), then `pcvr noise --from` them into $OUT/noise_h200.json. Every GPU
#   run's JSON holds the host-speed probe (machine_info.host_probe, timing.host_probe; noise.log prints it),
#   which `pcvr diff` divides host-time ratios by between runs on different hosts (notes/comparison.md).
# planted: the Triton RMSNorm cases with PCVR_PLANTED_NORM_TILE=256 (256 elements per program instead of
#   2048: perf_tests/conftest.py), $OUT/planted_tile256.json, and `pcvr diff` of it against noise_rep1.
#   (First, so that a budget cut falls on the last noise repetition, not on the planted run.)
# aa1, aa2 (aa: both): the A/A of the host gate. aa1 runs the gated kernel suite once ($OUT/aa_run1.json), aa2
#   once more ($OUT/aa_run2.json) and `pcvr diff`s the two both ways ($OUT/aa_diff_12.json, aa_diff_21.json and
#   their .log; 0 alarms expected: device time within its threshold, counted work equal). Each run is also kept
#   in $KEEP (results/h200_session/, ignored by git, so it stays on the machine between calls of one lease):
#   `aa1` in one call and `aa2` in the next still pair two runs of one machine session. AA_K narrows the suite
#   (e.g. AA_K=bf16 when both runs must fit one call), AA_S is each run's limit (240 s). AA_BASE=FILE (a run of
#   an earlier lease, carried): aa2 also diffs it with run 2 both ways ($OUT/aa_cross_{12,21}.json).
#   AA_WARM=1: first every gated case once, untimed (--benchmark-disable: compiles, checks, one call; limit
#   AA_WARM_S, 240 s), so that no timed run is the machine's first pass over the suite (the first runs of a lease
#   held the modes the A/A alarmed on: notes/comparison.md).
# gate: the gated kernel suite once ($OUT/gate_run.json), `pcvr diff` of the committed snapshot of that suite
#   (GATE_BASE, default .benchmarks/h200/kernels.json; its cases are matched by test id across the renamed
#   benchmark files) against it: $OUT/gate_diff.json and .log. aa2 writes the same diff for its run 2.
# planted_host: the RMSNorm cases of every backend (64: the torch.compile peer left out) without and with
#   PCVR_PLANTED_HOST_US=5 (the Triton RMSNorm forward wrapper spins ~5 us of Python per call:
#   perf_tests/planted.py), $OUT/planted_host_{clean,5us}.json, then `pcvr diff` clean -> planted
#   ($OUT/planted_host_diff.json): exactly the 16 Triton cases REGRESSED, by python_calls (+2 per call).
# Every pytest run of these steps has PYTHONHASHSEED fixed (0 unless set), so two runs hash strings alike; every
#   diff step writes its --json even when it fails (exit 1) or refuses (exit 2: {"error": ...}).
# Afterwards, on any machine: notes/comparison.md "H200" lists the commands that turn these into the
# committed noise file and fixtures.
#
# .cache/tlpack/tl.tar.xz is TileLang's disk cache built on a CPU machine for sm_90/sm_90a:
#   TILELANG_CACHE_DIR=$PWD/.cache/tilelang python3 -m pcvr_lib.precompile --arch sm_90a --tune --workers 2
#   mkdir -p .cache/tlpack && tar -C .cache -cJf .cache/tlpack/tl.tar.xz tilelang
# REP_FROM numbers the noise repetitions from there (a second call on the same machine: REP_FROM=3).
# ACC_PATHS / ACC_S: the accuracy_parallel step's test paths and time limit (default: all, 300 s; the whole suite
#   takes 344-372 s with 8 workers, so give it a call of its own: ACC_S=480 ... warm accuracy_parallel).
# ACC_TODO=FILE: run only the node ids in FILE, the $OUT/accuracy_todo.txt of a call whose accuracy step was cut
#   (copy it into the checkout first); the new accuracy_todo.txt lists what is still left.
# ATTN_K / ATTN_S: perf_attention's -k selection (e.g. ATTN_K=model: the models' shapes) and time limit (150 s; with
#   its own warm-up the whole file, 144 cases, needs about that: 125 of them are done after 127 s;
#   PCVR_ATTENTION_PRECOMPILED=1 skips that warm-up when `warm` ran before).
# SMOKE_JOBS: runs at once in each smoke step (default 1; the smoke's --jobs: more than one runs each run in a fresh
#   process). With 4: Triton's smoke 125 s (serial: ~13 s a run, ~270 s), TileLang's 139 s, but torch's 113 s
#   against 114.6 s serial: a process start per run eats the gain. Each run's train
#   seconds then share the GPU and the CPUs with the other runs: compare costs only between smokes with one value.
# NOISE_K narrows the noise repetitions to a subset (e.g. NOISE_K=bf16) when the whole suite does not fit.
# host_ab: tools/launch_host_ab.py between the tree in .trees/base (carry it) and this one.
# frontier: the kernel cases of FRONTIER_TESTS (default the norm and attention benchmarks) selected by FRONTIER_K
#   (-k) with the frontier peers of .gpu-peers/ (tools/make_peer_site.sh: quack, FlashAttention 4), into
#   $OUT/${FRONTIER_JSON:-frontier}.json; FRONTIER_S is its limit (300 s). .gpu-peers travels in parts, one per call
#   on one warm machine (tools/make_peer_site.sh says how): a call whose part completes the set can run it.
#   .gpu-site (TileLang) does not fit beside a part: its cases skip there, their figures come from the snapshots.
set -u
[ -f .gpu-site/activate.sh ] && . .gpu-site/activate.sh
[ -f .gpu-peers/activate.sh ] && . .gpu-peers/activate.sh
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=$PWD/.cache/tilelang PYTHONHASHSEED=${PYTHONHASHSEED:-0}
KEEP=results/h200_session  # runs kept on the machine between calls of one lease (aa1 -> aa2)
mkdir -p "$KEEP"
T0=$(date +%s)
mkdir -p .cache
[ -f .cache/tlpack/tl.tar.xz ] && tar -C .cache -xJf .cache/tlpack/tl.tar.xz
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
PYTEST="python3 -m pytest -q -p no:cacheprovider --tb=short"

KERNEL_SUITE=(perf_tests/test_norms.py perf_tests/test_embedding_bag.py perf_tests/test_attention.py)
GATED="not torch_compile"  # torch.compile peers are never gated; sweeps and host probes are -m explore
BUDGET=${BUDGET:-585}  # seconds for the whole command (the run tool's limit is 600)
step() {  # step NAME SECONDS COMMAND...: run with a limit (cut to what is left of BUDGET), log to $OUT/NAME.log
  # A step cut by its limit gets SIGINT (SIGKILL 15 s later): a benchmark step still writes the JSON of its
  # finished cases, marked cut (perf_tests/bench_plugin.py); each step names its own JSON, printed with what it kept.
  local name=$1 limit=$2; shift 2
  local t=$(date +%s) left=$(( BUDGET - ($(date +%s) - T0) )) json="" arg
  if (( left < 15 )); then echo "$name: skipped, no time left"; return; fi
  if (( limit < 1 )); then echo "$name: skipped, limit $limit"; return; fi  # `timeout 0` would mean no limit at all
  (( limit > left )) && limit=$left
  for arg in "$@"; do [[ $arg == --benchmark-json=* ]] && json=${arg#--benchmark-json=}; done
  timeout -k 15 -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STEP_AT_LIMIT=$(( $(date +%s) - t >= limit ))  # 1: the step ran into its limit (then rc 124, or 137 after -k)
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc ($(( $(date +%s) - t ))s): $(grep -E '(passed|failed|error|ready|variants)' "$OUT/$name.log" | tail -1)"
  if [ -n "$json" ] && [ -s "$json" ]; then  # the report's lines after the machine: cut?, sources, case count
    echo "  $(basename "$json"): $(python3 -m pcvr_lib report "$json" --view status 2>&1 | awk 'NR > 1 {printf "%s%s", (NR > 2 ? " | " : ""), $0}')"
  elif [ -n "$json" ]; then
    echo "  $(basename "$json"): not written (see $name.log)"
  fi
  return $rc
}

diff_step() {  # diff_step NAME BASE NEW: pcvr diff of two runs, its rows in $OUT/NAME.json, its table in NAME.log
  local name=$1 base=$2 new=$3
  if [ ! -s "$base" ] || [ ! -s "$new" ]; then echo "$name: skipped, no JSON in $base or $new"; return; fi
  python3 -m pcvr_lib diff "$base" "$new" --json "$OUT/$name.json" --all > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc: $(tail -2 "$OUT/$name.log" | tr '\n' ' ')"
}
keep() {  # keep FILE: a copy in $KEEP (a later call of this lease finds it there)
  [ -s "$1" ] && cp "$1" "$KEEP/"
}

for s in "$@"; do
  case $s in
    aa|aa1|aa2)
      for i in 1 2; do
        [ "$s" = aa$(( 3 - i )) ] && continue  # aa1: run 1 only; aa2: run 2 only; aa: both
        rm -f "$KEEP/aa_run$i.json"  # never pair a run of an earlier call by mistake
        if [ -n "${AA_WARM:-}" ] && [ -z "${aa_warmed:-}" ]; then  # once per call, before its first timed run
          aa_warmed=1
          step aa_warm "${AA_WARM_S:-240}" $PYTEST "${KERNEL_SUITE[@]}" -k "$GATED${AA_K:+ and $AA_K}" --benchmark-disable
        fi
        step "aa_run$i" "${AA_S:-240}" $PYTEST "${KERNEL_SUITE[@]}" -k "$GATED${AA_K:+ and $AA_K}" --benchmark-only \
          --benchmark-json="$OUT/aa_run$i.json"
        keep "$OUT/aa_run$i.json"
      done
      if [ "$s" != aa1 ]; then
        diff_step aa_diff_12 "$KEEP/aa_run1.json" "$KEEP/aa_run2.json"
        diff_step aa_diff_21 "$KEEP/aa_run2.json" "$KEEP/aa_run1.json"
        diff_step gate_diff "${GATE_BASE:-.benchmarks/h200/kernels.json}" "$KEEP/aa_run2.json"
        if [ -n "${AA_BASE:-}" ]; then
          diff_step aa_cross_12 "$AA_BASE" "$KEEP/aa_run2.json"
          diff_step aa_cross_21 "$KEEP/aa_run2.json" "$AA_BASE"
        fi
      fi ;;
    gate)
      step gate_run "${AA_S:-240}" $PYTEST "${KERNEL_SUITE[@]}" -k "$GATED${AA_K:+ and $AA_K}" --benchmark-only \
        --benchmark-json="$OUT/gate_run.json"
      diff_step gate_diff "${GATE_BASE:-.benchmarks/h200/kernels.json}" "$OUT/gate_run.json" ;;
    planted_host)
      sel="test_norm and rms_norm and not torch_compile"
      step planted_host_clean 150 $PYTEST perf_tests/test_norms.py -k "$sel" --benchmark-only \
        --benchmark-json="$OUT/planted_host_clean.json"
      PCVR_PLANTED_HOST_US=${PLANTED_HOST_US:-5} step planted_host_5us 150 $PYTEST perf_tests/test_norms.py -k "$sel" \
        --benchmark-only --benchmark-json="$OUT/planted_host_5us.json"
      diff_step planted_host_diff "$OUT/planted_host_clean.json" "$OUT/planted_host_5us.json" ;;
    warm)
      step precompile 180 python3 -m pcvr_lib.precompile --workers 16 --run-triton ;;
    warm_norms)
      step precompile 90 python3 -m pcvr_lib.precompile rms_norm layer_norm --workers 16 ;;
    warm_embedding)
      step precompile 90 python3 -m pcvr_lib.precompile embedding_bag_mean --workers 16 ;;
    gpu_timer)
      step gpu_timer 60 $PYTEST accuracy_tests/test_timing.py ;;
    host_ab)
      step host_ab 150 python3 tools/launch_host_ab.py .trees/base . --rounds 2 --json "$OUT/host_ab.json" ;;
    smoke)  # SMOKE_PROFILE=1: under cProfile ($OUT/smoke.prof: where the smoke's wall time goes); SMOKE_S: limit.
      # A second smoke step in one call (smoke smoke) is the same smoke on a warm machine (fonts cached, bytecode
      # compiled): its log and runs go to smoke2.log and smoke_h200_2/.
      smokes=$(( ${smokes:-0} + 1 )); n=""; (( smokes > 1 )) && n=$smokes
      step smoke$n "${SMOKE_S:-150}" python3 ${SMOKE_PROFILE:+-m cProfile -o "$OUT/smoke$n.prof"} -m pcvr_lib smoke \
        --models all --seeds 17,42,97 --steps 20 --device cuda --jobs "${SMOKE_JOBS:-1}" --out "$OUT/smoke_h200${n:+_$n}"
      # only the summaries and evaluations come back (tools/smoke_compare.py reads them; checkpoints, predictions
      # and figures would outgrow the return)
      find "$OUT/smoke_h200${n:+_$n}" -type f ! -name '*summary.json' ! -name 'training_telemetry.json' \
        ! -name evaluation.json -delete ;;
    norm_sweep)
      step norm_sweep 150 $PYTEST perf_tests/test_norms.py -m "explore or not explore" -k "exploration or copy_rate" --benchmark-only \
        --benchmark-json="$OUT/norm_sweep.json" ;;
    accuracy)
      step accuracy 330 $PYTEST accuracy_tests --durations=15 ;;
    accuracy_parallel)  # the whole suite (or ACC_PATHS; only ACC_TODO's node ids when set) in 8 pytest-xdist
      # workers (work stealing: one slow test does not hold a queue), then its failures serially; what a cut run
      # never reported goes to $OUT/accuracy_todo.txt for the next call (ACC_TODO=that file, committed or not)
      python3 -m pytest --collect-only -q ${ACC_PATHS:-accuracy_tests} > "$OUT/accuracy_collected.txt" 2>&1
      PCVR_ONLY_NODEIDS=${ACC_TODO:-} step accuracy "${ACC_S:-300}" python3 -m pytest -v --tb=short -n 8 \
        --dist worksteal --durations=30 -o faulthandler_timeout=240 -m "not exclusive" ${ACC_PATHS:-accuracy_tests}
      # the tests that time the device need it to themselves (the GPU time-slices between the workers' contexts)
      PCVR_ONLY_NODEIDS=${ACC_TODO:-} step accuracy_exclusive 60 python3 -m pytest -v --tb=short -m exclusive \
        ${ACC_PATHS:-accuracy_tests}
      python3 tools/pytest_unreported.py "$OUT/accuracy_collected.txt" "$OUT/accuracy.log" \
        "$OUT/accuracy_exclusive.log" > "$OUT/accuracy_todo.txt" 2> "$OUT/accuracy_todo.log"
      if [ -n "${ACC_TODO:-}" ]; then  # a resumed run: what is still left of its list
        grep -Fxf "$ACC_TODO" "$OUT/accuracy_todo.txt" > "$OUT/accuracy_todo.tmp"
        mv "$OUT/accuracy_todo.tmp" "$OUT/accuracy_todo.txt"
      fi
      echo "accuracy: $(cat "$OUT/accuracy_todo.log"); left for the next call: $(wc -l < "$OUT/accuracy_todo.txt")"
      step accuracy_rerun 120 python3 -m pytest -q --tb=short --lf --lfnf=none ${ACC_PATHS:-accuracy_tests} ;;
    accuracy_norms)
      step accuracy 120 $PYTEST accuracy_tests/test_norms.py ;;
    accuracy_attention)
      step accuracy 120 $PYTEST accuracy_tests/test_attention.py ;;
    sweep)
      step norm_sweep 150 $PYTEST perf_tests/test_norms.py -m "explore or not explore" -k "exploration or copy_rate" --benchmark-only \
        --benchmark-json="$OUT/norm_sweep.json"
      step attention_tune 150 python3 -m pcvr_lib.tune.attention --workers 16 ;;
    tune)
      step attention_tune 150 python3 -m pcvr_lib.tune.attention --workers 16 ;;
    tune_small)  # the models' head sizes 16 and 32 at the models' shapes: Triton tile candidates, unmasked
      step attention_tune_small ${TUNE_SMALL_S:-130} python3 -m pcvr_lib.tune.attention --skip-tilelang \
        --shapes 256x4x256x16,256x4x512x16,256x8x110x32 --dtype bf16 ;;
    tune_masks)  # head dim 16 under the models' masks (a dK/dV tile tuned without a mask can be far slower under
      # one: 1.7x on the window backward): tokenformer's window at S320, then the key-length shapes
      # (dK/dV candidates only, 11 per shape, each compiled in turn in the sweep's one process)
      step attention_tune_window ${TUNE_MASKS_S:-100} python3 -m pcvr_lib.tune.attention --skip-tilelang \
        --mask window --kernels dkdv --shapes 256x4x320x16 --dtype bf16
      step attention_tune_key_lengths ${TUNE_MASKS_S:-100} python3 -m pcvr_lib.tune.attention --skip-tilelang \
        --mask key_lengths --kernels dkdv --shapes 256x4x256x16,256x4x512x16 --dtype bf16 ;;
    tune_one_tile)  # the one-tile backward (Sq, Skv <= 128) against the two-kernel one, per head dim
      step attention_tune_one_tile 120 python3 -m pcvr_lib.tune.attention --skip-tilelang --one-tile-only \
        --shapes 8x8x128x64,256x8x110x32,256x4x128x16,64x8x128x128 --dtype bf16 ;;
    tune_long)  # the long-sequence Triton kernels (triton_long) vs triton_impl's vs cuDNN (notes/attention.md)
      step attention_long 290 python3 -m pcvr_lib.tune.attention_long --workers 15 \
        --out "$OUT/attention_long.json" ;;
    host)
      step host_parts 60 $PYTEST perf_tests/test_norms.py -m explore -k host_part --benchmark-only \
        --benchmark-json="$OUT/host_parts.json" ;;
    perf_norms)  # then `pcvr diff` of the committed norms snapshot against it ($OUT/norms_diff.json, .log)
      step perf_norms 240 $PYTEST perf_tests/test_norms.py --benchmark-only \
        --benchmark-json="$OUT/kernels_norms.json"
      diff_step norms_diff .benchmarks/h200/kernels_norms.json "$OUT/kernels_norms.json" ;;
    perf_embedding)  # then `pcvr diff` of the committed embedding snapshot against it ($OUT/embedding_diff.json, .log)
      step perf_embedding 150 $PYTEST perf_tests/test_embedding_bag.py --benchmark-only \
        --benchmark-json="$OUT/kernels_embedding.json"
      diff_step embedding_diff .benchmarks/h200/kernels_embedding.json "$OUT/kernels_embedding.json" ;;
    noise)
      for i in $(seq "${REP_FROM:-1}" $(( ${REP_FROM:-1} + ${REPS:-3} - 1 ))); do
        step "noise_rep$i" 240 $PYTEST "${KERNEL_SUITE[@]}" -k "$GATED${NOISE_K:+ and $NOISE_K}" --benchmark-only \
          --benchmark-json="$OUT/noise_rep$i.json"
      done
      python3 -m pcvr_lib noise --from "$OUT"/noise_rep*.json --out "$OUT/noise_h200.json" > "$OUT/noise.log" 2>&1 ;;
    planted)
      PCVR_PLANTED_NORM_TILE=256 step planted 90 $PYTEST perf_tests/test_norms.py \
        -k "test_norm and rms_norm and triton" --benchmark-only \
        --benchmark-json="$OUT/planted_tile256.json" ;;
    optim)
      step optim 150 $PYTEST perf_tests/test_optimizers.py -k cuda --benchmark-only --benchmark-json="$OUT/optim.json" ;;
    throughput)  # perf_tests/test_train_throughput.py (the loader feeding the step, rows/s, and its bound) on the
      # reference's 300x data, generated here first: 300 copies of the 52 MB demo file, about 15.7 GB (12x took 8.5 s
      # on a 2-core Xeon; unmeasured on the GPU host); THROUGHPUT_K: -k (e.g. captured)
      step throughput "${THROUGHPUT_S:-300}" $PYTEST perf_tests/test_train_throughput.py --data-scale full \
        ${THROUGHPUT_K:+-k "$THROUGHPUT_K"} --benchmark-only --benchmark-json="$OUT/throughput.json" ;;
    perf_attention)
      step perf_attention "${ATTN_S:-150}" $PYTEST perf_tests/test_attention.py ${ATTN_K:+-k "$ATTN_K"} \
        --benchmark-only --benchmark-json="$OUT/attention.json" ;;
    perf_models)  # model x backend x mode x phase (perf_tests/test_models.py), checked against eager torch
      # first; MODELS_K selects cases (-k, words only: "=" is not allowed there), e.g. MODELS_K="eager" or
      # "baseline and not tilelang"; MODELS_IDS=FILE runs the node ids listed in FILE in that order (a cut
      # then falls on the last ones). The compiled modes compile each model on first use (inductor), too many
      # for one call at once. MODELS_PRECOMPILE=0 skips the TileLang warm-up (no tilelang case selected).
      # The models' TileLang variants load from the carried pack (a variant missing from it compiles here in
      # 16 processes, not one by one inside a test); then every case's outcome is logged as it ends (-v), a
      # failed check's reason at once (the test writes it past the capture). No faulthandler_timeout here: a
      # process died with SIGSEGV during its dump of every thread's stack, taken while inductor built a graph
      # in the main thread (the log ends inside the dump, 90 s into interformer's build).
      # MODELS_DONE="RUN.json ...": runs of earlier calls (kept in $KEEP, or carried); the plan's ids they timed
      # or failed are left out (each run is also kept in $KEEP for the lease's next call)
      if [ -n "${MODELS_DONE:-}" ] && [ -n "${MODELS_IDS:-}" ]; then
        python3 tools/remaining_ids.py "$MODELS_IDS" $MODELS_DONE --untimed > "$OUT/models_untimed.txt"
        echo "perf_models: $(grep -c . "$OUT/models_untimed.txt") of $(grep -c . "$MODELS_IDS") ids not timed yet"
        MODELS_IDS=$OUT/models_untimed.txt
        grep -q . "$MODELS_IDS" || continue  # every id of the plan is timed: nothing to run (not the whole file)
      fi
      [ "${MODELS_PRECOMPILE:-1}" = 0 ] || step precompile_models 120 python3 -m pcvr_lib.precompile --models --workers 16
      if [ -n "${MODELS_PREWARM:-}" ] && [ -n "${MODELS_IDS:-}" ]; then  # MODELS_PREWARM=0: none
        # torch.compile's caches on disk (inductor's FX graphs, AOTAutograd, Triton) filled first by one untimed
        # process per model x backend x mode, all at once; the timed run below then loads its graphs from them
        # instead of compiling one after another (each build still traces: dynamo runs in every process)
        step prewarm_models "$MODELS_PREWARM" python3 tools/prewarm_models.py "$MODELS_IDS" --jobs 12
      fi
      if [ -n "${MODELS_IDS:-}" ]; then mapfile -t targets < "$MODELS_IDS"; else targets=(perf_tests/test_models.py); fi
      step perf_models "${MODELS_S:-300}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfE --capture=sys \
        -o faulthandler_timeout=0 "${targets[@]}" ${MODELS_K:+-k "$MODELS_K"} --benchmark-only \
        --durations=10 --benchmark-json="$OUT/${MODELS_JSON:-models}.json"
      models_rc=$?
      keep "$OUT/${MODELS_JSON:-models}.json"
      # a process that died (rc 128 + signal: a crash or the out-of-memory killer) left a checkpoint of its
      # finished cases; the plan's ids after the crashed model x backend x mode run once more, into
      # ${MODELS_JSON}_resumed.json (merge both into the snapshot)
      # (killed at the step's limit instead, inductor building through the SIGINT: the id it was in runs again too)
      if (( models_rc >= 128 )) && [ -n "${MODELS_IDS:-}" ] && [ -s "$OUT/${MODELS_JSON:-models}.json" ]; then
        python3 tools/remaining_ids.py "$MODELS_IDS" "$OUT/${MODELS_JSON:-models}.json" \
          $( (( STEP_AT_LIMIT )) && echo --time-limit) > "$OUT/models_remaining.txt"
        mapfile -t rest < <(grep . "$OUT/models_remaining.txt")
        if (( ${#rest[@]} )); then
          step perf_models_resumed "${MODELS_S:-300}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfE \
            --capture=sys -o faulthandler_timeout=0 "${rest[@]}" --benchmark-only \
            --benchmark-json="$OUT/${MODELS_JSON:-models}_resumed.json"
          keep "$OUT/${MODELS_JSON:-models}_resumed.json"
        fi
      fi ;;
    loader_cores)  # make bench's loader-worker cases (0/1/2 workers) pinned to 4 cores, then to 2 (taskset),
      # LOADER_ROUNDS times in turn, so that a drift of the host's speed falls on both core counts alike
      for r in $(seq 1 "${LOADER_ROUNDS:-2}"); do
        for cores in 4 2; do
          step "loader_${cores}cores_r$r" 120 taskset -c "0-$(( cores - 1 ))" $PYTEST perf_tests/test_data_pipeline.py \
            -k "test_loader_workers and none" --benchmark-only --benchmark-json="$OUT/loader_${cores}cores_r$r.json"
        done
      done ;;
    loader_ceiling)  # tools/loader_ceiling.py pinned to 4 cores, then 2: the 0- and 2-worker loader against the
      # rows/s of as many independent 1-thread processes as cores (the ceiling of the worker-scaling target), LOADER_ROUNDS rounds each
      for cores in 4 2; do
        step "loader_ceiling_${cores}cores" 150 taskset -c "0-$(( cores - 1 ))" python3 tools/loader_ceiling.py \
          --rounds "${LOADER_ROUNDS:-3}" --json "$OUT/loader_ceiling_${cores}cores.json"
      done ;;
    smoke_triton|smoke_tilelang)  # the smoke with every operator switch on one backend (numerics end to end;
      # run `smoke` first in the same call: the summary then compares them, tools/smoke_compare.py);
      # smoke_triton's 21 runs take about 300 s (symbiosis ~7 s a run, queryformer ~12 s)
      b=${s#smoke_}
      step "$s" 330 python3 -m pcvr_lib smoke --models all --seeds 17,42,97 --steps 20 --device cuda \
        --jobs "${SMOKE_JOBS:-1}" --attention-backend "$b" --rms-norm-backend "$b" --embedding-backend "$b" \
        --out "$OUT/$s" ;;
    frontier)
      read -r -a tests <<< "${FRONTIER_TESTS:-perf_tests/test_norms.py perf_tests/test_attention.py}"
      PCVR_ATTENTION_PRECOMPILED=1 step frontier "${FRONTIER_S:-300}" $PYTEST "${tests[@]}" \
        ${FRONTIER_K:+-k "$FRONTIER_K"} --benchmark-only --benchmark-json="$OUT/${FRONTIER_JSON:-frontier}.json" ;;
    pcvr_ab)
      step pcvr_ab 150 python3 tools/attention_pcvr_ab.py --seconds "${AB_SECONDS:-60}" --out "$OUT" ;;
    profile_host)
      step profile_host "${PROFILE_HOST_S:-150}" python3 tools/profile_models.py --host --steps 2 --out "$OUT" \
        --models "${PROFILE_HOST_MODELS:-all}" --backends "${PROFILE_HOST_BACKENDS:-torch,triton}" \
        --phase "${PROFILE_HOST_PHASE:-train_step}"
      tail -40 "$OUT/profile_host.log" ;;
    profile)  # device time per kernel of the PROFILE_BACKENDS specs' train steps (tools/profile_models.py)
      step profile "${PROFILE_S:-300}" python3 tools/profile_models.py --models "${PROFILE_MODELS:-symbiosis}" \
        --backends "${PROFILE_BACKENDS:-torch:graph,triton:graph,triton:graph/rms_norm_backend=torch}" \
        --precision "${PROFILE_PRECISION:-bf16}" --steps 3 --top 30 --out "$OUT"
      tail -45 "$OUT/profile.log" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "--- summary"
[ -f "$OUT/accuracy.log" ] && tail -20 "$OUT/accuracy.log" | grep -E "passed|failed|FAILED|Error" | tail -8
[ -f "$OUT/accuracy_exclusive.log" ] && tail -3 "$OUT/accuracy_exclusive.log" | grep -E "passed|failed|skipped"
[ -f "$OUT/accuracy_rerun.log" ] && tail -5 "$OUT/accuracy_rerun.log"
[ -f "$OUT/norm_sweep.json" ] && python3 -m pcvr_lib report "$OUT/norm_sweep.json" | cut -c1-140
[ -f "$OUT/attention_tune.log" ] && tail -45 "$OUT/attention_tune.log"
[ -f "$OUT/attention_tune_small.log" ] && awk '/^shape/{on=1; print; next} on && NF>3 {k=substr($0, 1, 53); if (n[k]++ < 3) print}' \
  "$OUT/attention_tune_small.log"  # the best three per shape and kernel
for f in "$OUT"/attention_tune_window.log "$OUT"/attention_tune_key_lengths.log; do [ -f "$f" ] && awk '/^shape/{on=1; print; next} on && NF>3 {k=substr($0, 1, 53); if (n[k]++ < 3) print}' "$f"; done
[ -f "$OUT/attention_tune_one_tile.log" ] && grep -A60 "^shape" "$OUT/attention_tune_one_tile.log" | head -40
[ -f "$OUT/attention_long.log" ] && grep -E "^(compile|compiled|FAILED)" "$OUT/attention_long.log" | cut -c1-200 | tail -15 \
  && tail -34 "$OUT/attention_long.log"
[ -f "$OUT/kernels_norms.json" ] && python3 -m pcvr_lib report "$OUT/kernels_norms.json" --view cases | cut -c1-160 | head -80
[ -f "$OUT/noise.log" ] && cat "$OUT/noise.log"
[ -f "$OUT/optim.json" ] && python3 -m pcvr_lib report "$OUT/optim.json" --view optim
for f in "$OUT"/norms_diff.log "$OUT"/aa_diff_12.log "$OUT"/aa_diff_21.log "$OUT"/aa_cross_12.log "$OUT"/aa_cross_21.log "$OUT"/gate_diff.log; do
  [ -f "$f" ] && { echo "$(basename "$f" .log):"; grep -E "REGRESSED|MISSING|CHANGED| shift " "$f" | head -30; tail -2 "$f"; }; done
[ -f "$OUT/planted_host_diff.log" ] && { echo "planted_host_diff (expected: the 16 Triton cases, python_calls):"
  grep -E "REGRESSED|MISSING|CHANGED" "$OUT/planted_host_diff.log" | cut -c1-160 | head -40; tail -2 "$OUT/planted_host_diff.log"; }
[ -f "$OUT/planted_tile256.json" ] && [ -f "$OUT/noise_rep1.json" ] && python3 -m pcvr_lib diff \
  "$OUT/noise_rep1.json" "$OUT/planted_tile256.json" --noise "$OUT/noise_h200.json" --all 2>&1 | grep -v MISSING | tail -25
[ -f "$OUT/attention.json" ] && python3 -m pcvr_lib report "$OUT/attention.json" --view cases | cut -c1-160 | head -40
for f in "$OUT"/frontier*.json; do [ -f "$f" ] && python3 -m pcvr_lib report "$f" --view cases | cut -c1-200 | head -60; done
[ -f "$OUT/frontier.log" ] && grep -E "FAILED|ERROR|Error" "$OUT/frontier.log" | cut -c1-300 | head -20
[ -f "$OUT/host_ab.log" ] && tail -9 "$OUT/host_ab.log"
[ -f "$OUT/smoke.log" ] && tail -14 "$OUT/smoke.log"
for b in triton tilelang; do [ -f "$OUT/smoke_$b.log" ] && tail -14 "$OUT/smoke_$b.log"
  [ -d "$OUT/smoke_$b" ] && [ -d "$OUT/smoke_h200" ] && python3 tools/smoke_compare.py "$OUT/smoke_h200" \
    "$OUT/smoke_$b" --json "$OUT/smoke_compare_$b.json"; done  # same AUC as torch within seed noise?
for f in "$OUT"/models*.json; do [ -f "$f" ] && python3 -m pcvr_lib report "$f" --view models; done
for f in "$OUT"/loader_*cores_r*.json; do [ -f "$f" ] && { echo "$(basename "$f"):"; python3 -m pcvr_lib report "$f" | cut -c1-160 | head -12; }; done
[ -f "$OUT/pcvr_ab.log" ] && grep -E "^(left out|[0-9]+ interleaved|\|)" "$OUT/pcvr_ab.log" | tail -24
[ -f "$OUT/profile_host.log" ] && tail -60 "$OUT/profile_host.log"
# the device tool brings back 8 files at most: past that, everything but the logs' summary goes in one archive
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
  tar -C "$OUT" -czf /tmp/session.tar.gz . && find "$OUT" -mindepth 1 -delete && mv /tmp/session.tar.gz "$OUT/"
fi
exit 0
