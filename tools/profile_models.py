"""Where a model's training step (or inference pass) spends its time, per operator backend (GPU; results in
notes/models.md).

    python tools/profile_models.py [--models all] [--backends torch,triton] [--steps 3] [--top 12] [--out DIR]
    python tools/profile_models.py --models onetrans --backends torch:graph,triton:graph,triton:captured
    python tools/profile_models.py --models symbiosis --backends torch:graph,triton:graph --precision bf16
    python tools/profile_models.py --models symbiosis --backends triton:graph,triton:graph/rms_norm_backend=torch
    python tools/profile_models.py --host [--device cuda|cpu] [--batch 256] ...   # host time instead
    python tools/profile_models.py --host --phase infer --models onetrans --backends torch:graph,triton:graph
    python tools/profile_models.py --from DIR/profile_models.json | DIR/profile_host.json   # tables again

Same build and batch as perf_tests/test_models.py (batch 256, the demo schema's lengths, tables capped at
8192 rows), at `--precision` (fp32, or bf16: every step under bf16 autocast, as the benchmark's bf16 cases and
`pcvr train --amp` run it). Each (model, backend): two warm-up steps (three compiled), then `--steps` training
steps under torch.profiler (`--phase infer`: inference passes instead, in both profiles).
Per step: the kernels' device time (sum of CUDA kernel durations), the number of kernel launches, and the
`--top` kernels by device time. Writes profile_models.json to --out (default $OUT, else .) and prints, per
model, the backends side by side and the kernels whose device time differs most between them.

`--host` attributes the host time of a step instead (profile_host.json): per (model, backend spec), after two
warm-up steps (three in the compiled modes), (1) the step's thread CPU time and wall time without any profiler
(`--steps` steps; thread CPU time is what the benchmark's host_us counts); (2) cProfile over `--steps` steps with
the thread CPU clock: per Python function its own (tottime) and inclusive (cumtime) CPU time and calls per step,
and the own time summed per package (pcvr_lib's modules one by one, triton, tilelang, torch, built-in calls); (3)
torch.profiler over `--steps` steps: self CPU time per op name (aten ops, our autograd Functions, and on CUDA the
runtime calls: cudaLaunchKernel, cudaStreamSynchronize, cudaMemcpyAsync, whose wall time a host sync waits in). On
CUDA the backward runs in autograd's device thread: thread CPU time and cProfile see the calling thread only
(forward, optimizer, the wait for backward), so the plain measurement also gives the process CPU time (every
thread) and torch.profiler, which records every thread, shows the backward's ops and our autograd Functions'
backward (`autograd::engine::evaluate_function: ...`). Printed per model: the backends side by side, the packages,
the functions and the ops whose per-step time differs most from the first backend. cProfile's own overhead inflates
Python-heavy code (each Python call costs it ~1 us): read its numbers as shares, and (1) as the step's real host
time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pcvr_lib.models import model_names  # noqa: E402
from pcvr_lib.models.common import BACKEND_OPTIONS  # noqa: E402
from pcvr_lib.models.compiled import MODES, mode_problem  # noqa: E402
from pcvr_lib.models.step import ModelStep  # noqa: E402
from pcvr_lib.schema import load_schema  # noqa: E402
from pcvr_lib.timing import is_kernel_event  # noqa: E402
from pcvr_lib.train.config import at_precision as step_at_precision  # noqa: E402
from pcvr_lib.workloads.models import DEMO_SCHEMA, GPU_BATCH, GPU_TABLE_CAP, random_batch  # noqa: E402


def at_precision(step: ModelStep, precision: str):
    """The context `step`'s calls run in at `precision` (bf16: autocast, as the benchmark's bf16 cases)."""
    return step_at_precision(next(step.model.parameters()).device, precision, captured=step.mode == "captured")


def parse_backend(spec: str) -> tuple[str, str, dict[str, str]]:
    """`BACKEND[:MODE][/SWITCH=BACKEND...]` -> (backend, mode, switches): an operator backend, its mode (eager
    without one) and single operator switches set apart from it, e.g. `triton:graph/rms_norm_backend=torch`
    (our kernels but torch's norms, which inductor can fuse with their neighbours)."""
    head, *overrides = spec.split("/")
    backend, _, mode = head.partition(":")
    if mode and mode not in MODES:
        raise ValueError(f"backend spec {spec!r}: mode {mode!r} is not one of {', '.join(MODES)}")
    switches = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in BACKEND_OPTIONS or not value:
            raise ValueError(f"backend spec {spec!r}: {item!r} is not SWITCH=BACKEND with SWITCH one of "
                             f"{', '.join(BACKEND_OPTIONS)}")
        switches[key] = value
    return backend, mode or "eager", switches


PHASES = ("train_step", "infer")


def build_step(name: str, spec: str, schema, batch, device: str, config: dict | None = None) -> ModelStep:
    """`name` on the `parse_backend` spec `spec` (`torch:graph`, `triton:captured`, `triton:graph/rms_norm_backend=
    torch`), built as the benchmark builds it; `config` replaces the benchmark's settings (tables capped at
    GPU_TABLE_CAP rows), the spec's switches still apply."""
    backend, mode, switches = parse_backend(spec)
    config = {"vocab_cap": GPU_TABLE_CAP} if config is None else config
    return ModelStep(name, schema, batch, backend, config={**config, **switches}, seed=0, device=device, mode=mode)


def warm_call(step: ModelStep, phase: str):
    """The step's call of `phase`, after its warm-up calls (compiled modes three: inductor's CUDA graphs record
    on the third call)."""
    call = step.train_step if phase == "train_step" else step.infer
    for _ in range(2 if step.mode == "eager" else 3):
        call()
    return call


def profile_step(name: str, backend: str, schema, batch, steps: int, precision: str = "fp32",
                 phase: str = "train_step") -> dict:
    """The kernels of `steps` calls of `phase` of `name` on the `parse_backend` spec `backend`."""
    step = build_step(name, backend, schema, batch, "cuda")
    with at_precision(step, precision):
        call = warm_call(step, phase)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                call()
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if is_kernel_event(event):
            entry = kernels[event.name[:90]]
            entry[0] += event.time_range.elapsed_us() / steps  # us per call (kernel durations)
            entry[1] += 1 / steps
    device_us = sum(us for us, _ in kernels.values())
    launches = sum(n for _, n in kernels.values())
    return {"device_us": round(device_us, 1), "launches": round(launches, 1),
            "kernels": {k: [round(us, 1), round(n, 2)] for k, (us, n) in
                        sorted(kernels.items(), key=lambda kv: -kv[1][0])}}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync")  # runtime calls a host sync waits in (their self time is wall time)


def _in_repository(path: str) -> bool:
    """A file of this checkout's own code (a virtual environment inside the checkout holds libraries)."""
    return path.startswith(ROOT + os.sep) and not {"site-packages", "dist-packages"} & set(path.split(os.sep))


def package_of(filename: str) -> str:
    """The bucket of a cProfile entry: pcvr_lib's module (pcvr_lib.kernels.attention), triton, tilelang,
    torch.autograd / torch.optim / torch (other), another library, or "built-in" (C functions and methods:
    torch's ops called from Python land here, with the time their C++ side takes)."""
    if filename.startswith("~") or filename.startswith("<"):
        return "built-in"
    path = os.path.abspath(filename)
    if _in_repository(path):
        parts = os.path.relpath(path, ROOT).split(os.sep)
        mod = [p for p in parts[:-1]] + ([parts[-1].removesuffix(".py")] if parts[-1] != "__init__.py" else [])
        return ".".join(mod[:3])
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages", "lib"):
        if marker in parts:
            rest = parts[len(parts) - parts[::-1].index(marker):]
            if rest and rest[0] == "torch" and len(rest) > 1 and rest[1] in ("autograd", "optim", "nn", "cuda"):
                return f"torch.{rest[1]}"
            if rest:
                return "stdlib" if rest[0].startswith("python3") else rest[0].removesuffix(".py")
    return "other"


def _label(func: tuple) -> str:
    filename, line, name = func
    if filename.startswith("~"):
        return name  # a built-in: "<method 'tolist' of 'torch._C.TensorBase' objects>"
    path = os.path.abspath(filename)
    short = os.path.relpath(path, ROOT) if _in_repository(path) else "/".join(path.split(os.sep)[-2:])
    return f"{short}:{line}({name})"


def host_profile(name: str, backend: str, schema, batch, steps: int, device: str, top: int,
                 config: dict | None = None, precision: str = "fp32", phase: str = "train_step") -> dict:
    """Host time of one call of `phase` of `name` on the `parse_backend` spec `backend` at `precision` (the
    three views of the module docstring); `config` as in `build_step`."""
    step = build_step(name, backend, schema, batch, device, config)
    with at_precision(step, precision):
        return _host_views(step, steps, device, top, phase)


def _host_views(step: ModelStep, steps: int, device: str, top: int, phase: str = "train_step") -> dict:
    """host_profile's measurements of an already built step."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call = warm_call(step, phase)
    sync()

    cpu0, proc0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        call()
    cpu1, proc1 = time.thread_time(), time.process_time()
    sync()
    wall1 = time.perf_counter()

    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for _ in range(steps):
        call()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    packages: dict[str, float] = defaultdict(float)
    funcs = {}
    for func, (_, ncalls, tottime, cumtime, _) in stats.items():
        packages[package_of(func[0])] += tottime / steps * 1e6
        funcs[_label(func)] = [round(tottime / steps * 1e6, 1), round(cumtime / steps * 1e6, 1),
                               round(ncalls / steps, 1)]
    by_own = sorted(funcs, key=lambda f: -funcs[f][0])[: 4 * top]
    by_cum = sorted(funcs, key=lambda f: -funcs[f][1])[: 4 * top]

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as tprof:
        for _ in range(steps):
            call()
        sync()
    ops = {}
    for avg in tprof.key_averages():
        self_us = getattr(avg, "self_cpu_time_total", 0.0)
        if self_us > 0:
            ops[avg.key[:90]] = [round(self_us / steps, 1), round(avg.count / steps, 1)]
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1][0])[: 4 * top])
    return {
        "host_cpu_us": round((cpu1 - cpu0) / steps * 1e6, 1),
        "process_cpu_us": round((proc1 - proc0) / steps * 1e6, 1),  # every thread: autograd's device thread too
        "wall_us": round((wall1 - wall0) / steps * 1e6, 1),
        "cprofile_cpu_us": round(sum(packages.values()), 1),
        "packages_us": {k: round(v, 1) for k, v in sorted(packages.items(), key=lambda kv: -kv[1])},
        "functions": {f: funcs[f] for f in dict.fromkeys(by_own + by_cum)},  # [own us, inclusive us, calls] per call
        "ops_self_us": ops,  # torch.profiler: op name -> [self CPU us, calls] per call
        "sync_wall_us": round(sum(v[0] for k, v in ops.items() if k in SYNC_CALLS), 1),
    }


def _diff_rows(per_backend: dict, field: str, index: int, top: int) -> list[str]:
    """The `top` entries of per_backend[b][field] whose value [index] differs most from the first backend."""
    first = next(iter(per_backend))

    def val(b, k):
        v = per_backend[b][field].get(k)
        return 0.0 if v is None else (v[index] if isinstance(v, list) else v)

    names = set().union(*(r[field] for r in per_backend.values()))
    if len(per_backend) > 1:
        order = sorted(names, key=lambda k: -max(abs(val(b, k) - val(first, k)) for b in per_backend))
    else:  # one backend: the largest
        order = sorted(names, key=lambda k: -val(first, k))
    rows = []
    for k in order[:top]:
        rows.append("   " + "  ".join(f"{val(b, k):10.0f}" for b in per_backend) + f"  {k}")
    return rows


def print_host_tables(result: dict, top: int) -> None:
    """Per model: host CPU / wall per call and sync wait per backend, then packages, functions (own time),
    functions (inclusive) and torch ops (self CPU) whose per-call time differs most from the first backend."""
    for name, per_backend in result["models"].items():
        ok = {b: r for b, r in per_backend.items() if "error" not in r}
        print(f"\n== {name} {result.get('phase', 'train_step')}: " + "; ".join(
            f"{b} host {r['host_cpu_us'] / 1e3:.1f} ms CPU ({r.get('process_cpu_us', 0) / 1e3:.1f} all threads), "
            f"{r['wall_us'] / 1e3:.1f} ms wall, "
            f"sync calls {r['sync_wall_us'] / 1e3:.1f} ms" for b, r in ok.items()))
        for b, r in per_backend.items():
            if "error" in r:
                print(f"   {b}: {r['error']}")
        if not ok:
            continue
        head = "   " + "  ".join(f"{b:>10}" for b in ok)
        for title, field, index in (("package, own CPU us per call (cProfile)", "packages_us", 0),
                                    ("function, own CPU us per call (cProfile)", "functions", 0),
                                    ("function, inclusive CPU us per call (cProfile)", "functions", 1),
                                    ("op, self CPU us per call (torch.profiler)", "ops_self_us", 0)):
            print(head + f"  {title}")
            print("\n".join(_diff_rows(ok, field, index, top)))


def print_tables(result: dict, top: int) -> None:
    """Per model: the backends side by side, then the kernels whose device time differs most from the first."""
    for name, per_backend in result["models"].items():
        ok = {b: r for b, r in per_backend.items() if "error" not in r}
        print(f"\n== {name} {result.get('phase', 'train_step')}: " + ", ".join(
            f"{b} {r['device_us'] / 1e3:.1f} ms device, {r['launches']:.0f} launches" for b, r in ok.items()))
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
        print("   " + "  ".join(f"{b:>16}" for b in ok) + "  kernel (us per call [launches])")
        for k in diff[:top]:
            print("   " + "  ".join(f"{us(b, k)[0]:9.0f} [{us(b, k)[1]:4.0f}]" for b in ok) + f"  {k}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all")
    parser.add_argument("--backends", default="torch,triton",
                        help="operator backends, each optionally with its mode (backend:eager|compile|graph|captured) "
                             "and single operator switches apart from it (triton:graph/rms_norm_backend=torch)")
    parser.add_argument("--phase", choices=PHASES, default="train_step",
                        help="what each call runs: a training step (default) or an inference pass")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--host", action="store_true", help="attribute host time instead of device time")
    parser.add_argument("--device", default="cuda", help="--host only: cpu runs the torch backend on the CPU")
    parser.add_argument("--batch", type=int, default=GPU_BATCH, help="batch rows (the benchmark's 256)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: every step under bf16 autocast (the benchmark's bf16 cases, pcvr train --amp)")
    parser.add_argument("--from", dest="from_json", help="print the tables of a saved profile_models.json or "
                        "profile_host.json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        (print_host_tables if saved.get("kind") == "host" else print_tables)(saved, args.top)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (--host --device cpu runs on the CPU)")
    if args.device != "cuda" and not args.host:
        parser.error("the device profile needs --device cuda; --device cpu works with --host")
    models = model_names() if args.models == "all" else args.models.split(",")
    backends = args.backends.split(",")
    for spec in backends:
        try:
            problem = mode_problem(parse_backend(spec)[1], args.device)
        except ValueError as exc:
            problem = str(exc)
        if problem:
            parser.error(f"--backends {spec}: {problem}")
    schema = load_schema(DEMO_SCHEMA)
    batch = random_batch(schema, batch=args.batch, seed=3)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.host:
        result = {"kind": "host", "device": device_name, "torch": torch.__version__, "steps": args.steps,
                  "batch": args.batch, "precision": args.precision, "phase": args.phase, "models": {},
                  "note": f"us per call of {args.phase}; host_cpu_us / wall_us without a profiler; packages_us and "
                          "functions ([own, inclusive, calls]) from cProfile on the thread CPU clock; "
                          "ops_self_us ([self CPU us, calls]) from torch.profiler; sync_wall_us: its sync calls"}
        path = os.path.join(args.out, "profile_host.json")
    else:
        result = {"device": device_name, "torch": torch.__version__, "precision": args.precision,
                  "phase": args.phase, "models": {},
                  "note": f"device_us: the sum of CUDA kernel durations per call of {args.phase} (GPU-side "
                          "annotations excluded)"}
        path = os.path.join(args.out, "profile_models.json")
    os.makedirs(args.out, exist_ok=True)
    for name in models:
        result["models"][name] = {}
        for backend in backends:
            try:
                if args.host:
                    entry = host_profile(name, backend, schema, batch, args.steps, args.device, args.top,
                                         precision=args.precision, phase=args.phase)
                else:
                    entry = profile_step(name, backend, schema, batch, args.steps, args.precision, args.phase)
            except Exception as exc:  # noqa: BLE001 - reported; the other models still run
                entry = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            result["models"][name][backend] = entry
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            print(f"{name} {backend}: done", flush=True)
    (print_host_tables if args.host else print_tables)(result, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
