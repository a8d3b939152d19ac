"""The kernel benchmarks' shared pieces: the peers in one place, and readable parametrize ids.

Peers are third-party implementations a user would otherwise call; each benchmark module lists which of
them it times for its op in `PEERS` order (the baseline first: `speedup_vs_torch` divides by its time).
- norms: torch eager (F.rms_norm / F.layer_norm), torch.compile of the same, Liger-Kernel's Functions;
- embedding_bag_mean: torch eager (F.embedding_bag on in-range ids), in test_kernels_embedding;
- flash_attention: SDPA's default dispatch ("torch", our torch backend) and SDPA forced to one
  implementation (`sdpa_only`). (flex_attention is not benchmarked yet.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcvr_lib.kernels.tolerance import DTYPE_NAMES

PEERS = {
    "rms_norm": ("torch", "torch_compile", "liger"),
    "layer_norm": ("torch", "torch_compile", "liger"),
    "embedding_bag_mean": ("torch",),
    "flash_attention": ("torch", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"),
}


def pytest_make_parametrize_id(config, val, argname):
    """`argname=value` for dtypes and shapes that a test did not name itself (dtype=bf16, shape=8192x128)."""
    if isinstance(val, torch.dtype):
        return f"{argname}={DTYPE_NAMES.get(val, str(val).replace('torch.', ''))}"
    if isinstance(val, tuple) and val and all(isinstance(v, int) for v in val):
        return f"{argname}={'x'.join(map(str, val))}"
    return None


def norm_peer(op: str, backend: str, eps: float):
    """A norm peer as a callable (x, weight[, bias]) -> y."""
    from pcvr_lib.kernels.rms_norm import rms_norm_torch

    if backend == "torch":
        if op == "rms_norm":
            return lambda x, w: rms_norm_torch(x, w, eps)
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if backend == "torch_compile":
        torch._dynamo.reset()  # a fresh compile per case: no recompile limits, no dynamic-shape reuse
        if op == "rms_norm":
            return torch.compile(lambda x, w: rms_norm_torch(x, w, eps), dynamic=False)
        return torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps), dynamic=False)
    if backend == "liger":
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            # in_place=False: the benchmark reuses one grad tensor, which in-place would overwrite
            return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)
    raise ValueError(f"{op}: no peer {backend!r}; peers: {', '.join(PEERS[op])}")


class sdpa_only:  # noqa: N801 - used like a function: `with sdpa_only("sdpa_flash"):`
    """Enable exactly one SDPA implementation through torch's global switches (restored on exit)."""

    SWITCHES = {"sdpa_flash": "flash", "sdpa_efficient": "mem_efficient", "sdpa_cudnn": "cudnn"}

    def __init__(self, backend: str):
        if backend not in self.SWITCHES:
            raise ValueError(f"unknown SDPA backend {backend!r}; known: {', '.join(self.SWITCHES)}")
        self.want = self.SWITCHES[backend]

    def __enter__(self):
        cuda = torch.backends.cuda
        self.saved = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                      cuda.cudnn_sdp_enabled())
        cuda.enable_flash_sdp(self.want == "flash")
        cuda.enable_mem_efficient_sdp(self.want == "mem_efficient")
        cuda.enable_math_sdp(False)
        cuda.enable_cudnn_sdp(self.want == "cudnn")
        return self

    def __exit__(self, *exc):
        cuda = torch.backends.cuda
        cuda.enable_flash_sdp(self.saved[0])
        cuda.enable_mem_efficient_sdp(self.saved[1])
        cuda.enable_math_sdp(self.saved[2])
        cuda.enable_cudnn_sdp(self.saved[3])
