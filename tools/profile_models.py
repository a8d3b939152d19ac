"""Where a model's training step spends its time, per operator backend (GPU; issue 12's model-level note).

    python tools/profile_models.py [--models all] [--backends torch,triton] [--steps 3] [--top 12] [--out DIR]

Same build and batch as perf_tests/test_models.py (batch 256, the demo schema's lengths, tables capped at
8192 rows). Each (model, backend): two warm-up steps, then `--steps` training steps under torch.profiler.
Per step: the kernels' device time (sum of CUDA kernel durations), the number of kernel launches, and the
`--top` kernels by device time. Writes profile_models.json to --out (default $OUT, else .) and prints, per
model, the backends side by side and the kernels whose device time differs most between them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcvr_lib.models import model_names  # noqa: E402
from pcvr_lib.models.step import ModelStep  # noqa: E402
from pcvr_lib.schema import load_schema  # noqa: E402
from pcvr_lib.timing import is_kernel_event  # noqa: E402
from smoke_tests.model_checks import DEMO_SCHEMA, GPU_BATCH, GPU_TABLE_CAP, random_batch  # noqa: E402


def profile_step(name: str, backend: str, schema, batch, steps: int) -> dict:
    step = ModelStep(name, schema, batch, backend, config={"vocab_cap": GPU_TABLE_CAP}, seed=0, device="cuda")
    for _ in range(2):
        step.train_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step.train_step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if is_kernel_event(event):
            entry = kernels[event.name[:90]]
            entry[0] += event.time_range.elapsed_us() / steps  # us per step (kernel durations)
            entry[1] += 1 / steps
    device_us = sum(us for us, _ in kernels.values())
    launches = sum(n for _, n in kernels.values())
    return {"device_us": round(device_us, 1), "launches": round(launches, 1),
            "kernels": {k: [round(us, 1), round(n, 2)] for k, (us, n) in
                        sorted(kernels.items(), key=lambda kv: -kv[1][0])}}


def print_tables(result: dict, top: int) -> None:
    """Per model: the backends side by side, then the kernels whose device time differs most from the first."""
    for name, per_backend in result["models"].items():
        ok = {b: r for b, r in per_backend.items() if "error" not in r}
        print(f"\n== {name}: " + ", ".join(f"{b} {r['device_us'] / 1e3:.1f} ms device, {r['launches']:.0f} launches"
                                         for b, r in ok.items()))
        for b, r in per_backend.items():
            if "error" in r:
                print(f"   {b}: {r['error']}")
        if len(ok) < 2:
            continue
        first = next(iter(ok))

        def us(backend, kernel, ok=ok):
            return ok[backend]["kernels"].get(kernel, [0, 0])

        names = set().union(*(r["kernels"] for r in ok.values()))
        diff = sorted(names, key=lambda k: -max(abs(us(b, k)[0] - us(first, k)[0]) for b in ok))
        print("   " + "  ".join(f"{b:>16}" for b in ok) + "  kernel (us per step [launches])")
        for k in diff[:top]:
            print("   " + "  ".join(f"{us(b, k)[0]:9.0f} [{us(b, k)[1]:4.0f}]" for b in ok) + f"  {k}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all")
    parser.add_argument("--backends", default="torch,triton")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--from", dest="from_json", help="print the tables of a saved profile_models.json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print_tables(json.load(f), args.top)
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    models = model_names() if args.models == "all" else args.models.split(",")
    backends = args.backends.split(",")
    schema = load_schema(DEMO_SCHEMA)
    batch = random_batch(schema, batch=GPU_BATCH, seed=3)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {},
              "note": "device_us: the sum of CUDA kernel durations per step (GPU-side annotations excluded)"}
    path = os.path.join(args.out, "profile_models.json")
    for name in models:
        result["models"][name] = {}
        for backend in backends:
            try:
                result["models"][name][backend] = profile_step(name, backend, schema, batch, args.steps)
            except Exception as exc:  # noqa: BLE001 - reported; the other models still run
                result["models"][name][backend] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            print(f"{name} {backend}: done", flush=True)
    print_tables(result, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
