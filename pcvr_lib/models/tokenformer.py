"""tokenformer: one causal token stream with a target token at the end.

Stream (left-packed, padding after the last valid token):
    [user field tokens, user dense packets, SEP, newest `window` events of each domain, SEP,
     item field tokens, item dense packets, TARGET]
TARGET = a learned vector + Linear[user field mean, item field mean, their product] (as the reference).
Blocks: x += sigmoid(G(RMSNorm x)) * Attn(RMSNorm x) (QK-RMSNorm over the full width, RoPE), then
x += SwiGLU(RMSNorm x) (4x). The bottom half of the blocks attend causally over the whole stream, the top
half over sliding windows that start at `window` and halve per block (min 4), each query seeing keys at
distance <= w (as the reference); the target token attends to every valid token in every block.
Readout (as the reference): RMSNorm, then [TARGET, mean of the tokens before the item tokens, mean of the
item tokens] (the returned embedding) -> Linear -> SiLU -> 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.common import DenseProjector, FeatureEncoder, ModelConfig, MultiHeadAttention, PCVRModel, SwiGLU
from pcvr_lib.models.kernel_ops import RMSNorm, additive_mask, attention_mask
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import NUM_SEQ_STATS, masked_mean, pack_segments


@dataclass
class TokenFormerConfig(ModelConfig):
    d_model: int = 64
    num_blocks: int = 4
    num_heads: int = 4
    window: int = 64  # events per domain in the stream, and the sliding-window width of the top blocks
    dense_packet: int = 64  # dense values per dense packet token
    ffn_hidden: int = 256


class DensePackets(nn.Module):
    """Split a [B, W] dense block into ceil(W / P) packets of P values, one token each (shared
    projector + a per-packet position embedding)."""

    def __init__(self, width: int, packet: int, d_model: int):
        super().__init__()
        self.width, self.packet = width, packet
        self.n = math.ceil(width / packet)
        self.proj = DenseProjector(packet, d_model)
        self.position = nn.Parameter(torch.zeros(self.n, d_model))

    def forward(self, values: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        pad = self.n * self.packet - self.width
        values = F.pad(values, (0, pad)).view(values.shape[0], self.n, self.packet)
        missing = F.pad(missing, (0, pad), value=True).view(missing.shape[0], self.n, self.packet)
        return self.proj(values, missing) + self.position


class TokenFormerBlock(nn.Module):
    def __init__(self, config: TokenFormerConfig, window: int | None):
        super().__init__()
        d = config.d_model
        self.norm1 = RMSNorm(d, backend=config.rms_norm_backend)
        self.gate = nn.Linear(d, d)
        self.attn = MultiHeadAttention(d, config.num_heads, config, qk_norm=True, rope=True)
        self.norm2 = RMSNorm(d, backend=config.rms_norm_backend)
        self.ffn = SwiGLU(d, config.ffn_hidden)
        # keys at distance <= w: the mask's window counts the query itself, so w + 1 positions
        self.window = None if window is None else window + 1

    def forward(self, x, lengths, masks):
        h = self.norm1(x)
        attn = self.attn(h, key_lengths=lengths, causal=True, window=self.window, global_last=True,
                         mask=masks.get(self.window))
        x = x + torch.sigmoid(self.gate(h)) * attn
        return x + self.ffn(self.norm2(x))


@register("tokenformer")
class TokenFormer(PCVRModel):
    config_class = TokenFormerConfig
    cost_hint = 4.7  # CPU s per smoke train step / baseline's (notes/models.md)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: TokenFormerConfig = self.config
        d = c.d_model
        self.encoder = FeatureEncoder(schema, c, dense_tokens=False)
        self.domains = self.encoder.domains
        # field tokens: Linear -> LayerNorm (+ a field position), so that they enter the stream at the same
        # scale as the LayerNorm-ed sequence and dense tokens instead of the embeddings' small init scale
        self.user_field_proj = nn.Sequential(nn.Linear(c.emb_dim, d), nn.LayerNorm(d))
        self.user_field_pos = nn.Parameter(torch.zeros(len(schema.user_int), d))
        self.item_field_proj = nn.Sequential(nn.Linear(c.emb_dim, d), nn.LayerNorm(d))
        self.item_field_pos = nn.Parameter(torch.zeros(len(schema.item_int), d))
        user_dense_width = schema.dense_width("user") + NUM_SEQ_STATS * len(self.domains)
        self.user_packets = DensePackets(user_dense_width, c.dense_packet, d)
        item_width = schema.dense_width("item")
        self.item_packets = DensePackets(item_width, c.dense_packet, d) if item_width else None
        self.domain_embedding = nn.Parameter(torch.zeros(len(self.domains), d))
        self.special = nn.Parameter(torch.randn(3, d) * 0.02)  # SEP after user, SEP after sequences, TARGET
        self.target_proj = nn.Linear(3 * d, d)
        half = c.num_blocks // 2
        self.blocks = nn.ModuleList(
            TokenFormerBlock(c, None if i < half else max(4, c.window >> (i - half))) for i in range(c.num_blocks)
        )
        self.n_item = len(schema.item_int) + (self.item_packets.n if self.item_packets is not None else 0)
        self.final_norm = RMSNorm(d, backend=c.rms_norm_backend)
        self.head = nn.Sequential(nn.Linear(3 * d, d), nn.SiLU())
        self.out = nn.Linear(d, 1)

    def predict(self, batch: Batch):
        c: TokenFormerConfig = self.config
        emb = self.encoder.embeddings
        b = batch.batch_size
        device = batch.label.device

        def fixed(tokens):
            return tokens, torch.full((b,), tokens.shape[1], dtype=torch.long, device=device)

        def special(i):
            return fixed(self.special[i].expand(b, 1, -1))

        user = self.user_field_proj(emb.fields(batch, "user")) + self.user_field_pos
        item = self.item_field_proj(emb.fields(batch, "item")) + self.item_field_pos
        user_mean, item_mean = user.mean(1), item.mean(1)
        target_token = self.special[2] + self.target_proj(torch.cat([user_mean, item_mean, user_mean * item_mean], -1))
        dense_values, dense_missing = self.encoder.user_dense_inputs(batch)
        segments = [fixed(user), fixed(self.user_packets(dense_values, dense_missing)), special(0)]
        for i, name in enumerate(self.domains):
            tokens, n, _ = self.encoder.sequence_tokens(batch, name, max_len=c.window, tail=True)
            segments.append((tokens + self.domain_embedding[i], n))
        segments.append(special(1))
        segments.append(fixed(item))
        if self.item_packets is not None:
            segments.append(fixed(self.item_packets(batch.item.dense_values, batch.item.dense_missing)))
        segments.append(fixed(target_token[:, None]))
        x, lengths = pack_segments(segments)
        target = lengths - 1
        masks = {}  # one mask per window setting, shared by the blocks (torch backend)
        if c.attention_backend == "torch":
            for window in {block.window for block in self.blocks} - {None}:  # plain causal needs no mask
                masks[window] = additive_mask(
                    attention_mask(b, x.shape[1], x.shape[1], device, lengths, True, window, target)
                )
        for block in self.blocks:
            x = block(x, lengths, masks)
        x = self.final_norm(x)
        pos = torch.arange(x.shape[1], device=device)[None]
        item_start = (target - self.n_item)[:, None]
        context = masked_mean(x, pos < item_start)
        items = masked_mean(x, (pos >= item_start) & (pos < target[:, None]))
        target_out = x.gather(1, target[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]
        embedding = torch.cat([target_out, context, items], dim=-1)
        return self.out(self.head(embedding)), embedding
