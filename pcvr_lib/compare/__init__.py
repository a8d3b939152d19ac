"""Did this commit make something slower? `pcvr diff`, `pcvr noise` and `pcvr compare`.

Every benchmark case carries up to three numbers (README "Reading the JSON"):

- the gated statistic, pytest-benchmark's `stats.median`: device seconds per call for GPU cases
  (`extra_info.stat == "device"`), CPU seconds for CPU cases (`"cpu"`);
- `extra_info.host_us` for GPU cases: host CPU time to issue one call, and `extra_info.per_call_us`, what a
  user sees: both move with the host's load by tens of percent between processes, so between two stored runs
  (`pcvr diff`) they are reported with their change, never gated; interleaved A/B runs in one session
  (`pcvr compare`) gate them;
- `extra_info.work` for gated GPU cases: the counted work of one call (Python calls, aten ops, host reads,
  device launches; pcvr_lib/timing/work.py), exact: `pcvr diff` gates host regressions on it at zero
  tolerance.

Thresholds come from a measured noise floor (`pcvr noise`: the suite run N times on one machine): a
metric regresses when it grew by more than max(K x the spread seen in A/A runs of that case or group,
a relative floor, an absolute floor). Runs from different CPUs or accelerators are refused.

Exit codes: 0 nothing regressed, 1 a case regressed or went missing (absent from the new run, or not
comparable: another workload fingerprint or kind of statistic), 2 refused (unreadable input, a case with a
NaN, missing or non-positive statistic, different machines, a noise floor from fewer than two distinct
runs), 3 (`pcvr compare` only) inconclusive: a gated case neither within nor beyond its threshold after the
last pair.

Modules (each command's `add_arguments` / `run` live in its own module, wired in pcvr_lib/cli.py):
  runs         reading stored runs: cases, workload fingerprints, machines; the exit codes
  suite        running the benchmark suite in a pytest process that writes its JSON
  noise        `pcvr noise`: the noise floor, its file, the thresholds taken from it
  diff         `pcvr diff`: two stored runs, case by case
  interleaved  `pcvr compare`: interleaved A-B-B-A (or side-by-side) runs with paired intervals
"""

from pcvr_lib.compare.diff import (
    FAILING,
    REPORTED,
    Row,
    diff_files,
    diff_runs,
    diff_table,
    failed,
    resolve_base,
    shift_rows,
    stored_runs,
    work_comparable,
    work_rows,
)
from pcvr_lib.compare.interleaved import (
    AbRow,
    ab_compare,
    ab_exit_code,
    ab_samples,
    ab_table,
    ab_threshold,
    ab_verdict,
    abba_order,
    base_checkout,
    paired_interval,
    parse_env_assignments,
    replay_runs,
    run_abba_round,
    run_side_by_side_pair,
    t_quantile,
    unclear,
)
from pcvr_lib.compare.noise import (
    ABS_FLOOR_S,
    NOISE_VERSION,
    REL_FLOOR,
    K,
    build_noise,
    check_distinct,
    default_noise,
    default_noise_path,
    load_noise,
    noise_case,
    noise_key,
    noise_summary,
    run_identity,
    spread,
    threshold,
)
from pcvr_lib.compare.runs import (
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_REGRESSED,
    WORKLOAD_KEYS,
    Case,
    align_cases,
    case_group,
    cases_of,
    check_same_machine,
    cpu_seconds,
    current_machine,
    fingerprint,
    host_probe_us,
    load_run,
    machine_name,
    machine_of,
    short_id,
    stat_kind,
)
from pcvr_lib.compare.suite import check_suite, pytest_command, run_suite, start_suite
from pcvr_lib.report import EXIT_REFUSED

__all__ = [
    "ABS_FLOOR_S", "EXIT_INCONCLUSIVE", "EXIT_OK", "EXIT_REFUSED", "EXIT_REGRESSED", "FAILING", "K",
    "NOISE_VERSION", "REL_FLOOR", "REPORTED", "WORKLOAD_KEYS", "AbRow", "Case", "Row", "ab_compare",
    "ab_exit_code", "ab_samples", "ab_table", "ab_threshold", "ab_verdict", "abba_order", "align_cases",
    "base_checkout", "build_noise", "case_group", "cases_of", "check_distinct", "check_same_machine",
    "check_suite", "cpu_seconds", "current_machine", "default_noise", "default_noise_path", "diff_files",
    "diff_runs", "diff_table", "failed", "fingerprint", "host_probe_us", "load_noise", "load_run", "machine_name",
    "machine_of", "noise_case", "noise_key",
    "noise_summary", "paired_interval", "parse_env_assignments", "pytest_command", "replay_runs", "resolve_base",
    "run_abba_round", "run_identity", "run_side_by_side_pair", "run_suite", "shift_rows", "short_id", "spread",
    "start_suite", "stat_kind", "stored_runs", "t_quantile", "threshold", "unclear", "work_comparable",
    "work_rows",
]
