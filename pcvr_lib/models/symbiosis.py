"""symbiosis: one 110-token stream of every kind of token, a role-based attention mask, pre-RMSNorm blocks.

Stream [B, T, d] (T = 110 on the demo schema), in order:
    CLS | candidate (learned + mean of the item tokens) | user groups (7) | item groups (4) | dense chunks (3)
    | missing-flag chunks (user 2, item 1) | events per domain (memory + recent: 12/12/30/36) | stats (1)
- field tokens: per feature the bag mean + a per-feature missing embedding when the feature has no id,
  group means (runs of neighbouring fields) -> Linear + SiLU + LN (one per side);
- dense: [signed log1p values, missing flags] padded to a multiple of `dense_chunks`, one Linear + SiLU + LN
  per chunk; missing: the 0/1 slot flags (user int + dense, item int) in chunks, the same way;
- events: per domain the recent R slots and M "memory" events, one per equal bucket of the older prefix,
  each the argmax of 1.0 * non-zero fraction + 0.3 * (ts > 0) + 0.2 * pos / prefix - 0.5 * (same as the
  previous event); layout [memory; recent] -> sequence tokenizer + sinusoidal positions over the compact
  index; empty buckets and missing recent slots are padding;
- stats: 6 statistics per domain over the full list -> RMSNorm -> Linear -> SiLU -> LN.
Every token gets role + domain + risk embeddings. Training only: each high-risk token (item, dense, item
missing) is zeroed and made padding with probability `risk_dropout` per row.
Mask: CLS, candidate and stats see every token; field tokens all but events; events all but user and
dense tokens; keys must be valid; every token sees itself. Blocks (pre-RMSNorm): QK-RMSNorm over the full
width before the head split, attention, x += update * valid; x += SwiGLU(RMSNorm x) * valid; a final
RMSNorm. Head: RMSNorm[CLS, candidate, mean of valid tokens] (the embedding) -> 256 -> SiLU -> 1.

Decisions (notes/models.md): missing embeddings use one flag per feature (the reference took the first 46
columns of the per-slot mask, misaligned from fid 15 on); role / domain / risk tables are dense
parameters with a small init (the reference: sparse Adagrad, N(0, 1)); the candidate token keeps risk 0
as in the reference (it is the item summary the head reads; dropping it would blank the item for the head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch, SequenceBlock
from pcvr_lib.models.common import FeatureEncoder, ModelConfig, PCVRModel, PerTokenLinear, SwiGLU
from pcvr_lib.models.kernel_ops import RMSNorm, attention, role_attention_masks, static_role_words
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import masked_mean, sequence_stats, sinusoidal_positions, time_buckets

# roles
CLS, CANDIDATE, USER, ITEM, DENSE, MISSING, EVENT, STATS = range(8)


@dataclass
class SymbiosisConfig(ModelConfig):
    d_model: int = 256
    emb_dim: int = 256
    num_blocks: int = 4
    num_heads: int = 8
    dropout: float = 0.04
    emb_hash_large: bool = True  # NS hashed above 1M
    seq_emb_skip_threshold: int | None = 10_000  # sequence tables hashed above 10,000 rows
    ffn_hidden: int = 1024
    user_ns_tokens: int = 7
    item_ns_tokens: int = 4
    dense_chunks: int = 3
    user_missing_chunks: int = 2
    recent: str = "8,8,20,24"  # newest events kept per domain, in schema order
    memory: str = "4,4,10,12"  # memory buckets per domain
    risk_dropout: float = 0.08
    head_hidden: int = 256

    def validate(self) -> None:
        super().validate()
        for name in ("recent", "memory"):
            self.counts(name)
        if not 0.0 <= self.risk_dropout < 1.0:
            raise ValueError(f"model config risk_dropout must be in [0, 1), got {self.risk_dropout!r}")

    def counts(self, name: str) -> list[int]:
        text = getattr(self, name)
        try:
            values = [int(v) for v in str(text).split(",")]
        except ValueError:
            values = [-1]
        if any(v < 0 for v in values):
            raise ValueError(f"model config {name} must be comma-separated integers >= 0, got {text!r}")
        return values


def select_events(seq: SequenceBlock, recent: int, memory: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, memory + recent] of the selected events ([memory; recent], oldest first) and their
    validity. Lists are oldest first (the newest event at length - 1)."""
    values, lengths = seq.values, seq.lengths.long()
    b, f, length = values.shape
    device = values.device
    pos = torch.arange(length, device=device)[None]
    prefix = (lengths - recent).clamp(min=0)  # [B]
    r = torch.arange(recent, device=device)[None]
    recent_pos = lengths[:, None] - recent + r
    recent_valid = recent_pos >= 0
    if memory == 0:
        return recent_pos.clamp(min=0), recent_valid
    in_prefix = pos < prefix[:, None]
    # fp64 scores: near-ties (e.g. 2/3 + 0.3 + 0.2 * 2/12 vs 1.0) then resolve the same way everywhere
    nonzero = (values != 0).double().mean(1)  # [B, L]
    same_as_prev = torch.zeros(b, length, dtype=torch.bool, device=device)
    if length > 1:
        same_as_prev[:, 1:] = (values[:, :, 1:] == values[:, :, :-1]).all(1)
    score = (nonzero + 0.3 * (seq.timestamps > 0).double() + 0.2 * pos.double() / prefix.clamp(min=1)[:, None].double()
             - 0.5 * same_as_prev.double())
    m = torch.arange(memory + 1, device=device)[None]
    bounds = (m * prefix[:, None]) // memory  # [B, M + 1]: bucket m is [bounds[m], bounds[m + 1])
    # bucket of each prefix position: starts <= pos, minus one (coinciding starts belong to empty buckets)
    bucket = ((bounds[:, None, :memory] <= pos[:, :, None]).sum(-1) - 1).clamp(min=0)  # [B, L]
    score = torch.where(in_prefix, score, torch.full_like(score, -math.inf))
    best = torch.full((b, memory), -math.inf, dtype=score.dtype, device=device).scatter_reduce(1, bucket, score, "amax")
    is_best = in_prefix & (score == best.gather(1, bucket))
    first = torch.where(is_best, pos.expand(b, -1), torch.full_like(bucket, length))
    memory_pos = torch.full((b, memory), length, device=device).scatter_reduce(1, bucket, first, "amin")
    memory_valid = bounds[:, 1:] > bounds[:, :-1]
    positions = torch.cat([memory_pos.clamp(max=length - 1), recent_pos.clamp(min=0)], dim=1)
    return positions, torch.cat([memory_valid, recent_valid], dim=1)


def _chunks(width: int, n: int) -> int:
    return math.ceil(width / n)


@register("symbiosis")
class Symbiosis(PCVRModel):
    config_class = SymbiosisConfig
    cost_hint = 12.5  # CPU s per smoke train step / baseline's (notes/models.md)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: SymbiosisConfig = self.config
        d = c.d_model
        n_dom = len(schema.domains)
        self.recent, self.memory = c.counts("recent"), c.counts("memory")
        if len(self.recent) != n_dom or len(self.memory) != n_dom:
            raise ValueError(f"model config recent / memory need one value per domain ({n_dom}), got "
                             f"{c.recent} / {c.memory}")
        self.encoder = FeatureEncoder(schema, c, dense_tokens=False)
        self.domains = self.encoder.domains
        self.cls = nn.Parameter(torch.randn(d) * 0.02)
        self.candidate = nn.Parameter(torch.randn(d) * 0.02)
        self.field_missing = nn.ParameterDict({
            side: nn.Parameter(torch.randn(len(schema.int_group(side)), c.emb_dim) * 0.02) for side in ("user", "item")
        })
        for side, n_groups in (("user", c.user_ns_tokens), ("item", c.item_ns_tokens)):
            n = len(schema.int_group(side))
            parts = np.array_split(np.arange(n), max(1, min(n_groups, n)))
            assign = torch.zeros(len(parts), n)
            for g, idx in enumerate(parts):
                assign[g, torch.as_tensor(idx)] = 1.0 / len(idx)
            self.register_buffer(f"{side}_assign", assign, persistent=False)
        self.field_proj = nn.ModuleDict({side: nn.Linear(c.emb_dim, d) for side in ("user", "item")})
        self.field_norm = nn.ModuleDict({side: nn.LayerNorm(d) for side in ("user", "item")})
        dense_width = 2 * schema.dense_width("user")
        self.dense_chunk = _chunks(dense_width, c.dense_chunks)
        self.dense_proj = PerTokenLinear(c.dense_chunks, self.dense_chunk, d)
        user_flags = schema.int_width("user") + schema.dense_width("user")
        self.missing_chunk = _chunks(user_flags, c.user_missing_chunks)
        self.user_missing_proj = PerTokenLinear(c.user_missing_chunks, self.missing_chunk, d)
        self.item_missing_proj = nn.Linear(schema.int_width("item") + schema.dense_width("item"), d)
        self.chunk_norm = nn.LayerNorm(d)
        self.stats_norm = RMSNorm(6 * n_dom, backend=c.rms_norm_backend)
        self.stats_proj = nn.Linear(6 * n_dom, d)
        self.stats_ln = nn.LayerNorm(d)
        # static layout: role, domain and risk of every position
        n_user, n_item = self.user_assign.shape[0], self.item_assign.shape[0]
        roles = ([CLS, CANDIDATE] + [USER] * n_user + [ITEM] * n_item + [DENSE] * c.dense_chunks
                 + [MISSING] * (c.user_missing_chunks + 1))
        risk = [0, 0] + [0] * n_user + [1] * n_item + [1] * c.dense_chunks + [0] * c.user_missing_chunks + [1]
        domain = [0] * len(roles)
        self.event_start = len(roles)
        for i in range(n_dom):
            k = self.recent[i] + self.memory[i]
            roles += [EVENT] * k
            risk += [0] * k
            domain += [i + 1] * k
        roles.append(STATS)
        risk.append(0)
        domain.append(0)
        self.n_tokens = len(roles)
        self.register_buffer("roles", torch.tensor(roles), persistent=False)
        self.register_buffer("risk", torch.tensor(risk, dtype=torch.bool), persistent=False)
        self.register_buffer("domain_ids", torch.tensor(domain), persistent=False)
        self.role_emb = nn.Parameter(torch.randn(8, d) * 0.02)
        self.domain_emb = nn.Parameter(torch.randn(n_dom + 1, d) * 0.02)
        self.risk_emb = nn.Parameter(torch.randn(2, d) * 0.02)
        # the rule [query role, key role], built on the CPU: the kernels' words are packed from it here (a host
        # read, which a meta or CUDA build could not do cheaply); each buffer goes where the module is built
        sees = torch.ones(8, 8, dtype=torch.bool, device="cpu")
        for field in (USER, ITEM, DENSE, MISSING):
            sees[field, EVENT] = False
        sees[EVENT, USER] = sees[EVENT, DENSE] = False
        layout, here = torch.tensor(roles, device="cpu"), self.roles.device
        self.register_buffer("role_visibility", sees.to(here), persistent=False)
        self.register_buffer("role_pairs", sees[layout][:, layout].to(here), persistent=False)  # [T, T]
        self.register_buffer("role_words", static_role_words(layout, sees).to(here), persistent=False)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "norm1": RMSNorm(d, backend=c.rms_norm_backend), "qkv": nn.Linear(d, 3 * d),
                "q_norm": RMSNorm(d, backend=c.rms_norm_backend), "k_norm": RMSNorm(d, backend=c.rms_norm_backend),
                "out": nn.Linear(d, d), "norm2": RMSNorm(d, backend=c.rms_norm_backend),
                "ffn": SwiGLU(d, c.ffn_hidden),
            })
            for _ in range(c.num_blocks)
        )
        self.final_norm = RMSNorm(d, backend=c.rms_norm_backend)
        self.head_norm = RMSNorm(3 * d, backend=c.rms_norm_backend)
        self.head = nn.Sequential(nn.Linear(3 * d, c.head_hidden), nn.SiLU(), nn.Dropout(c.dropout))
        self.out = nn.Linear(c.head_hidden, 1)

    def _field_tokens(self, batch: Batch, side: str) -> torch.Tensor:
        emb = self.encoder.embeddings
        fields = emb.fields(batch, side)
        absent = ~emb.field_present(batch, side)
        fields = fields + absent[..., None].to(fields.dtype) * self.field_missing[side].to(fields.dtype)
        grouped = torch.einsum("gf,bfe->bge", getattr(self, f"{side}_assign").to(fields.dtype), fields)
        return self.field_norm[side](F.silu(self.field_proj[side](grouped)))

    def _chunked(self, proj: PerTokenLinear, x: torch.Tensor, n: int, size: int) -> torch.Tensor:
        x = F.pad(x, (0, n * size - x.shape[-1])).view(x.shape[0], n, size)
        return self.chunk_norm(F.silu(proj(x)))

    def _events(self, batch: Batch, i: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        seq = batch.sequences[name]
        positions, valid = select_events(seq, self.recent[i], self.memory[i])
        values = seq.values.gather(2, positions[:, None, :].expand(-1, seq.values.shape[1], -1))
        values = values * valid[:, None, :].to(values.dtype)
        timestamps = seq.timestamps.gather(1, positions) * valid
        tok = self.encoder.tokenizers[name]
        emb = self.encoder.embeddings.sequence(SequenceBlock(values, timestamps, seq.lengths), name)
        tokens = tok.norm(F.silu(tok.proj(emb))) + tok.time(time_buckets(batch.request_timestamp, timestamps, valid))
        tokens = tokens + sinusoidal_positions(tokens.shape[1], tokens.shape[2], tokens.device, tokens.dtype)
        return tokens * valid[..., None].to(tokens.dtype), valid

    def predict(self, batch: Batch):
        c: SymbiosisConfig = self.config
        b = batch.batch_size
        device = batch.label.device
        user = self._field_tokens(batch, "user")
        item = self._field_tokens(batch, "item")
        dense_values = batch.user.dense_values
        dense_in = torch.cat([torch.sign(dense_values) * torch.log1p(dense_values.abs()),
                              batch.user.dense_missing.to(dense_values.dtype)], dim=-1)
        user_flags = torch.cat([batch.user.int_missing, batch.user.dense_missing], dim=-1).to(dense_values.dtype)
        item_flags = torch.cat([batch.item.int_missing, batch.item.dense_missing], dim=-1).to(dense_values.dtype)
        events, event_valid = zip(*(self._events(batch, i, name) for i, name in enumerate(self.domains)),
                                  strict=True)
        stats = torch.cat([sequence_stats(batch.sequences[name], batch.request_timestamp) for name in self.domains], -1)
        parts = [
            self.cls.expand(b, 1, -1), (self.candidate + item.mean(1))[:, None], user, item,
            self._chunked(self.dense_proj, dense_in, c.dense_chunks, self.dense_chunk),
            self._chunked(self.user_missing_proj, user_flags, c.user_missing_chunks, self.missing_chunk),
            self.chunk_norm(F.silu(self.item_missing_proj(item_flags)))[:, None],
            *events,
            self.stats_ln(F.silu(self.stats_proj(self.stats_norm(stats))))[:, None],
        ]
        x = torch.cat([p.to(user.dtype) for p in parts], dim=1)
        valid = torch.ones(b, self.n_tokens, dtype=torch.bool, device=device)
        valid[:, self.event_start:self.event_start + sum(e.shape[1] for e in events)] = torch.cat(event_valid, 1)
        if self.training and c.risk_dropout > 0:
            dropped = (torch.rand(b, self.n_tokens, device=device) < c.risk_dropout) & self.risk
            x = x * (~dropped)[..., None].to(x.dtype)
            valid = valid & ~dropped
        x = x + self.role_emb[self.roles] + self.domain_emb[self.domain_ids] + self.risk_emb[self.risk.long()]
        masks = role_attention_masks(self.roles, self.role_visibility, self.role_pairs, valid, c.attention_backend,
                                     x.dtype, self.role_words)  # built once for all blocks
        keep = valid[..., None].to(x.dtype)
        heads, hd = c.num_heads, c.d_model // c.num_heads
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).chunk(3, dim=-1)
            q, k = blk["q_norm"](q), blk["k_norm"](k)
            q, k, v = (t.view(b, -1, heads, hd).transpose(1, 2) for t in (q, k, v))
            o = attention(q, k, v, backend=c.attention_backend, **masks)
            x = x + blk["out"](o.transpose(1, 2).reshape(b, -1, c.d_model)) * keep
            x = x + blk["ffn"](blk["norm2"](x)) * keep
        x = self.final_norm(x)
        embedding = self.head_norm(torch.cat([x[:, 0], x[:, 1], masked_mean(x, valid)], dim=-1))
        return self.out(self.head(embedding)), embedding
