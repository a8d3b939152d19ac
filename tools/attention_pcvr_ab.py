"""Interleaved per-call comparison at the PCVR shape: our flash_attention against every SDPA backend, one process.

    python3 tools/attention_pcvr_ab.py [--seconds 70] [--rounds 400] [--calls 40] [--dtypes bf16,fp16]
                                       [--masks key_lengths] [--directions fwd,fwd+bwd] [--out DIR]

The PCVR-shape target: forward+backward per call at most the best SDPA backend's per call, measured in
one interleaved run. Implementations: ours (`triton`, `tilelang`) and SDPA forced to each backend with
`torch.nn.attention.sdpa_kernel` (`sdpa_flash`, `sdpa_efficient`, `sdpa_cudnn`, `sdpa_math`), SDPA given the
equivalent boolean mask built once outside the call (perf_tests/test_attention.py's `problem` and
`make_call`: the same inputs, key lengths and mask as the benchmark). SDPA's flash kernel takes no mask and
is left out of masked cases; a backend that refuses an input ("No available kernel") is reported and left out.

Every (case, implementation) is checked first against the fp64 reference by the flash-attention rule (as the
benchmark does, outputs poisoned on the GPU); a wrong result is never timed (ours: the tool exits 1).

Timing: rounds; in each round every (case, implementation) block runs once, the order of the blocks rotated
by one per round (ABCD, BCDA, ...) so that drift and position effects fall on every implementation alike. A
block: synchronise, `--calls` back-to-back calls (host work included, no graph), synchronise; its wall time /
calls is that round's per-call time. Inputs stay in L2 across calls (warm, as in a model where the previous
layer just wrote them). One warm-up round is dropped. Rounds stop at `--rounds` or after `--seconds`.

Report per case: the median per-call time of each implementation, the best SDPA backend (lowest median), and
for each of ours the ratio ours / best SDPA as the geometric mean over rounds of the per-round ratio with a
95% Student's t interval (`pcvr_lib.compare.paired_interval`, each round one pair). Verdict against the
target (fwd+bwd: ratio <= 1): met when the interval's top is <= 1, missed when its bottom is > 1, else
unclear. Forward rows carry the same numbers, informational. JSON (every round's times) to
$OUT/pcvr_ab.json (or --out); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PCVR_SHAPE = ("B8xH8xS128xD64", 8, 8, 128, 64)
OURS = ("triton", "tilelang")
SDPA = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")
TARGET_DIRECTION = "fwd+bwd"  # the target: fwd+bwd per call <= the best SDPA backend's


# ------------------------------------------------------------------------------ the interleaved rounds


def rotated(names: list, round_index: int) -> list:
    """The block order of one round: the list rotated left by the round's index."""
    if not names:
        return []
    r = round_index % len(names)
    return names[r:] + names[:r]


def interleave(blocks: dict[str, Callable[[], object]], *, calls: int, rounds: int, seconds: float | None = None,
               warmup_rounds: int = 1, clock: Callable[[], float] = time.perf_counter,
               sync: Callable[[], None] = lambda: None,
               enter: Callable[[str], object] | None = None) -> tuple[dict[str, list[float]], list[list[str]]]:
    """Per-call seconds of every block, one value per timed round, and the order each round ran in.

    `blocks` maps a name to one call; `enter(name)` gives a context manager held around that block's calls
    (SDPA's backend switch), entered before the timing starts. `seconds` stops after the round that
    exceeds it (at least two timed rounds are kept)."""
    names = list(blocks)
    times: dict[str, list[float]] = {name: [] for name in names}
    orders: list[list[str]] = []
    start = clock()
    for r in range(warmup_rounds + rounds):
        order = rotated(names, r)
        for name in order:
            fn = blocks[name]
            ctx = enter(name) if enter is not None else None
            if ctx is not None:
                ctx.__enter__()
            try:
                sync()
                t0 = clock()
                for _ in range(calls):
                    fn()
                sync()
                t1 = clock()
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            if r >= warmup_rounds:
                times[name].append((t1 - t0) / calls)
        if r >= warmup_rounds:
            orders.append(order)
            if seconds is not None and clock() - start > seconds and r - warmup_rounds + 1 >= 2:
                break
    return times, orders


# ------------------------------------------------------------------------------ the summary


def verdict(low: float, high: float) -> str:
    if high <= 1.0:
        return "met"
    if low > 1.0:
        return "missed"
    return "unclear"


def summarise(times: dict[str, list[float]], ours=OURS, peers=SDPA) -> dict:
    """Medians (us), the best SDPA backend and, for each of ours, ratio ours / best SDPA with its 95% interval."""
    from pcvr_lib.compare import paired_interval

    medians = {name: statistics.median(v) * 1e6 for name, v in times.items() if v}
    present = [p for p in peers if p in medians]
    out = {"median_us": {k: round(v, 3) for k, v in medians.items()}, "rounds": min(map(len, times.values()))
           if times else 0, "best_sdpa": None, "ours": {}}
    if not present:
        return out
    best = min(present, key=medians.get)
    out["best_sdpa"] = best
    out["best_sdpa_us"] = round(medians[best], 3)
    for name in ours:
        if name not in medians:
            continue
        pairs = list(zip(times[best], times[name], strict=False))  # round i of each: one pair
        ratio, low, high = paired_interval([[b] for b, _ in pairs], [[o] for _, o in pairs])
        out["ours"][name] = {"ratio": round(ratio, 4), "ci95": [round(low, 4), round(high, 4)],
                             "verdict": verdict(low, high), "median_us": round(medians[name], 3)}
    return out


def table(summary: dict) -> str:
    """One row per case and implementation of ours: medians, best SDPA, ratio [95% interval], verdict."""
    lines = ["| case | impl | per call us (median) | best SDPA | its us | ours / best [95% CI] | target fwd+bwd <= 1 |",
             "|---|---|---|---|---|---|---|"]
    for case, s in summary.items():
        direction = case.rsplit(",dir=", 1)[-1]
        if not s["ours"]:
            lines.append(f"| {case} | - | - | {s['best_sdpa']} | {s.get('best_sdpa_us', '-')} | - | no result |")
        for name, o in s["ours"].items():
            low, high = o["ci95"]
            judged = o["verdict"] if direction == TARGET_DIRECTION else f"({o['verdict']}, informational)"
            lines.append(f"| {case} | {name} | {o['median_us']:.1f} | {s['best_sdpa']} | {s['best_sdpa_us']:.1f} | "
                         f"{o['ratio']:.3f} [{low:.3f}, {high:.3f}] | {judged} |")
        others = ", ".join(f"{k} {v:.1f}" for k, v in s["median_us"].items() if k not in s["ours"])
        lines.append(f"|  | (SDPA medians: {others}) | | | | | |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the cases


def sdpa_context(name: str):
    """torch's own switch forcing one SDPA backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}[name]
    return sdpa_kernel(backend)


def build_blocks(device: str, dtypes, masks, directions, impls, shape=PCVR_SHAPE) -> tuple[dict, dict, dict]:
    """(blocks: "case|impl" -> call, skipped: "case|impl" -> reason, wrong: "case|impl" -> reason): every
    implementation checked against the fp64 reference first (flash-attention rule, SDPA's default dispatch as
    the baseline error). `impls` are ours (flash_attention backends, "torch" included for CPU runs) and SDPA
    names; a wrong result of ours goes to `wrong`, an unavailable or wrong SDPA backend to `skipped`."""
    import contextlib

    from pcvr_lib.kernels.testing import poisoned_outputs
    from pcvr_lib.kernels.tolerance import flash_rule
    from perf_tests import test_attention as bench

    blocks, skipped, wrong = {}, {}, {}
    for dtype in dtypes:
        for mask in masks:
            q, k, v, do, kw, attn_mask = bench.problem(shape, mask, dtype, device)
            for direction in directions:
                case = f"{shape[0]},mask={mask},dtype={dtype},dir={direction}"
                ref, torch_err = bench.baseline((shape, mask, dtype, direction), q, k, v, do, kw, attn_mask,
                                                direction)
                for impl in impls:
                    name = f"{case}|{impl}"
                    if impl == "sdpa_flash" and attn_mask is not None:
                        skipped[name] = "SDPA's flash kernel takes no attention mask"
                        continue
                    is_sdpa = impl in SDPA
                    call = bench.make_call("sdpa" if is_sdpa else impl, q, k, v, do, kw, attn_mask, direction)
                    try:
                        # outputs poisoned on the GPU: a kernel that skips a write cannot pass on stale memory
                        poison = poisoned_outputs(device) if device != "cpu" else contextlib.nullcontext()
                        with sdpa_context(impl) if is_sdpa else contextlib.nullcontext(), poison:
                            got = bench._as_list(call())
                            for what, a, r, te in zip(("out", "dq", "dk", "dv"), got, ref, torch_err, strict=False):
                                flash_rule(a, r, te, bench.DTYPES[dtype], f"{impl} {what}")
                    except AssertionError as exc:
                        (skipped if is_sdpa else wrong)[name] = f"check failed: {str(exc).splitlines()[0][:160]}"
                        continue
                    except RuntimeError as exc:
                        if not is_sdpa:
                            raise
                        skipped[name] = f"not available: {str(exc).splitlines()[0][:160]}"
                        continue
                    blocks[name] = call
    return blocks, skipped, wrong


def by_case(times: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for name, values in times.items():
        case, impl = name.split("|")
        out.setdefault(case, {})[impl] = values
    return out


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=70.0, help="stop the rounds after this long")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--calls", type=int, default=40, help="back-to-back calls per block")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--masks", default="key_lengths", help="of workload.MODES, e.g. key_lengths,none")
    parser.add_argument("--directions", default="fwd,fwd+bwd")
    parser.add_argument("--impls", default=",".join((*OURS, *SDPA)))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the case code (our torch backend "
                        "and sdpa_math only; the numbers mean nothing)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)

    import torch

    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in (*OURS, *SDPA, "torch")]
    if unknown:
        parser.error(f"--impls: unknown {unknown} (known: {', '.join((*OURS, *SDPA, 'torch'))})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --device cpu for a dry run)")
    ours = [i for i in impls if i not in SDPA]
    blocks, skipped, wrong = build_blocks(args.device, args.dtypes.split(","), args.masks.split(","),
                                          args.directions.split(","), impls)
    for name, reason in {**skipped, **wrong}.items():
        print(f"left out {name}: {reason}")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    times, orders = interleave(blocks, calls=args.calls, rounds=args.rounds, seconds=args.seconds, sync=sync,
                               enter=lambda name: sdpa_context(name.split("|")[1])
                               if name.split("|")[1] in SDPA else None)
    elapsed = time.perf_counter() - t0
    summary = {case: summarise(per_impl, ours=ours) for case, per_impl in by_case(times).items()}
    result = {
        "tool": "tools/attention_pcvr_ab.py", "commit": _git_commit(), "argv": sys.argv[1:] if argv is None else argv,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "calls_per_block": args.calls, "rounds": len(orders),
        "seconds": round(elapsed, 1), "l2": "warm (inputs reused back to back)",
        "summary": summary, "skipped": skipped, "wrong": wrong,
        "per_call_s": {name: [round(x, 9) for x in v] for name, v in times.items()},
        "first_orders": orders[:3],
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pcvr_ab.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{len(orders)} interleaved rounds of {len(blocks)} blocks x {args.calls} calls in {elapsed:.1f} s -> {path}")
    print(table(summary))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
