"""Host time per call of our kernels' launch paths, two trees interleaved (A-B-B-A) on one GPU.

    python3 tools/launch_host_ab.py BASE_DIR NEW_DIR [--rounds 2] [--json OUT]

Each measurement is a fresh process that imports `pcvr_lib` from one tree, so the two launch paths never
share a process. In it, every case is warmed (compile, caches), then timed in batches of back-to-back calls
with no synchronisation inside a batch: thread CPU time per call is the host time (the issuing work: Python,
argument checks, the launch), wall time per call with one synchronise per batch is the per-call time. The
device work of these cases is shorter than their host work, so the GPU queue never fills and blocks the
host. Median over batches; the ratio NEW/BASE per case is over all rounds' medians.
Use it to tell whether a change to a launch path (e.g. moving a kernel onto the shared Triton launcher) costs
host time: one run of each tree cannot tell such a difference from the host's drift, hence A-B-B-A rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("rms_norm_triton_8192x128", "emb_triton_B8192_D64_bag4", "emb_tilelang_B8192_D64_bag4",
         "attn_triton_pcvr_fwd", "attn_tilelang_pcvr_fwd", "attn_triton_pcvr_fwd_bwd")


def _calls(torch):
    from pcvr_lib.kernels import embedding_bag_mean, flash_attention, rms_norm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 128, device=dev, dtype=torch.float16, generator=g)
    w = torch.randn(128, device=dev, dtype=torch.float16, generator=g)
    table = torch.randn(1_000_000, 64, device=dev, dtype=torch.float16, generator=g)
    ids = torch.randint(1, 1_000_000, (8192, 4), device=dev, generator=g)
    q, k, v = (torch.randn(8, 8, 128, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    lengths = torch.randint(1, 129, (8,), device=dev, generator=g)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    grad = torch.randn_like(q)

    def fwd_bwd():
        out = flash_attention(qg, kg, vg, key_lengths=lengths, backend="triton")
        out.backward(grad)

    return {
        "rms_norm_triton_8192x128": lambda: rms_norm(x, w, backend="triton"),
        "emb_triton_B8192_D64_bag4": lambda: embedding_bag_mean(table, ids, backend="triton"),
        "emb_tilelang_B8192_D64_bag4": lambda: embedding_bag_mean(table, ids, backend="tilelang"),
        "attn_triton_pcvr_fwd": lambda: flash_attention(q, k, v, key_lengths=lengths, backend="triton"),
        "attn_tilelang_pcvr_fwd": lambda: flash_attention(q, k, v, key_lengths=lengths, backend="tilelang"),
        "attn_triton_pcvr_fwd_bwd": fwd_bwd,
    }


def measure(batches: int = 15, calls: int = 200) -> dict:
    """In this process (pcvr_lib from sys.path): {case: {"host_us": median, "per_call_us": median}}."""
    import torch

    results = {}
    for name, fn in _calls(torch).items():
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a backend this tree cannot run is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        host, wall = [], []
        for _ in range(batches):
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            c1 = time.thread_time()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            host.append((c1 - c0) / calls * 1e6)
            wall.append((t1 - t0) / calls * 1e6)
        results[name] = {"host_us": statistics.median(host), "per_call_us": statistics.median(wall)}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=2, help="A-B-B-A rounds")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.path.insert(0, args.child)
        print(json.dumps(measure()))
        return 0
    runs = {"base": [], "new": []}
    base, new = os.path.abspath(args.base), os.path.abspath(args.new)
    order = [("base", base), ("new", new), ("new", new), ("base", base)] * args.rounds
    for label, tree in order:
        command = [sys.executable, os.path.abspath(__file__), base, new, "--child", tree]
        out = subprocess.run(command, capture_output=True, text=True, cwd=tree)
        if out.returncode:
            print(f"{label} ({tree}) failed:\n{out.stderr[-2000:]}")
            return 1
        runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for case in CASES:
        row = {"case": case}
        for label in ("base", "new"):
            for metric in ("host_us", "per_call_us"):
                values = [r[case][metric] for r in runs[label] if metric in r.get(case, {})]
                row[f"{label}_{metric}"] = statistics.median(values) if values else None
                row[f"{label}_{metric}_all"] = values
        rows.append(row)
    print("| case | host us base -> new | ratio | per-call us base -> new | ratio |")
    print("|---|---|---|---|---|")

    def cell(row, metric):
        b, n = row[f"base_{metric}"], row[f"new_{metric}"]
        if b is None or n is None:
            return f"{b} -> {n}", "-"
        return f"{b:.1f} -> {n:.1f}", f"{n / b:.2f}"

    for r in rows:
        h, hr = cell(r, "host_us")
        p, pr = cell(r, "per_call_us")
        print(f"| {r['case']} | {h} | {hr} | {p} | {pr} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "order": [label for label, _ in order], "rows": rows, "runs": runs},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
