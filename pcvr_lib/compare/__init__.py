"""Did this commit make something slower? `pcvr diff`, `pcvr noise` and `pcvr compare`.

Every benchmark case carries up to three numbers (README "Reading the JSON"):

- the gated statistic, pytest-benchmark's `stats.median`: device seconds per call for GPU cases
  (`extra_info.stat == "device"`), CPU seconds for CPU cases (`"cpu"`);
- `extra_info.host_us` for GPU cases: host CPU time to issue one call, gated on its own;
- `extra_info.per_call_us`, what a user sees: it moves with the host's load, so it is compared only by
  interleaved A/B runs in one session (`pcvr compare`), never between two stored runs.

Thresholds come from a measured noise floor (`pcvr noise`: the suite run N times on one machine): a
metric regresses when it grew by more than max(K x the spread seen in A/A runs of that case or group,
a relative floor, an absolute floor). Runs from different CPUs or accelerators are refused.

Exit codes: 0 nothing regressed, 1 a case regressed or went missing, 2 refused (unreadable input,
different machines, nothing comparable), 3 (`pcvr compare` only) inconclusive: a gated case neither within
nor beyond its threshold after the last pair.

Modules (each command's `add_arguments` / `run` live in its own module, wired in pcvr_lib/cli.py):
  runs         reading stored runs: cases, workload fingerprints, machines; the exit codes
  suite        running the benchmark suite in a pytest process that writes its JSON
  noise        `pcvr noise`: the noise floor, its file, the thresholds taken from it
  diff         `pcvr diff`: two stored runs, case by case
  interleaved  `pcvr compare`: interleaved A-B-B-A (or side-by-side) runs with paired intervals
"""

from pcvr_lib.compare.diff import (
    HOST_GATED_FRACTION,
    MIN_CASES_FOR_GROUP_FACTOR,
    MIN_CASES_FOR_MEDIAN_FACTOR,
    Row,
    diff_files,
    diff_runs,
    diff_table,
    failed,
    host_factors,
    host_gated,
    resolve_base,
    stored_runs,
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
    default_noise,
    default_noise_path,
    load_noise,
    noise_key,
    noise_summary,
    spread,
    threshold,
)
from pcvr_lib.compare.runs import (
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_REGRESSED,
    WORKLOAD_KEYS,
    Case,
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
    "ABS_FLOOR_S", "EXIT_INCONCLUSIVE", "EXIT_OK", "EXIT_REFUSED", "EXIT_REGRESSED", "HOST_GATED_FRACTION",
    "MIN_CASES_FOR_GROUP_FACTOR", "MIN_CASES_FOR_MEDIAN_FACTOR", "NOISE_VERSION", "REL_FLOOR", "WORKLOAD_KEYS",
    "AbRow", "Case", "K", "Row", "ab_compare", "ab_exit_code", "ab_samples", "ab_table", "ab_threshold",
    "ab_verdict", "abba_order", "base_checkout", "build_noise", "case_group", "cases_of", "check_same_machine",
    "check_suite", "cpu_seconds", "current_machine", "default_noise", "default_noise_path", "diff_files", "diff_runs",
    "diff_table", "failed", "fingerprint", "host_factors", "host_gated", "host_probe_us", "load_noise",
    "load_run", "machine_name", "machine_of", "noise_key", "noise_summary", "paired_interval", "parse_env_assignments",
    "pytest_command", "replay_runs", "resolve_base", "run_abba_round", "run_side_by_side_pair", "run_suite",
    "short_id", "spread", "start_suite", "stat_kind", "stored_runs", "t_quantile", "threshold", "unclear",
]
