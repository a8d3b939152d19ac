"""The kernel benchmarks' shared pieces: the peers in one place, and readable parametrize ids.

Peers are third-party implementations a user would otherwise call; each benchmark module lists which of
them it times for its op in `PEERS` order (the baseline first: `speedup_vs_torch` divides by its time).
- norms: torch eager (F.rms_norm / F.layer_norm), torch.compile of the same, Liger-Kernel's Functions;
- embedding_bag_mean: torch eager (F.embedding_bag on in-range ids), in test_kernels_embedding;
- flash_attention: SDPA's default dispatch ("torch", our torch backend: SDPA with the equivalent boolean
  mask), SDPA forced to one implementation (`sdpa_only`), and torch's compiled `flex_attention` with a
  block mask (`flex_peer`; the models' masked shapes only, informational: it is the reference point for
  block-sparse masks, not a baseline of speedup_vs_torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pcvr_lib.kernels.tolerance import DTYPE_NAMES
from perf_tests.planted import planted_norm_tile

PEERS = {
    "rms_norm": ("torch", "torch_compile", "liger"),
    "layer_norm": ("torch", "torch_compile", "liger"),
    "embedding_bag_mean": ("torch",),
    "flash_attention": ("torch", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"),
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


def flex_peer(kw: dict, B: int, H: int, S: int, device, compile: bool = True):
    """torch's flex_attention (compiled, one compile per case) with the block mask of flash_attention's mask
    keyword arguments `kw` (key lengths, window + global queries, or a role mask; self-attention of length S):
    a callable (q, k, v) -> out. The block mask is built here, outside any timed call. compile=False: eager
    flex_attention (the CPU test of the mask functions)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rm = kw.get("role_mask")
    if rm is not None:
        roles, vis = rm.roles.to(device=device, dtype=torch.long), rm.visibility.to(device)
        valid = rm.key_valid.to(device) if rm.key_valid is not None else torch.ones_like(roles, dtype=torch.bool)

        def mask_mod(b, h, i, j):
            return (vis[roles[b, i], roles[b, j]] & valid[b, j]) | (i == j)
    else:
        kl = kw.get("key_lengths")
        lengths = (kl.to(device=device, dtype=torch.long).clamp(min=0) if kl is not None
                   else torch.full((B,), S, device=device, dtype=torch.long))
        window, n_global = kw.get("window"), kw.get("global_queries", 0)
        if window is None and not kw.get("causal") and not kw.get("causal_valid"):
            def mask_mod(b, h, i, j):
                return j < lengths[b]
        elif window is not None:
            def mask_mod(b, h, i, j):
                valid_row = i < lengths[b]
                in_window = (j <= i) & (i - j < window) & valid_row
                is_global = valid_row & (i >= lengths[b] - n_global) & (j < lengths[b])
                return in_window | is_global | (i == j)
        else:
            raise ValueError(f"flex_peer: no block mask for {sorted(kw)} (key lengths, window, role_mask only)")
    block_mask = create_block_mask(mask_mod, B, None, S, S, device=device)
    attend = flex_attention
    if compile:
        torch._dynamo.reset()  # a fresh compile per case
        attend = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: attend(q, k, v, block_mask=block_mask)


@pytest.fixture(autouse=True)
def _planted_norm_tile(monkeypatch):
    """With PCVR_PLANTED_NORM_TILE set (only for validating the comparison: perf_tests/planted.py), the norm
    kernels run a deliberately worse tile (e.g. 256 elements per program against 2048): a known device-time
    regression that `pcvr diff` must flag."""
    tile = planted_norm_tile()
    if tile is not None:
        from pcvr_lib.kernels.rms_norm import config

        monkeypatch.setattr(config, "TILE_ELEMENTS", tile)
    yield
