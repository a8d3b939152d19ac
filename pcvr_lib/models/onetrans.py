"""onetrans: one causal stream [sequence tokens ; NS tokens] with a pyramid over the sequence part.

- Sequence tokens: per domain, the newest `top_k` events after de-duplication (an event whose first
  feature id re-appears in a newer event is dropped), a learned separator after each domain; the
  domains are left-packed one after the other.
- NS tokens: grouped user / item fields (as in baseline) + the dense token(s), at the end of the stream.
- Each layer: pre-RMSNorm causal attention; sequence tokens share one QKV / output / FFN (4x), every NS
  token has its own (per-token weights). Pyramid (as the reference): after layer i only the newest
  k_i = S * (n_ns / S) ** ((i + 1) / layers) sequence tokens are kept (S = the stream's sequence slots,
  204 on the demo schema: 43 after the first layer, n_ns = 8 after the last); NS tokens always stay.
- Head (as the reference): [mean of the surviving sequence tokens, mean of the NS tokens] after a final
  RMSNorm -> MLP; its hidden layer is the returned embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch, SequenceBlock
from pcvr_lib.models.baseline import FieldGroupTokens
from pcvr_lib.models.common import FeatureEncoder, ModelConfig, PCVRModel, PerTokenLinear
from pcvr_lib.models.kernel_ops import RMSNorm, attention
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import masked_mean, pack_segments, trim_sequence


@dataclass
class OneTransConfig(ModelConfig):
    d_model: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    emb_hash_large: bool = True  # reference: onetrans hashes vocabularies above 1M (544.7M parameters)
    top_k: int = 50
    dedup_window: int = 200  # newest events searched for duplicates before taking the top_k
    user_ns_tokens: int = 5
    item_ns_tokens: int = 2
    ffn_hidden: int = 256
    head_hidden: int = 128


def dedup_tail(seq: SequenceBlock, k: int, window: int) -> SequenceBlock:
    """The newest k events of each row among the newest `window`, dropping an event when its first
    feature id (non-zero) appears again in a newer event; left-aligned, oldest first."""
    seq = trim_sequence(seq, max_len=window, tail=True)
    key = seq.values[:, 0, :].long()
    valid = seq.valid_mask()
    length = key.shape[1]
    newer = torch.triu(torch.ones(length, length, dtype=torch.bool, device=key.device), diagonal=1)
    same = (key[:, :, None] == key[:, None, :]) & valid[:, None, :] & newer[None] & (key[:, :, None] != 0)
    keep = valid & ~same.any(-1)
    rank_from_newest = keep.flip(-1).long().cumsum(-1).flip(-1)  # 1 = newest kept event
    keep = keep & (rank_from_newest <= k)
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[:, :k]
    n = keep.sum(-1)
    slot_valid = torch.arange(order.shape[1], device=key.device)[None] < n[:, None]
    values = seq.values.gather(2, order[:, None, :].expand(-1, seq.values.shape[1], -1)) * slot_valid[:, None]
    timestamps = seq.timestamps.gather(1, order) * slot_valid
    return SequenceBlock(values=values, timestamps=timestamps, lengths=n.to(seq.lengths.dtype))


def keep_newest(x: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last k valid tokens of each row of a left-aligned [B, S, d], left-aligned again."""
    w = lengths.clamp(max=k)
    pos = (lengths - w)[:, None] + torch.arange(min(k, x.shape[1]), device=x.device)[None]
    slot_valid = pos < lengths[:, None]
    pos = pos.clamp(max=x.shape[1] - 1)
    out = x.gather(1, pos[:, :, None].expand(-1, -1, x.shape[-1])) * slot_valid[:, :, None].to(x.dtype)
    return out, w


class OneTransLayer(nn.Module):
    def __init__(self, config: OneTransConfig, n_ns: int):
        super().__init__()
        d, h = config.d_model, config.ffn_hidden
        self.heads = config.num_heads
        self.backend = config.attention_backend
        self.norm1 = RMSNorm(d, backend=config.rms_norm_backend)
        self.norm2 = RMSNorm(d, backend=config.rms_norm_backend)
        self.seq_qkv = nn.Linear(d, 3 * d)
        self.seq_out = nn.Linear(d, d)
        self.seq_ffn = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, d))
        self.ns_qkv = PerTokenLinear(n_ns, d, 3 * d)
        self.ns_out = PerTokenLinear(n_ns, d, d)
        self.ns_up = PerTokenLinear(n_ns, d, h)
        self.ns_down = PerTokenLinear(n_ns, h, d)

    def forward(self, seq, n_seq, ns):
        b, s, d = seq.shape
        n_ns = ns.shape[1]
        qkv, total = pack_segments(
            [(self.seq_qkv(self.norm1(seq)), n_seq), (self.ns_qkv(self.norm1(ns)), torch.full_like(n_seq, n_ns))]
        )
        q, k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2) for t in qkv.chunk(3, -1))
        o = attention(q, k, v, key_lengths=total, causal=True, backend=self.backend)
        o = o.transpose(1, 2).reshape(b, -1, d)
        ns_pos = n_seq[:, None] + torch.arange(n_ns, device=seq.device)[None]
        ns = ns + self.ns_out(o.gather(1, ns_pos[:, :, None].expand(-1, -1, d)))
        ns = ns + self.ns_down(F.silu(self.ns_up(self.norm2(ns))))
        # sequence tokens come first in the stream, so they sit at the same positions as in `seq`
        o_seq = F.pad(o, (0, 0, 0, max(0, s - o.shape[1])))[:, :s]
        seq_valid = (torch.arange(s, device=seq.device)[None] < n_seq[:, None])[:, :, None].to(seq.dtype)
        seq = seq + self.seq_out(o_seq) * seq_valid
        seq = seq + self.seq_ffn(self.norm2(seq)) * seq_valid
        return seq, ns


@register("onetrans")
class OneTrans(PCVRModel):
    config_class = OneTransConfig
    cost_hint = 0.9  # CPU s per smoke train step / baseline's (notes/models.md)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: OneTransConfig = self.config
        d = c.d_model
        self.encoder = FeatureEncoder(schema, c)
        self.domains = self.encoder.domains
        self.user_tokens = FieldGroupTokens(len(schema.user_int), c.emb_dim, c.user_ns_tokens, d)
        self.item_tokens = FieldGroupTokens(len(schema.item_int), c.emb_dim, c.item_ns_tokens, d)
        n_ns = len(self.user_tokens.splits) + len(self.item_tokens.splits) + self.encoder.n_dense_tokens
        self.domain_embedding = nn.Parameter(torch.zeros(len(self.domains), d))
        self.separators = nn.Parameter(torch.randn(len(self.domains), d) * 0.02)
        self.layers = nn.ModuleList(OneTransLayer(c, n_ns) for _ in range(c.num_blocks))
        # pyramid: sequence tokens kept after each layer, geometric from the stream's slots down to n_ns
        slots = len(self.domains) * (c.top_k + 1)
        n = c.num_blocks
        self.keep = [max(1, round(slots * (n_ns / slots) ** ((i + 1) / n))) for i in range(n)]
        self.final_norm = RMSNorm(d, backend=c.rms_norm_backend)
        self.head = nn.Sequential(nn.Linear(2 * d, c.head_hidden), nn.SiLU())
        self.out = nn.Linear(c.head_hidden, 1)

    def predict(self, batch: Batch):
        c: OneTransConfig = self.config
        enc, emb = self.encoder, self.encoder.embeddings
        b = batch.batch_size
        segments = []
        for i, name in enumerate(self.domains):
            seq = dedup_tail(batch.sequences[name], c.top_k, c.dedup_window)
            tokens = enc.tokenizers[name](emb.sequence(seq, name), seq, batch.request_timestamp)
            segments.append((tokens + self.domain_embedding[i], seq.lengths.long()))
            sep = self.separators[i].expand(b, 1, -1)
            segments.append((sep, torch.ones(b, dtype=torch.long, device=sep.device)))
        seq, n_seq = pack_segments(segments)
        ns = torch.cat(
            [self.user_tokens(emb.fields(batch, "user")), self.item_tokens(emb.fields(batch, "item")),
             enc.dense_tokens(batch)],
            dim=1,
        )
        for layer, keep in zip(self.layers, self.keep, strict=True):
            seq, ns = layer(seq, n_seq, ns)
            seq, n_seq = keep_newest(seq, n_seq, keep)
        seq_valid = torch.arange(seq.shape[1], device=seq.device)[None] < n_seq[:, None]
        readout = torch.cat([masked_mean(self.final_norm(seq), seq_valid), self.final_norm(ns).mean(1)], dim=-1)
        embedding = self.head(readout)
        return self.out(embedding), embedding
