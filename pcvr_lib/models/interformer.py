"""interformer: NS tokens and per-domain sequences that inform each other block by block.

- NS tokens [B, 12, d]: 7 user and 4 item field groups (runs of neighbouring fields), each the mean of its
  fields' embeddings -> one shared Linear + LayerNorm per side; plus one dense token (user dense values).
  Order: user, dense, item.
- Sequences: per domain the common tokenizer at full length plus sinusoidal positions.
- Block (x num_blocks):
  1. CrossSummary: `summary_queries` learned queries attend over all domains at once (their valid events
     packed to the front: one key length per row); s = LN(sigmoid(MLP[q_1..q_n, r]) * mean(q_1..q_n, r))
     with r the mean over domains of each domain's newest token.
  2. [NS; s]: pre-LN self-attention, then pre-LN FFN (4x SiLU); s is then discarded.
  3. ctx = sigmoid(MLP(mean NS)) * mean NS.
  4. Per domain (weights shared by the domains): the personalised FFN p = x + FFN(x * sigmoid(W_g ctx) +
     W_b ctx), key-padded self-attention (block 0 prepends ctx as an always-valid token), post-LN
     u = LN(p + attn), out = u + FFN(LN u).
- Head: g = sigmoid(Linear[mean NS, final CrossSummary]); emb = g * mean NS + (1 - g) * summary;
  classifier LN -> 256 -> SiLU -> Dropout -> 1.

Decisions on the reference's quirks (notes/models.md): a row with no events anywhere gets a learned
"empty history" summary and a domain with no events a learned "empty" newest token instead of reading
padding slot 0; the reference's unused missing-value embeddings and its documented-but-ignored
`seq_top_k` are left out; features above the threshold are dropped as in the reference (config
`emb_hash_large` hashes them instead); the sequence path keeps the reference's post-LN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.common import DenseProjector, FeatureEncoder, ModelConfig, MultiHeadAttention, PCVRModel
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import gather_last, pack_segments, sinusoidal_positions


@dataclass
class InterFormerConfig(ModelConfig):
    d_model: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    dropout: float = 0.02
    user_ns_tokens: int = 7
    item_ns_tokens: int = 4
    summary_queries: int = 2
    ffn_mult: int = 4
    head_hidden: int = 256


def field_groups(n_fields: int, groups: int) -> list[torch.Tensor]:
    """Indices of `groups` runs of neighbouring fields."""
    return [torch.as_tensor(part) for part in np.array_split(np.arange(n_fields), max(1, min(groups, n_fields)))]


class GroupMeanTokens(nn.Module):
    """Field embeddings [B, F, E] -> one token per group: the mean of its fields, shared Linear + LN."""

    def __init__(self, n_fields: int, groups: int, emb_dim: int, d_model: int):
        super().__init__()
        self.groups = field_groups(n_fields, groups)
        assign = torch.zeros(len(self.groups), n_fields)
        for g, idx in enumerate(self.groups):
            assign[g, idx] = 1.0 / len(idx)
        self.register_buffer("assign", assign, persistent=False)
        self.proj = nn.Linear(emb_dim, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(torch.einsum("gf,bfe->bge", self.assign.to(fields.dtype), fields)))


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, d_out))


class CrossSummary(nn.Module):
    def __init__(self, config: InterFormerConfig):
        super().__init__()
        d, n = config.d_model, config.summary_queries
        self.queries = nn.Parameter(torch.randn(n, d) * 0.02)
        self.attn = MultiHeadAttention(d, config.num_heads, config)
        self.gate = mlp((n + 1) * d, d, d)
        self.norm = nn.LayerNorm(d)
        self.empty = nn.Parameter(torch.zeros(d))  # the summary of a row with no event in any domain

    def forward(self, keys: torch.Tensor, key_lengths: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
        """keys [B, S, d] (every domain's valid events, packed to the front), key_lengths [B],
        recent [B, d] -> s [B, d]."""
        b = keys.shape[0]
        has_any = key_lengths > 0
        # a row without keys sees key 0 (attention's length 0 counts as 1); its output is replaced below
        q = self.attn(self.queries.expand(b, -1, -1), context=keys, key_lengths=key_lengths)
        parts = torch.cat([q, recent[:, None]], dim=1)  # [B, n + 1, d]
        s = self.norm(torch.sigmoid(self.gate(parts.flatten(1))) * parts.mean(1))
        return torch.where(has_any[:, None], s, self.empty.to(s.dtype).expand_as(s))


class DomainSequenceBlock(nn.Module):
    """The per-domain half of a block (weights shared by the domains)."""

    def __init__(self, config: InterFormerConfig):
        super().__init__()
        d, h = config.d_model, config.ffn_mult * config.d_model
        self.ctx_gate = nn.Linear(d, d)
        self.ctx_bias = nn.Linear(d, d)
        self.personal = mlp(d, h, d)
        self.attn = MultiHeadAttention(d, config.num_heads, config)
        self.norm = nn.LayerNorm(d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = mlp(d, h, d)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, lengths, ctx, prepend: bool):
        valid = (torch.arange(x.shape[1], device=x.device)[None] < lengths[:, None])[..., None].to(x.dtype)
        p = x + self.personal(x * torch.sigmoid(self.ctx_gate(ctx))[:, None] + self.ctx_bias(ctx)[:, None])
        p = p * valid
        if prepend:  # ctx as an always-valid first token, dropped after the attention
            h = self.attn(torch.cat([ctx[:, None], p], 1), key_lengths=lengths + 1)[:, 1:]
        else:
            h = self.attn(p, key_lengths=lengths)
        u = self.norm(p + self.dropout(h))
        return (u + self.dropout(self.ffn(self.ffn_norm(u)))) * valid


class InterFormerBlock(nn.Module):
    def __init__(self, config: InterFormerConfig):
        super().__init__()
        d = config.d_model
        self.summary = CrossSummary(config)
        self.ns_norm = nn.LayerNorm(d)
        self.ns_attn = MultiHeadAttention(d, config.num_heads, config)
        self.ns_ffn_norm = nn.LayerNorm(d)
        self.ns_ffn = mlp(d, config.ffn_mult * d, d)
        self.ctx = mlp(d, d, d)
        self.seq = DomainSequenceBlock(config)
        self.dropout = nn.Dropout(config.dropout)


@register("interformer")
class InterFormer(PCVRModel):
    config_class = InterFormerConfig
    cost_hint = 1.5  # CPU s per smoke train step / baseline's (notes/models.md)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: InterFormerConfig = self.config
        d = c.d_model
        self.encoder = FeatureEncoder(schema, c, dense_tokens=False)
        self.domains = self.encoder.domains
        self.user_tokens = GroupMeanTokens(len(schema.user_int), c.user_ns_tokens, c.emb_dim, d)
        self.item_tokens = GroupMeanTokens(len(schema.item_int), c.item_ns_tokens, c.emb_dim, d)
        self.dense = DenseProjector(schema.dense_width("user"), d)
        self.empty_recent = nn.Parameter(torch.zeros(d))  # a domain's newest token when it has no event
        self.blocks = nn.ModuleList(InterFormerBlock(c) for _ in range(c.num_blocks))
        self.final_summary = CrossSummary(c)
        self.final_gate = nn.Linear(2 * d, d)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, c.head_hidden), nn.SiLU(), nn.Dropout(c.dropout))
        self.out = nn.Linear(c.head_hidden, 1)

    def _summary(self, summary: CrossSummary, seqs, lengths):
        # the domains' valid events packed to the front: a key-length mask (attention's kernels take it) in
        # place of a segmented one; the order of keys does not change attention without positions
        keys, key_lengths = pack_segments(list(zip(seqs, lengths, strict=True)))
        recent = torch.stack(
            [torch.where((n > 0)[:, None], gather_last(x, n), self.empty_recent.to(x.dtype))
             for x, n in zip(seqs, lengths, strict=True)],
            dim=0,
        ).mean(0)
        return summary(keys, key_lengths, recent)

    def predict(self, batch: Batch):
        emb = self.encoder.embeddings
        ns = torch.cat(
            [self.user_tokens(emb.fields(batch, "user")),
             self.dense(batch.user.dense_values, batch.user.dense_missing)[:, None],
             self.item_tokens(emb.fields(batch, "item"))],
            dim=1,
        )
        seqs, lengths = [], []
        for name in self.domains:
            tokens, n, _ = self.encoder.sequence_tokens(batch, name)
            valid = (torch.arange(tokens.shape[1], device=tokens.device)[None] < n[:, None])[..., None]
            pos = sinusoidal_positions(tokens.shape[1], tokens.shape[2], tokens.device, tokens.dtype)
            seqs.append((tokens + pos) * valid.to(tokens.dtype))
            lengths.append(n)
        for i, block in enumerate(self.blocks):
            s = self._summary(block.summary, seqs, lengths)
            x = torch.cat([ns, s[:, None]], dim=1)
            x = x + block.dropout(block.ns_attn(block.ns_norm(x)))
            x = x + block.dropout(block.ns_ffn(block.ns_ffn_norm(x)))
            ns = x[:, :-1]
            mean_ns = ns.mean(1)
            ctx = torch.sigmoid(block.ctx(mean_ns)) * mean_ns
            seqs = [block.seq(x_d, n, ctx, prepend=i == 0) for x_d, n in zip(seqs, lengths, strict=True)]
        ns_mean = ns.mean(1)
        seq = self._summary(self.final_summary, seqs, lengths)
        g = torch.sigmoid(self.final_gate(torch.cat([ns_mean, seq], dim=-1)))
        embedding = g * ns_mean + (1 - g) * seq
        return self.out(self.head(embedding)), embedding

