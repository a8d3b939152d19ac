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

from .errors import OptimizerError


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


def uses_cuda_graph(name: str, cuda_graph: bool | None, device: torch.device) -> bool:
    """Whether optimizer `name` runs its stacked math in a GraphRunner: by default on CUDA, never elsewhere
    (there cuda_graph=True is an error)."""
    if device.type != "cuda":
        if cuda_graph:
            raise OptimizerError(f"{name}: cuda_graph=True needs CUDA parameters, got device {device}")
        return False
    return True if cuda_graph is None else bool(cuda_graph)


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


# ------------------------------------------------------------------ the group layout with merged classes


@dataclass
class Segment:
    """One same-shape bucket inside a group's flat buffer and its place in a padded class stack."""

    bucket: Bucket
    offset: int  # element offset of its (B, m, n) block in the flat buffer
    transpose: bool  # m > n: it is iterated as (n, m)
    cls: int = -1
    cls_offset: int = 0  # first matrix index inside the class stack

    @property
    def numel(self) -> int:
        return self.bucket.size * self.bucket.m * self.bucket.n

    @property
    def oriented(self) -> tuple[int, int]:
        b = self.bucket
        return (b.n, b.m) if self.transpose else (b.m, b.n)


@dataclass
class StackClass:
    """A padded (size, rows, cols) stack iterated as one batch; zero padding is exact for Newton-Schulz."""

    rows: int
    cols: int
    size: int = 0


def gram_flops(rows: int, cols: int, size: int) -> float:
    return 2.0 * size * rows * rows * cols


class StackPlan:
    """How a group's matrices are laid out: one flat buffer (parameter order by bucket), same-shape
    buckets as (B, m, n) views of it, and buckets merged into padded classes when the extra work of
    the padding (in Gram-matrix FLOPs) is at most `merge_flops` (0: one class per shape)."""

    def __init__(self, params, mode: str, merge_flops: float = 0.0):
        buckets = make_buckets(params, mode)
        self.segments: list[Segment] = []
        self.params: list[torch.Tensor] = []
        offset = 0
        for b in buckets:
            self.segments.append(Segment(b, offset, b.m > b.n))
            offset += b.size * b.m * b.n
            self.params.extend(b.params)
        self.numel = offset
        self.classes: list[StackClass] = []
        for seg in sorted(self.segments, key=lambda s: gram_flops(*s.oriented, s.bucket.size), reverse=True):
            r, c = seg.oriented
            alone = gram_flops(r, c, seg.bucket.size)
            best, best_extra = None, None
            for i, k in enumerate(self.classes):
                rows, cols = max(k.rows, r), max(k.cols, c)
                extra = gram_flops(rows, cols, k.size + seg.bucket.size) - gram_flops(k.rows, k.cols, k.size) - alone
                if extra <= merge_flops and (best_extra is None or extra < best_extra):
                    best, best_extra = i, extra
            if best is None:
                self.classes.append(StackClass(r, c))
                best = len(self.classes) - 1
            k = self.classes[best]
            k.rows, k.cols = max(k.rows, r), max(k.cols, c)
            seg.cls, seg.cls_offset = best, k.size
            k.size += seg.bucket.size

    def stack(self, flat: torch.Tensor, seg: Segment) -> torch.Tensor:
        b = seg.bucket
        return flat[seg.offset : seg.offset + seg.numel].view(b.size, b.m, b.n)

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer shaped like the parameters, in `self.params` order."""
        return [v for seg in self.segments for v in seg.bucket.views(self.stack(flat, seg))]

    def class_buffers(self, dtype: torch.dtype, device) -> list[torch.Tensor]:
        """Zeroed class stacks; the copies write only the data regions, so the padding stays zero."""
        return [torch.zeros(k.size, k.rows, k.cols, dtype=dtype, device=device) for k in self.classes]

    def scatter_to_classes(self, flat: torch.Tensor, buffers: list[torch.Tensor]) -> None:
        for seg in self.segments:
            src = self.stack(flat, seg)
            r, c = seg.oriented
            dst = buffers[seg.cls][seg.cls_offset : seg.cls_offset + seg.bucket.size, :r, :c]
            dst.copy_(src.mT if seg.transpose else src)

    def gather_from_classes(self, outs: list[torch.Tensor], flat_out: torch.Tensor, scales=None) -> None:
        """Write each segment's block of the class results, back in its own orientation, into flat_out
        (times scales[i] for segment i when given)."""
        for i, seg in enumerate(self.segments):
            r, c = seg.oriented
            src = outs[seg.cls][seg.cls_offset : seg.cls_offset + seg.bucket.size, :r, :c]
            if seg.transpose:
                src = src.mT
            dst = self.stack(flat_out, seg)
            scale = 1.0 if scales is None else scales[i]
            if scale == 1.0:
                dst.copy_(src)
            else:
                torch.mul(src, scale, out=dst)
