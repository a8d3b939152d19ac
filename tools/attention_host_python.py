"""The Python share of flash_attention's host path (triton backend), on any machine: CPU tensors, every Triton
launch replaced by a no-op, the CUDA path's implementation lookup forced. Prints the median per-call time of
the forward, of forward + torch.autograd.backward, and of the floor of any Python op (an autograd.Function that
only saves q, k, v and returns torch.empty gradients), then a cProfile of the forward + backward.

    python3 tools/attention_host_python.py [--batch 8 --heads 8 --seq 128 --dim 64 --calls 2000]

It patches the launcher and the backend lookup for the whole process: run it on its own, never imported.

What it leaves out, and the GPU host pays: the launches themselves, the CUDA caching allocator, and the
autograd engine's device thread running our Python backward (tools/attention_pcvr_ab.py times all of it).
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import pcvr_lib.kernels.attention as attention  # noqa: E402
from pcvr_lib.kernels import _triton, dispatch, flash_attention  # noqa: E402
from pcvr_lib.kernels.attention import triton_impl  # noqa: E402


class Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def per_call_us(fn, calls: int = 2000, reps: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 8), ("heads", 8), ("seq", 128), ("dim", 64)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed repetition (7 repetitions)")
    args = parser.parse_args(argv)
    launches = []
    _triton.Launcher.__call__ = lambda self, *a, **k: launches.append(self.name)
    _triton.Launcher.jit = lambda self, *a, **k: launches.append(self.name)
    # the CUDA path's cached lookup, keyed by the CPU tensors' device index (-1)
    dispatch.IMPLEMENTATIONS[(attention.OP, "triton", -1)] = triton_impl

    B, H, S, D = args.batch, args.heads, args.seq, args.dim
    q, k, v, grad_out = (torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(4))
    lengths = torch.randint(max(1, S // 4), S + 1, (B,), dtype=torch.int32)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def forward():
        flash_attention(q, k, v, key_lengths=lengths, backend="triton")

    def forward_backward():
        torch.autograd.backward(flash_attention(qg, kg, vg, key_lengths=lengths, backend="triton"), grad_out)
        qg.grad = kg.grad = vg.grad = None

    def floor():
        torch.autograd.backward(Floor.apply(qg, kg, vg), grad_out)
        qg.grad = kg.grad = vg.grad = None

    forward_backward()
    print(f"B{B} H{H} S{S} D{D} bf16, key lengths; launches per fwd+bwd (stubbed): {launches}")
    for name, fn in (("fwd", forward), ("fwd+bwd", forward_backward), ("floor Function fwd+bwd", floor)):
        print(f"{name:24s} {per_call_us(fn, args.calls):7.1f} us per call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        forward_backward()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
