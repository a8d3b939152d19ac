"""baseline (HyFormer): non-sequence tokens + per-domain sequence encoders + per-domain queries.

- NS tokens: the user int fields are split into `user_ns_tokens` groups of neighbouring features and the
  item fields into `item_ns_tokens` groups (RankMixer-style); each group's embeddings are flattened and
  projected to d_model; plus the dense token(s).
- Per domain: event tokens (common tokenizer) at full length (`max_seq_len` caps them), and
  `queries_per_domain` queries, each from its own 2-layer FFN on LN[flattened NS tokens, sequence mean].
- Each block, per domain: sequence self-attention (key-length mask), query -> sequence cross-attention
  whose output is gated by sigmoid(W_g q); then RankMixer over [all queries, NS tokens]: parameter-free
  token mixing, a shared 4x GELU FFN, post-LN (as the reference; d_model must divide by the token count).
- Head: MLP on the flattened queries; its hidden layer is the returned embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.common import (
    FeatureEncoder,
    FeedForward,
    ModelConfig,
    MultiHeadAttention,
    PCVRModel,
    RankMixerBlock,
)
from pcvr_lib.models.registry import register


@dataclass
class BaselineConfig(ModelConfig):
    d_model: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    queries_per_domain: int = 2
    user_ns_tokens: int = 5
    item_ns_tokens: int = 2
    max_seq_len: int | None = None  # newest events per domain the encoder sees (None: all, as the reference)
    query_hidden: int = 256
    head_hidden: int = 128

    def validate(self) -> None:
        super().validate()
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"model config max_seq_len must be an integer >= 1 or null, got {self.max_seq_len!r}")


class FieldGroupTokens(nn.Module):
    """Split [B, F, E] field embeddings into `groups` runs of neighbouring fields, one token each."""

    def __init__(self, n_fields: int, emb_dim: int, groups: int, d_model: int):
        super().__init__()
        groups = max(1, min(groups, n_fields))
        self.splits = [len(part) for part in np.array_split(np.arange(n_fields), groups)]
        self.proj = nn.ModuleList(nn.Linear(n * emb_dim, d_model) for n in self.splits)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        parts = fields.split(self.splits, dim=1)
        tokens = [proj(part.flatten(1)) for proj, part in zip(self.proj, parts, strict=True)]
        return self.norm(F.silu(torch.stack(tokens, dim=1)))


class DomainBlock(nn.Module):
    def __init__(self, config: BaselineConfig):
        super().__init__()
        d = config.d_model
        self.seq_norm = nn.LayerNorm(d)
        self.self_attn = MultiHeadAttention(d, config.num_heads, config)
        self.seq_ffn_norm = nn.LayerNorm(d)
        self.seq_ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
        self.query_norm = nn.LayerNorm(d)
        self.context_norm = nn.LayerNorm(d)
        self.cross_attn = MultiHeadAttention(d, config.num_heads, config)
        self.cross_gate = nn.Linear(d, d)

    def forward(self, seq, lengths, queries):
        seq = seq + self.self_attn(self.seq_norm(seq), key_lengths=lengths)
        seq = seq + self.seq_ffn(self.seq_ffn_norm(seq))
        q = self.query_norm(queries)
        update = self.cross_attn(q, context=self.context_norm(seq), key_lengths=lengths)
        # a row without events reads only padding: its queries keep their value
        has_events = (lengths > 0)[:, None, None].to(update.dtype)
        queries = queries + torch.sigmoid(self.cross_gate(q)) * update * has_events
        return seq, queries


@register("baseline")
class HyFormer(PCVRModel):
    config_class = BaselineConfig

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: BaselineConfig = self.config
        d = c.d_model
        self.encoder = FeatureEncoder(schema, c)
        self.domains = self.encoder.domains
        self.user_tokens = FieldGroupTokens(len(schema.user_int), c.emb_dim, c.user_ns_tokens, d)
        self.item_tokens = FieldGroupTokens(len(schema.item_int), c.emb_dim, c.item_ns_tokens, d)
        n_ns = len(self.user_tokens.splits) + len(self.item_tokens.splits) + self.encoder.n_dense_tokens
        q = c.queries_per_domain
        self.query_norm = nn.ModuleDict({name: nn.LayerNorm(n_ns * d + d) for name in self.domains})
        self.query_gen = nn.ModuleDict({
            name: nn.ModuleList(FeedForward(n_ns * d + d, c.query_hidden, d) for _ in range(q)) for name in self.domains
        })
        self.blocks = nn.ModuleList(
            nn.ModuleDict({name: DomainBlock(c) for name in self.domains}) for _ in range(c.num_blocks)
        )
        n_queries = q * len(self.domains)
        why = (f"queries_per_domain {q} x {len(self.domains)} domains + {n_ns} field tokens: user_ns_tokens, "
               "item_ns_tokens, dense")
        self.mixers = nn.ModuleList(RankMixerBlock(n_queries + n_ns, d, tokens_from=why) for _ in range(c.num_blocks))
        self.head = nn.Sequential(nn.LayerNorm(n_queries * d), nn.Linear(n_queries * d, c.head_hidden), nn.SiLU())
        self.out = nn.Linear(c.head_hidden, 1)

    def predict(self, batch: Batch):
        c: BaselineConfig = self.config
        emb = self.encoder.embeddings
        ns = torch.cat(
            [
                self.user_tokens(emb.fields(batch, "user")),
                self.item_tokens(emb.fields(batch, "item")),
                self.encoder.dense_tokens(batch),
            ],
            dim=1,
        )
        b, n_ns, d = ns.shape
        seqs, lengths, queries = {}, {}, {}
        for name in self.domains:
            tokens, n, _ = self.encoder.sequence_tokens(batch, name, max_len=c.max_seq_len, tail=True)
            mean = tokens.sum(1) / n.clamp(min=1)[:, None].to(tokens.dtype)
            seqs[name], lengths[name] = tokens, n
            context = self.query_norm[name](torch.cat([ns.flatten(1), mean], -1))
            queries[name] = torch.stack([gen(context) for gen in self.query_gen[name]], dim=1)
        for blocks, mixer in zip(self.blocks, self.mixers, strict=True):
            for name in self.domains:
                seqs[name], queries[name] = blocks[name](seqs[name], lengths[name], queries[name])
            mixed = mixer(torch.cat([*queries.values(), ns], dim=1))
            split = mixed.split([queries[name].shape[1] for name in self.domains] + [n_ns], dim=1)
            queries = dict(zip(self.domains, split[:-1], strict=True))
            ns = split[-1]
        embedding = self.head(torch.cat(list(queries.values()), dim=1).flatten(1))
        return self.out(embedding), embedding
