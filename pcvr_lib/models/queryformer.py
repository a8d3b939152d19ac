"""queryformer: C independent embedding columns, DCNv2 dense-field tokens, user/item co-attention and a
per-domain query bridge; every Linear / LayerNorm has per-column weights [C, ...] and attention runs on a
batch of B * C.

- Tables: each feature has C packed columns (1 + C * N rows: id v of column c at row c * N + v).
- User / item field tokens: per column the bag means (+ a per-column, per-feature missing embedding when
  the feature has no id), group means (7 user / 4 item runs of neighbouring fields) -> ColumnLinear ->
  ColumnLN: [B, C, 7, d] and [B, C, 4, d].
- User dense: one token per schema field: [signed log1p values, missing flags] -> ColumnLN -> DCNv2
  (`dcn_layers` x: x <- x0 * (W x + b) + x, full rank) -> ColumnLinear -> SiLU -> ColumnLN. User side
  [B, C, 7 + fields, d].
- Sequences: column lookups -> ColumnLinear -> SiLU -> ColumnLN + time-bucket embedding + sinusoidal
  positions, at full length; no sequence self-attention.
- Update(q, ctx) = q + O(attn(Q LN q, K LN ctx, V LN ctx)), then + FFN(LN) (4x SiLU).
- Co-blocks (x num_blocks): user and item self-attention, then user <- item and item <- user at once.
- Bridge per domain: q = sequence mean + item mean + offset -> Update over [user; item] -> Update over the
  sequence (key-length mask).
- Head: per column LN[user mean, item mean, mean of the domain queries] -> Linear -> SiLU -> LN; flatten ->
  LN -> Linear -> SiLU -> LN = the embedding; classifier LN -> 512 -> SiLU -> Dropout -> 1.

Decisions (notes/models.md): missing embeddings use one flag per feature (the reference's per-slot mask
was misaligned); dense values are scaled with a signed log1p before the DCN (the reference fed raw
values); a row whose domain has no event keeps its bridge query instead of attending to padding slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.common import ModelConfig, PCVRModel, embeddings_for
from pcvr_lib.models.kernel_ops import attention
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import NUM_TIME_BUCKETS, masked_mean, sinusoidal_positions, time_buckets, trim_sequence


@dataclass
class QueryFormerConfig(ModelConfig):
    d_model: int = 128
    emb_dim: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    dropout: float = 0.02
    emb_hash_large: bool = True
    columns: int = 4
    dcn_layers: int = 2
    user_ns_tokens: int = 7
    item_ns_tokens: int = 4
    ffn_mult: int = 4
    head_hidden: int = 512


class ColumnLinear(nn.Module):
    """A separate Linear(d_in, d_out) per column: [B, C, ..., d_in] -> [B, C, ..., d_out]."""

    def __init__(self, columns: int, d_in: int, d_out: int):
        super().__init__()
        bound = 1.0 / d_in ** 0.5
        self.weight = nn.Parameter(torch.empty(columns, d_in, d_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(columns, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = x.shape[:2]
        flat = x.reshape(b, c, -1, x.shape[-1]).transpose(0, 1)  # [C, B * ..., d_in]
        flat = flat.reshape(c, -1, x.shape[-1])
        out = torch.baddbmm(self.bias.to(x.dtype)[:, None], flat, self.weight.to(x.dtype))
        return out.view(c, b, *x.shape[2:-1], -1).transpose(0, 1)


class ColumnLayerNorm(nn.Module):
    def __init__(self, columns: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(columns, d))
        self.bias = nn.Parameter(torch.zeros(columns, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (x.shape[-1],)
        return F.layer_norm(x, x.shape[-1:]) * self.weight.view(shape) + self.bias.view(shape)


class Update(nn.Module):
    """q + O(attn(Q LN q, K LN ctx, V LN ctx)), then + FFN(LN); per-column weights."""

    def __init__(self, config: QueryFormerConfig):
        super().__init__()
        c, d = config.columns, config.d_model
        self.heads = config.num_heads
        self.backend = config.attention_backend
        self.q_norm, self.ctx_norm, self.ffn_norm = (ColumnLayerNorm(c, d) for _ in range(3))
        self.q, self.k, self.v, self.o = (ColumnLinear(c, d, d) for _ in range(4))
        self.up = ColumnLinear(c, d, config.ffn_mult * d)
        self.down = ColumnLinear(c, config.ffn_mult * d, d)
        self.dropout = nn.Dropout(config.dropout)

    def _heads(self, x):  # [B, C, T, d] -> [B * C, H, T, d / H]
        b, c, t, d = x.shape
        return x.reshape(b * c, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, q, ctx, key_lengths=None):
        b, c, t, d = q.shape
        h = self.q_norm(q)
        kv = self.ctx_norm(ctx)
        lengths = None if key_lengths is None else key_lengths.repeat_interleave(c)
        o = attention(self._heads(self.q(h)), self._heads(self.k(kv)), self._heads(self.v(kv)),
                      key_lengths=lengths, backend=self.backend)
        o = o.transpose(1, 2).reshape(b, c, t, d)
        q = q + self.dropout(self.o(o))
        return q + self.dropout(self.down(F.silu(self.up(self.ffn_norm(q)))))


class DenseFieldToken(nn.Module):
    def __init__(self, config: QueryFormerConfig, width: int):
        super().__init__()
        c, w = config.columns, 2 * width
        self.norm_in = ColumnLayerNorm(c, w)
        self.cross = nn.ModuleList(ColumnLinear(c, w, w) for _ in range(config.dcn_layers))
        self.proj = ColumnLinear(c, w, config.d_model)
        self.norm_out = ColumnLayerNorm(c, config.d_model)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:  # [B, C, 2w] -> [B, C, d]
        x0 = self.norm_in(x0)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.norm_out(F.silu(self.proj(x)))


def _group_assign(n: int, groups: int) -> torch.Tensor:
    parts = np.array_split(np.arange(n), max(1, min(groups, n)))
    assign = torch.zeros(len(parts), n)
    for g, idx in enumerate(parts):
        assign[g, torch.as_tensor(idx)] = 1.0 / len(idx)
    return assign


@register("queryformer")
class QueryFormer(PCVRModel):
    config_class = QueryFormerConfig
    cost_hint = 7.4  # CPU s per smoke train step / baseline's (notes/models.md)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        cfg: QueryFormerConfig = self.config
        c, d, e = cfg.columns, cfg.d_model, cfg.emb_dim
        self.embeddings = embeddings_for(schema, cfg, columns=c)
        self.domains = [dom.name for dom in schema.domains]
        self.missing = nn.ParameterDict({
            side: nn.Parameter(torch.randn(c, len(schema.int_group(side)), e) * 0.02) for side in ("user", "item")
        })
        for side, groups in (("user", cfg.user_ns_tokens), ("item", cfg.item_ns_tokens)):
            self.register_buffer(f"{side}_assign", _group_assign(len(schema.int_group(side)), groups),
                                 persistent=False)
        self.field_proj = nn.ModuleDict({side: ColumnLinear(c, e, d) for side in ("user", "item")})
        self.field_norm = nn.ModuleDict({side: ColumnLayerNorm(c, d) for side in ("user", "item")})
        self.dense_fields = list(schema.user_dense)
        self.dense = nn.ModuleList(DenseFieldToken(cfg, f.dim) for f in self.dense_fields)
        self.seq_proj = nn.ModuleDict({
            dom.name: ColumnLinear(c, len(dom.side_features) * e, d) for dom in schema.domains
        })
        self.seq_norm = nn.ModuleDict({dom.name: ColumnLayerNorm(c, d) for dom in schema.domains})
        self.time = nn.Embedding(NUM_TIME_BUCKETS, d)
        nn.init.normal_(self.time.weight, std=0.02)
        self.co_blocks = nn.ModuleList(
            nn.ModuleDict({name: Update(cfg) for name in ("user_self", "item_self", "user_cross", "item_cross")})
            for _ in range(cfg.num_blocks)
        )
        self.offsets = nn.ParameterDict({name: nn.Parameter(torch.randn(c, d) * 0.02) for name in self.domains})
        self.bridges = nn.ModuleDict({
            name: nn.ModuleDict({"fields": Update(cfg), "sequence": Update(cfg)}) for name in self.domains
        })
        self.column_head = nn.ModuleList([ColumnLayerNorm(c, 3 * d), ColumnLinear(c, 3 * d, d), ColumnLayerNorm(c, d)])
        self.merge = nn.Sequential(nn.LayerNorm(c * d), nn.Linear(c * d, d), nn.SiLU(), nn.LayerNorm(d))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.head_hidden), nn.SiLU(), nn.Dropout(cfg.dropout))
        self.out = nn.Linear(cfg.head_hidden, 1)

    def _fields(self, batch: Batch, side: str) -> torch.Tensor:
        fields = self.embeddings.fields(batch, side)  # [B, C, F, E]
        absent = (~self.embeddings.field_present(batch, side))[:, None, :, None].to(fields.dtype)
        fields = fields + absent * self.missing[side].to(fields.dtype)
        grouped = torch.einsum("gf,bcfe->bcge", getattr(self, f"{side}_assign").to(fields.dtype), fields)
        return self.field_norm[side](self.field_proj[side](grouped))

    def _dense(self, batch: Batch) -> torch.Tensor:
        values, missing = batch.user.dense_values, batch.user.dense_missing
        c = self.config.columns
        tokens = []
        for f, module in zip(self.dense_fields, self.dense, strict=True):
            v = values[:, f.offset:f.offset + f.dim]
            x = torch.cat([torch.sign(v) * torch.log1p(v.abs()), missing[:, f.offset:f.offset + f.dim].to(v.dtype)], -1)
            tokens.append(module(x[:, None].expand(-1, c, -1)))
        return torch.stack(tokens, 2)

    def _sequence(self, batch: Batch, name: str):
        seq = trim_sequence(batch.sequences[name])
        valid = seq.valid_mask()
        x = F.silu(self.seq_proj[name](self.embeddings.sequence(seq, name)))  # [B, C, L, d]
        x = self.seq_norm[name](x) + self.time(time_buckets(batch.request_timestamp, seq.timestamps, valid))[:, None]
        x = x + sinusoidal_positions(x.shape[2], x.shape[3], x.device, x.dtype)
        return x * valid[:, None, :, None].to(x.dtype), seq.lengths.long(), valid

    def predict(self, batch: Batch):
        user = torch.cat([self._fields(batch, "user"), self._dense(batch).to(self.missing["user"].dtype)], 2)
        item = self._fields(batch, "item")
        user = user.to(item.dtype)
        for blk in self.co_blocks:
            user = blk["user_self"](user, user)
            item = blk["item_self"](item, item)
            user, item = blk["user_cross"](user, item), blk["item_cross"](item, user)
        fields = torch.cat([user, item], 2)
        item_mean = item.mean(2)
        queries = []
        for name in self.domains:
            seq, lengths, valid = self._sequence(batch, name)
            seq_mean = masked_mean(seq, valid[:, None].expand(-1, seq.shape[1], -1), dim=2)
            q = (seq_mean + item_mean + self.offsets[name].to(seq.dtype))[:, :, None]  # [B, C, 1, d]
            q = self.bridges[name]["fields"](q, fields)
            attended = self.bridges[name]["sequence"](q, seq, key_lengths=lengths)
            queries.append(torch.where((lengths > 0)[:, None, None, None], attended, q))  # no events: keep q
        per_column = torch.cat([user.mean(2), item_mean, torch.cat(queries, 2).mean(2)], -1)
        norm_in, proj, norm_out = self.column_head
        per_column = norm_out(F.silu(proj(norm_in(per_column))))
        embedding = self.merge(per_column.flatten(1))
        return self.out(self.head(embedding)), embedding
