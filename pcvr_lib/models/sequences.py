"""Time buckets and sequence helpers shared by the models: (request - event) time classes, per-domain
sequence statistics, trimming, sine/cosine positions, masked means, and packing left-aligned segments
into one stream."""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import torch

from pcvr_lib.data.batch import SequenceBlock

NUM_TIME_BUCKETS = 64  # 0 = padding, 1..63 = request - event time classes
TIME_BOUNDARIES_SEC = np.geomspace(5.0, 31_536_000.0, NUM_TIME_BUCKETS - 1)
NUM_SEQ_STATS = 6

_TIME_BOUNDARIES: dict[torch.device, torch.Tensor] = {}

_STATIC_LENGTHS = False


def static_lengths() -> bool:
    """True where sequences keep their full padded length instead of the batch's longest row: under
    torch.compile (no host read, one graph for every batch) and inside `at_static_lengths()` (an eager pass
    that must see the compiled graph's shapes, e.g. planning its table lookups). The tables' eager gradients
    keep their fixed size there too (models.tables)."""
    return _STATIC_LENGTHS or torch.compiler.is_compiling()


@contextlib.contextmanager
def at_static_lengths():
    global _STATIC_LENGTHS
    previous, _STATIC_LENGTHS = _STATIC_LENGTHS, True
    try:
        yield
    finally:
        _STATIC_LENGTHS = previous


def _time_boundaries(device: torch.device) -> torch.Tensor:
    """TIME_BOUNDARIES_SEC as an fp64 tensor on `device`, built once per device (on CUDA a fresh one
    would be a blocking host-to-device copy on every call, twice per domain per forward)."""
    boundaries = _TIME_BOUNDARIES.get(device)
    if boundaries is None:
        boundaries = torch.as_tensor(TIME_BOUNDARIES_SEC, dtype=torch.float64, device=device)
        _TIME_BOUNDARIES[device] = boundaries
    return boundaries


def time_buckets(request_ts: torch.Tensor, event_ts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bucket of (request - event) seconds: 63 log-spaced boundaries 5 s .. 1 year, searchsorted + 1
    capped at 63; padding positions get 0. request_ts [B], event_ts [B, L], valid [B, L] -> long [B, L]."""
    boundaries = _time_boundaries(event_ts.device)
    delta = (request_ts[:, None] - event_ts).to(torch.float64)
    bucket = (torch.searchsorted(boundaries, delta.contiguous()) + 1).clamp(max=NUM_TIME_BUCKETS - 1)
    return torch.where(valid, bucket, torch.zeros_like(bucket))


def sequence_stats(seq: SequenceBlock, request_ts: torch.Tensor) -> torch.Tensor:
    """Six per-row statistics of one domain, each scaled to about [0, 1]: length / max_len, active
    fraction (events with any non-zero feature), unique fraction (distinct first-feature ids among
    active events), duplicate ratio (1 - unique), non-zero fraction of all feature slots, and the
    time bucket of the newest event / 63. Returns float32 [B, 6]."""
    values, lengths = seq.values, seq.lengths.long()
    b, f, length = values.shape
    valid = seq.valid_mask()
    nonzero = (values != 0) & valid[:, None, :]
    active = nonzero.any(dim=1)
    n_active = active.sum(-1)
    # distinct ids of the first side feature among active events: sort, count value changes
    first = torch.where(active, values[:, 0, :].long(), torch.full_like(values[:, 0, :].long(), -1))
    ordered = first.sort(dim=-1).values
    changes = (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    unique = changes.sum(-1) + (ordered[:, 0] >= 0).long()
    unique = torch.where(n_active > 0, unique.clamp(min=1), torch.zeros_like(unique))
    newest = (lengths - 1).clamp(min=0)
    newest_ts = seq.timestamps.gather(1, newest[:, None])
    last_gap = time_buckets(request_ts, newest_ts, (lengths > 0)[:, None])[:, 0]
    active_f = n_active.float()
    unique_frac = unique.float() / active_f.clamp(min=1)
    stats = torch.stack(
        [
            lengths.float() / max(length, 1),
            active_f / lengths.float().clamp(min=1),
            unique_frac,
            torch.where(n_active > 0, 1.0 - unique_frac, torch.zeros_like(unique_frac)),
            nonzero.sum((1, 2)).float() / (lengths.float() * f).clamp(min=1),
            last_gap.float() / (NUM_TIME_BUCKETS - 1),
        ],
        dim=-1,
    )
    return stats


def trim_sequence(seq: SequenceBlock, max_len: int | None = None, tail: bool = False) -> SequenceBlock:
    """Drop positions no row uses (all rows shorter than L). With max_len and tail=True keep only the
    newest max_len events of each row, left-aligned (lengths capped)."""
    lengths = seq.lengths.long()
    if tail and max_len is not None and seq.max_len > max_len:
        # positions [len - w, len) of each row move to [0, w)
        w = lengths.clamp(max=max_len)
        start = (lengths - w)[:, None]
        pos = (start + torch.arange(max_len, device=lengths.device)[None]).clamp(max=seq.max_len - 1)
        keep = torch.arange(max_len, device=lengths.device)[None] < w[:, None]
        values = seq.values.gather(2, pos[:, None, :].expand(-1, seq.values.shape[1], -1))
        values = values * keep[:, None, :]
        timestamps = seq.timestamps.gather(1, pos) * keep
        return SequenceBlock(values=values, timestamps=timestamps, lengths=w.to(seq.lengths.dtype))
    # eager: trim to the batch's longest row (one host read); compiled (or planning a compiled step): keep the
    # static length (no sync, one graph for every batch; the padded positions are masked downstream)
    if static_lengths():
        used = seq.max_len
    else:
        used = int(lengths.max().item()) if lengths.numel() else 0
    used = max(used, 1)
    if max_len is not None:
        used = min(used, max_len)
    if used >= seq.max_len:
        return seq
    return SequenceBlock(
        values=seq.values[..., :used], timestamps=seq.timestamps[:, :used], lengths=seq.lengths.clamp(max=used)
    )


def sinusoidal_positions(length: int, d: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[length, d] sine/cosine positions (sin on the even, cos on the odd channels), counted from 0."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(length, d, device=device)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return table.to(dtype)


def masked_mean(x: torch.Tensor, valid: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Mean of x over `dim` where valid (bool, x's shape without the last dim); 0 where nothing is valid."""
    w = valid.to(x.dtype).unsqueeze(-1)
    return (x * w).sum(dim) / w.sum(dim).clamp(min=1)


def gather_last(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x[b, lengths[b] - 1] of a left-aligned [B, L, d] (slot 0 when the length is 0: callers replace
    those rows explicitly)."""
    index = (lengths.long() - 1).clamp(min=0)[:, None, None].expand(-1, 1, x.shape[-1])
    return x.gather(1, index)[:, 0]


def pack_segments(segments: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate left-aligned segments into one left-aligned stream.

    segments: (tokens [B, S_i, d], lengths [B]) each. Returns (stream [B, T, d], lengths [B]) where row b
    holds segment 0's first lengths_0[b] tokens, then segment 1's, ..., zeros past the total; T is the
    largest total in the batch (under torch.compile: the sum of the segments' sizes).
    """
    tokens = torch.cat([t for t, _ in segments], dim=1)
    b, _, d = tokens.shape
    device = tokens.device
    lengths = torch.stack([n.long() for _, n in segments], dim=1)  # [B, n_seg]
    # where each segment begins in `tokens`, filled in on the device (a tensor from a host list would be a
    # host-to-device copy, which a CUDA graph cannot hold)
    src_start = torch.zeros(len(segments), dtype=torch.long, device=device)
    for i, start in enumerate(itertools.accumulate(t.shape[1] for t, _ in segments[:-1]), start=1):
        src_start[i].fill_(start)
    dst_start = torch.cumsum(lengths, 1) - lengths  # where each segment begins in the stream
    total = lengths.sum(1)
    # T: the batch's largest total (one host read) eagerly; compiled, the static bound (every segment full)
    t_out = tokens.shape[1] if static_lengths() else max(int(total.max().item()), 1)
    pos = torch.arange(t_out, device=device)[None, :].expand(b, -1)
    # segment owning each output position: (number of segment starts <= pos) - 1. An empty segment
    # shares its start with the next one, and counting both picks the later one, the real owner.
    seg = ((dst_start[:, None, :] <= pos[:, :, None]).sum(-1) - 1).clamp(min=0)
    offset = pos - dst_start.gather(1, seg)
    src = src_start[seg] + offset
    valid = pos < total[:, None]
    src = torch.where(valid, src, torch.zeros_like(src))
    stream = tokens.gather(1, src[:, :, None].expand(-1, -1, d)) * valid[:, :, None].to(tokens.dtype)
    return stream, total
