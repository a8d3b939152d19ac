"""Same-shape matrices stacked into one (B, m, n) batch, and an optional CUDA graph around the batch math.

Optimizer steps on small models are launch-bound: one bmm over a stack of B matrices costs the same launch
as one matmul, and a CUDA graph replays the whole fixed chain of kernels (normalise, iterate, rescale) with
one host call. Inputs are copied into static stacked buffers first (one `torch.cat(out=...)` per bucket),
so the graph always reads and writes the same addresses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """Parameters whose matrices share (m, n), dtype and device; each contributes `count` matrices."""

    key: tuple
    params: list[torch.Tensor]
    m: int
    n: int
    counts: list[int]
    starts: list[int] = field(default_factory=list)

    def __post_init__(self):
        total = 0
        self.starts = []
        for c in self.counts:
            self.starts.append(total)
            total += c
        self.size = total

    def gather(self, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Stack per-parameter tensors (shaped like their parameters) into (B, m, n)."""
        parts = [t.reshape(-1, self.m, self.n) for t in tensors]
        if out is None:
            return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].clone()
        return torch.cat(parts, dim=0, out=out)

    def views(self, stacked: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a (B, m, n) stack, shaped like the parameters."""
        return [
            stacked[s : s + c].view(p.shape) for p, s, c in zip(self.params, self.starts, self.counts, strict=True)
        ]


def matrix_view_shape(p: torch.Tensor, mode: str) -> tuple[int, int, int]:
    """(count, m, n) of a parameter seen as matrices.

    mode "stack": the last two dims are the matrix and leading dims stack (Muon: a 3-D parameter is a
    batch of matrices). mode "flatten": (shape[0], prod(rest)), one matrix (the orthogonal transform).
    """
    if mode == "stack":
        m, n = p.shape[-2], p.shape[-1]
        return p.numel() // (m * n) if m * n else 0, m, n
    if mode == "flatten":
        return 1, p.shape[0], p.numel() // p.shape[0] if p.shape[0] else 0
    raise ValueError(f"unknown matrix view mode {mode!r}")


def make_buckets(params: Sequence[torch.Tensor], mode: str, extra_key: tuple = ()) -> list[Bucket]:
    """Group matrix parameters (ndim >= 2) by matrix shape, dtype and device, keeping first-seen order."""
    groups: dict[tuple, list] = {}
    for p in params:
        count, m, n = matrix_view_shape(p, mode)
        key = (*extra_key, m, n, p.dtype, p.device)
        groups.setdefault(key, []).append((p, count))
    buckets = []
    for key, members in groups.items():
        m, n = key[-4], key[-3]
        buckets.append(Bucket(key, [p for p, _ in members], m, n, [c for _, c in members]))
    return buckets


class GraphRunner:
    """Captures `fn` (static buffers in, static buffers out) in a CUDA graph and replays it.

    `fn` may update state tensors in place (momentum); `state` lists them so that the warm-up runs that
    capture needs leave no trace: they are saved before and restored after.
    """

    def __init__(self, fn: Callable[[], object], state: Sequence[torch.Tensor], warmup: int = 2):
        self.fn = fn
        self.state = list(state)
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None

    def __call__(self):
        if self.graph is None:
            saved = [t.clone() for t in self.state]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs = self.fn()
            for t, s in zip(self.state, saved, strict=True):
                t.copy_(s)
            self.graph = graph
        self.graph.replay()
        return self.outputs
