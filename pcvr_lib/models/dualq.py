"""dualq: user / item query generators over RankMixer NS tokens, one merged sequence, an FM highway.

- NS embeddings: per feature a table of width by vocabulary (<=4: 4, <=10: 8, <=50: 16, <=600: 32, else
  `emb_dim`), one sparse table per width; list features are masked means.
- Pair features (fids in both user int and user dense: 62-66, 89-91 on the demo schema): ids and dense
  values paired by position (matched by fid); SiLU(Linear[mean id emb, mean Linear(1 -> w)(dense), log1p
  count, max, min, std]) + sigmoid(g) * W (dense-weighted pool - mean pool) (W = 0, g = -4 at init; the
  weights are a softmax of the values for `softmax_pair_fids`, L1-normalised values otherwise).
- User NS: singles + pair vectors -> LHUC gate (x 2 sigmoid) -> `user_ns_tokens` chunks -> Linear + LN;
  item NS the same without LHUC. Dense: the `dense_token_fid` token, the `block_fid` token (blocks of
  `block_size` attention-pooled over the blocks with norm > 0.1, also added to the first) and a global time
  token (UTC+8 hour, weekday, weekend). User side: NS chunks + 2 dense + time = 17 tokens.
- Sequences: per event the side-feature embeddings (extra dropout on id features, vocab > `id_vocab`, in
  training) and an 8-value time branch -> Linear -> LN -> GELU, + per-domain gated time-bucket and
  gap-bucket embeddings; the domains are merged into one left-packed sequence.
- Time token: [request hour, mean over domains of 6 age statistics, any-event flag] -> LN -> MLP -> LN.
- Queries: user tokens cross-attend to [item; time] and item tokens to [user; time] (pre-LN, gated,
  residual); attention pools give `user_queries` + `item_queries` queries; FiLM from the age statistics.
- Blocks: sequence x + SwiGLU(LN x); queries -> sequence gated cross-attention; parameter-free RankMixer
  mixing, LN, 4x GELU FFN, residual, LN.
- Head: a time-decay summary of the sequence gated into the last query; emb = LN(Linear(flat queries));
  FM highway LN[user . item^T, seq mean . item^T]; classifier on [emb, FM] -> d -> LN -> SiLU -> 1.

Decisions (notes/models.md): the time token's hour slot is the request hour (the reference hard-wires 0);
the merged sequence is not sorted by age (nothing after the merge depends on order: a test checks that a
permutation of the events gives the same output); the gap feature is the gap to the next newer event (our
lists are oldest first); pair slices are matched by fid; rows without events skip the cross-attention
update explicitly instead of scrubbing NaNs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.common import (
    ModelConfig,
    MultiHeadAttention,
    PCVRModel,
    PerTokenLinear,
    RankMixerBlock,
    SwiGLU,
    embeddings_for,
    table_rows,
)
from pcvr_lib.models.kernel_ops import bag_mean
from pcvr_lib.models.registry import register
from pcvr_lib.models.sequences import NUM_TIME_BUCKETS, masked_mean, pack_segments, time_buckets, trim_sequence
from pcvr_lib.models.tables import SparseTable

UTC8 = 8 * 3600
DAY = 86400.0


@dataclass
class DualQConfig(ModelConfig):
    d_model: int = 192
    emb_dim: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    dropout: float = 0.02
    emb_hash_large: bool = True
    user_queries: int = 4
    item_queries: int = 2
    user_ns_tokens: int = 14
    item_ns_tokens: int = 3
    ffn_mult: int = 4
    id_vocab: int = 10_000  # sequence features above this vocabulary are "id" features
    id_dropout: float = 0.04
    softmax_pair_fids: str = "89,90,91"
    dense_token_fid: int = 61
    block_fid: int = 87
    block_size: int = 32

    def validate(self) -> None:
        super().validate()
        n = self.user_queries + self.item_queries
        if self.d_model % n:
            raise ValueError(f"model config d_model={self.d_model} must be divisible by the query count {n} "
                             "(RankMixer's parameter-free mixing)")


def ns_width(vocab: int, emb_dim: int) -> int:
    for limit, width in ((4, 4), (10, 8), (50, 16), (600, 32)):
        if vocab <= limit:
            return min(width, emb_dim)
    return emb_dim


class WidthTables(nn.Module):
    """One side's int features, each with its own width; one sparse table per width. `rows(int_values)`
    gives per feature its table rows and table."""

    def __init__(self, features, emb_dim: int, config: ModelConfig):
        super().__init__()
        self.features = features
        self.widths = [ns_width(f.vocab_size, emb_dim) for f in features]
        layout, rows = [], {}
        for feat, w in zip(features, self.widths, strict=True):
            n = table_rows(feat.vocab_size, config.emb_skip_threshold, config.emb_hash_large, config.vocab_cap)
            base = rows.get(w, 1)
            rows[w] = base + n
            layout.append((base if n else 0, max(n, 1)))
        self.tables = nn.ModuleDict()
        for w, n in sorted(rows.items()):
            table = SparseTable(n, w)
            nn.init.normal_(table.weight, std=0.05)
            with torch.no_grad():
                table.weight[0].zero_()
            self.tables[str(w)] = table
        self.layout = layout

    def rows(self, int_values: torch.Tensor) -> list[tuple[torch.Tensor, nn.Embedding]]:
        """Per feature (its table rows [B, dim], 0 where no id, its table)."""
        out = []
        for feat, w, (base, n) in zip(self.features, self.widths, self.layout, strict=True):
            ids = int_values[:, feat.offset:feat.offset + feat.dim].long()
            present = (ids > 0) & (base > 0)
            rows = torch.where(present, base + torch.remainder(ids - 1, n), torch.zeros_like(ids))
            out.append((rows, self.tables[str(w)]))
        return out


def signed_log(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log1p(x.abs())


class PairFeature(nn.Module):
    def __init__(self, width: int, softmax: bool, log_values: bool):
        super().__init__()
        self.softmax, self.log_values = softmax, log_values
        self.value = nn.Linear(1, width)
        self.proj = nn.Linear(2 * width + 4, width)
        self.residual = nn.Linear(width, width, bias=False)
        nn.init.zeros_(self.residual.weight)
        self.gate = nn.Parameter(torch.tensor(-4.0))

    def forward(self, emb, present, values, value_ok):
        x = signed_log(values) if self.log_values else values
        ok = value_ok & present
        okf = ok.to(emb.dtype)
        count = okf.sum(1, keepdim=True)
        mean_emb = masked_mean(emb, present)
        mean_val = masked_mean(self.value(x[..., None]), ok)
        big = torch.finfo(x.dtype).max
        vmax = torch.where(ok, x, torch.full_like(x, -big)).amax(1, keepdim=True)
        vmin = torch.where(ok, x, torch.full_like(x, big)).amin(1, keepdim=True)
        vmax, vmin = torch.where(count > 0, vmax, 0.0), torch.where(count > 0, vmin, 0.0)
        mu = (x * okf).sum(1, keepdim=True) / count.clamp(min=1)
        std = (((x - mu) ** 2 * okf).sum(1, keepdim=True) / count.clamp(min=1)).sqrt()
        feature = F.silu(self.proj(torch.cat([mean_emb, mean_val, torch.log1p(count), vmax, vmin, std], -1)))
        if self.softmax:
            weights = torch.softmax(x.masked_fill(~ok, -math.inf), dim=1).nan_to_num(0.0)
        else:
            weights = (x.abs() * okf) / (x.abs() * okf).sum(1, keepdim=True).clamp(min=1e-6)
        pooled = (weights[..., None] * emb).sum(1)
        return feature + torch.sigmoid(self.gate) * self.residual(pooled - mean_emb)


class ChunkTokens(nn.Module):
    """[B, W] -> n chunks of ceil(W / n) values (zero-padded), a Linear + LN per chunk."""

    def __init__(self, width: int, n: int, d: int):
        super().__init__()
        self.n, self.size = n, math.ceil(width / n)
        self.proj = PerTokenLinear(n, self.size, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = F.pad(x, (0, self.n * self.size - x.shape[-1])).view(x.shape[0], self.n, self.size)
        return self.norm(self.proj(x))


class GatedCross(nn.Module):
    """q + sigmoid(W_g q) * Attn(LN q, LN kv) with W_g = 0 and bias 1 at init."""

    def __init__(self, config: DualQConfig):
        super().__init__()
        d = config.d_model
        self.q_norm, self.kv_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = MultiHeadAttention(d, config.num_heads, config)
        self.gate = nn.Linear(d, d)
        nn.init.zeros_(self.gate.weight)
        nn.init.ones_(self.gate.bias)

    def forward(self, q, kv, **mask_args):
        return torch.sigmoid(self.gate(q)) * self.attn(self.q_norm(q), context=self.kv_norm(kv), **mask_args)


def age_stats(seq, request_ts) -> torch.Tensor:
    """[B, 6]: log1p min / mean / max age in hours, log1p counts within 15 min / 1 h / 1 day."""
    valid = seq.valid_mask()
    age = (request_ts[:, None] - seq.timestamps).clamp(min=0).double() / 3600.0
    n = valid.sum(1).clamp(min=1)
    big = torch.where(valid, age, torch.full_like(age, float("inf"))).amin(1)
    mn = torch.where(valid.any(1), big, torch.zeros_like(big))
    mean = (age * valid).sum(1) / n
    mx = (age * valid).amax(1)
    counts = [((age <= h) & valid).sum(1).double() for h in (0.25, 1.0, 24.0)]
    return torch.log1p(torch.stack([mn, mean, mx, *counts], -1)).float()


def event_time_values(seq, request_ts) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L, 8] time branch inputs and the gap to the next newer event (seconds) [B, L]: log1p age in
    days, age / the row's oldest age in this domain (the domain-scaled age, in [0, 1]), log1p age in
    hours, cos / sin of the event's UTC+8 hour and weekday, log1p gap in hours."""
    valid = seq.valid_mask()
    ts = seq.timestamps
    age = (request_ts[:, None] - ts).clamp(min=0).double() * valid
    scale = age.amax(1, keepdim=True).clamp(min=1.0)
    lengths = seq.lengths.long()
    newer = torch.cat([ts[:, 1:], ts[:, -1:]], 1)
    is_newest = torch.arange(ts.shape[1], device=ts.device)[None] == (lengths - 1)[:, None]
    newer = torch.where(is_newest, request_ts[:, None].expand_as(ts), newer)
    gap = (newer - ts).clamp(min=0).double() * valid
    local = ts + UTC8
    hour = (local % 86400).double() / 86400.0 * 2 * math.pi
    weekday = ((local // 86400 + 3) % 7).double() / 7.0 * 2 * math.pi  # 1970-01-01 was a Thursday
    values = torch.stack(
        [torch.log1p(age / DAY), age / scale, torch.log1p(age / 3600.0), hour.cos(), hour.sin(),
         weekday.cos(), weekday.sin(), torch.log1p(gap / 3600.0)], -1,
    )
    return (values * valid[..., None]).float(), gap


@register("dualq")
class DualQ(PCVRModel):
    config_class = DualQConfig
    cost_hint = 3.8  # CPU s per smoke train step / baseline's (notes/models.md)
    zero_gradient_at_init = ("pairs.*.gate",)  # sigmoid(g) * W(...) with W = 0 at init (as the reference)

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        c: DualQConfig = self.config
        d = c.d_model
        self.embeddings = embeddings_for(schema, c, sides=())  # sequence features; the fields have WidthTables
        self.domains = [dom.name for dom in schema.domains]
        dense_by_fid = {f.fid: f for f in schema.user_dense}
        softmax_fids = {int(v) for v in c.softmax_pair_fids.split(",") if v.strip()}
        self.user_tables = WidthTables(schema.user_int, c.emb_dim, c)
        self.item_tables = WidthTables(schema.item_int, c.emb_dim, c)
        self.pair_index = [i for i, f in enumerate(schema.user_int) if f.fid in dense_by_fid
                           and dense_by_fid[f.fid].dim == f.dim]
        self.pair_dense = [dense_by_fid[schema.user_int[i].fid] for i in self.pair_index]
        self.pairs = nn.ModuleList(
            PairFeature(self.user_tables.widths[i], schema.user_int[i].fid in softmax_fids,
                        schema.user_int[i].fid not in softmax_fids)
            for i in self.pair_index
        )
        user_width = sum(self.user_tables.widths)
        self.lhuc = nn.Sequential(nn.Linear(user_width, user_width // 4), nn.ReLU(),
                                  nn.Linear(user_width // 4, user_width))
        self.user_chunks = ChunkTokens(user_width, c.user_ns_tokens, d)
        self.item_chunks = ChunkTokens(sum(self.item_tables.widths), c.item_ns_tokens, d)
        used = {f.fid for f in self.pair_dense}
        self.dense_main = dense_by_fid.get(c.dense_token_fid)
        self.dense_blocks = dense_by_fid.get(c.block_fid)
        if self.dense_blocks is not None and self.dense_blocks.dim % c.block_size:
            raise ValueError(f"model config block_size={c.block_size} does not divide dense fid {c.block_fid}'s "
                             f"width {self.dense_blocks.dim}")
        used |= {f.fid for f in (self.dense_main, self.dense_blocks) if f is not None}
        self.dense_rest = [f for f in schema.user_dense if f.fid not in used]
        self.main_proj = nn.Sequential(nn.Linear(self.dense_main.dim, d), nn.LayerNorm(d)) if self.dense_main else None
        if self.dense_blocks is not None:
            self.block_score = nn.Linear(c.block_size, 1)
            self.block_proj = nn.Sequential(nn.Linear(c.block_size, d), nn.LayerNorm(d))
        rest_width = sum(f.dim for f in self.dense_rest)
        self.rest_proj = nn.Sequential(nn.Linear(2 * rest_width, d), nn.LayerNorm(d)) if rest_width else None
        self.hour_emb, self.weekday_emb, self.weekend_emb = nn.Embedding(24, d), nn.Embedding(7, d), nn.Embedding(2, d)
        # sequences
        e = c.emb_dim
        self.time_branch = nn.Sequential(nn.Linear(8, e), nn.LayerNorm(e))
        self.seq_proj = nn.ModuleDict({
            dom.name: nn.Sequential(nn.Linear((len(dom.side_features) + 1) * e, d), nn.LayerNorm(d), nn.GELU())
            for dom in schema.domains
        })
        for dom in schema.domains:
            keep = torch.tensor([f.vocab_size > c.id_vocab for f in dom.side_features])
            self.register_buffer(f"id_features_{dom.name}", keep, persistent=False)
        self.bucket_emb = nn.Embedding(NUM_TIME_BUCKETS, d)
        self.gap_emb = nn.Embedding(NUM_TIME_BUCKETS, d)
        self.bucket_gate = nn.Parameter(torch.ones(len(self.domains)))
        self.gap_gate = nn.Parameter(torch.ones(len(self.domains)))
        self.time_token = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, d), nn.SiLU(), nn.Linear(d, d), nn.LayerNorm(d))
        # queries
        self.user_cross, self.item_cross = GatedCross(c), GatedCross(c)
        self.user_pool, self.item_pool = nn.Linear(d, c.user_queries), nn.Linear(d, c.item_queries)
        self.film = nn.Linear(6, 2 * d)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        n_q = c.user_queries + c.item_queries
        h = c.ffn_mult * d
        self.blocks = nn.ModuleList(
            nn.ModuleDict({
                "seq_norm": nn.LayerNorm(d), "seq_ffn": SwiGLU(d, h), "cross": GatedCross(c),
                "mixer": RankMixerBlock(n_q, d, c.ffn_mult),
            })
            for _ in range(c.num_blocks)
        )
        self.dropout = nn.Dropout(c.dropout)
        self.decay = nn.Parameter(torch.tensor([1.0, 0.0]))  # alpha (age), beta (gap)
        self.decay_gate = nn.Linear(d, d)
        nn.init.constant_(self.decay_gate.bias, -3.0)
        self.emb_proj = nn.Sequential(nn.Linear(n_q * d, d), nn.LayerNorm(d))
        n_user_tokens = (c.user_ns_tokens + (self.main_proj is not None) + (self.dense_blocks is not None)
                         + (self.rest_proj is not None) + 1)  # + the global time token
        n_fm = (n_user_tokens + 1) * c.item_ns_tokens
        self.fm_norm = nn.LayerNorm(n_fm)
        self.head = nn.Sequential(nn.Linear(d + n_fm, d), nn.LayerNorm(d), nn.SiLU(), nn.Dropout(c.dropout))
        self.out = nn.Linear(d, 1)

    # ---------------------------------------------------------------------------------------- tokens
    def _ns(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        backend = self.config.embedding_backend
        user_rows = self.user_tables.rows(batch.user.int_values)
        pairs = {}
        for module, i, dense in zip(self.pairs, self.pair_index, self.pair_dense, strict=True):
            rows, table = user_rows[i]  # pair features weigh each slot by its value: no bag mean
            values = batch.user.dense_values[:, dense.offset:dense.offset + dense.dim]
            ok = ~batch.user.dense_missing[:, dense.offset:dense.offset + dense.dim]
            pairs[i] = module(table(rows), rows > 0, values, ok)
        user = torch.cat([pairs[i] if i in pairs else bag_mean(t, r, backend)
                          for i, (r, t) in enumerate(user_rows)], -1)
        user = user * 2 * torch.sigmoid(self.lhuc(user))
        item = torch.cat([bag_mean(t, r, backend) for r, t in self.item_tables.rows(batch.item.int_values)], -1)
        return self.user_chunks(user), self.item_chunks(item)

    def _dense_tokens(self, batch: Batch) -> torch.Tensor:
        c: DualQConfig = self.config
        values, missing = signed_log(batch.user.dense_values), batch.user.dense_missing
        b = values.shape[0]
        tokens = []
        main = None
        if self.dense_blocks is not None:
            f = self.dense_blocks
            blocks = values[:, f.offset:f.offset + f.dim].view(b, -1, c.block_size)
            ok = blocks.norm(dim=-1) > 0.1
            w = torch.softmax(self.block_score(blocks)[..., 0].masked_fill(~ok, -math.inf), 1).nan_to_num(0.0)
            main = F.silu(self.block_proj((w[..., None] * blocks).sum(1)))
        if self.main_proj is not None:
            f = self.dense_main
            token = F.silu(self.main_proj(values[:, f.offset:f.offset + f.dim]))
            tokens.append(token if main is None else token + main)
        if main is not None:
            tokens.append(main)
        if self.rest_proj is not None:
            idx = torch.cat([torch.arange(f.offset, f.offset + f.dim) for f in self.dense_rest]).to(values.device)
            tokens.append(F.silu(self.rest_proj(torch.cat([values[:, idx], missing[:, idx].to(values.dtype)], -1))))
        local = batch.request_timestamp + UTC8
        hour = (local % 86400) // 3600
        weekday = (local // 86400 + 3) % 7
        tokens.append(self.hour_emb(hour) + self.weekday_emb(weekday) + self.weekend_emb((weekday >= 5).long()))
        return torch.stack(tokens, 1)

    def _sequence(self, batch: Batch):
        c: DualQConfig = self.config
        emb = self.embeddings
        segments, ages, gaps, stats = [], [], [], []
        for i, name in enumerate(self.domains):
            seq = trim_sequence(batch.sequences[name])
            valid = seq.valid_mask()
            feats = emb.sequence(seq, name)  # [B, L, F * e]
            b, length, _ = feats.shape
            feats = feats.view(b, length, -1, c.emb_dim)
            if self.training and c.id_dropout > 0:
                ids = getattr(self, f"id_features_{name}")[None, None, :, None]
                feats = torch.where(ids, F.dropout(feats, c.id_dropout, True), feats)
            tv, gap = event_time_values(seq, batch.request_timestamp)
            x = torch.cat([feats.flatten(2), self.time_branch(tv)], -1)
            x = self.seq_proj[name](x)
            x = x + self.bucket_gate[i] * self.bucket_emb(time_buckets(batch.request_timestamp, seq.timestamps, valid))
            gap_bucket = time_buckets(torch.zeros_like(batch.request_timestamp), -gap.round().long(), valid)
            x = (x + self.gap_gate[i] * self.gap_emb(gap_bucket)) * valid[..., None].to(x.dtype)
            lengths = seq.lengths.long()
            segments.append((x, lengths))
            ages.append((tv[..., 0:1], lengths))
            gaps.append((tv[..., 7:8], lengths))
            stats.append(age_stats(seq, batch.request_timestamp))
        seq, total = pack_segments(segments)
        age, _ = pack_segments(ages)
        gap, _ = pack_segments(gaps)
        return seq, total, age[..., 0], gap[..., 0], torch.stack(stats, 0).mean(0)

    # --------------------------------------------------------------------------------------- forward
    def predict(self, batch: Batch):
        c: DualQConfig = self.config
        user_ns, item = self._ns(batch)
        user = torch.cat([user_ns, self._dense_tokens(batch).to(user_ns.dtype)], 1)
        seq, lengths, age, gap, stats = self._sequence(batch)
        has_events = lengths > 0
        local = batch.request_timestamp + UTC8
        hour = ((local % 86400) // 3600).float() / 23.0
        time = self.time_token(torch.cat([hour[:, None], stats, has_events.float()[:, None]], -1))[:, None]
        user_q = user + self.user_cross(user, torch.cat([item, time], 1))
        item_q = item + self.item_cross(item, torch.cat([user, time], 1))
        pool = [torch.softmax(p(t), dim=1).transpose(1, 2) @ t
                for p, t in ((self.user_pool, user_q), (self.item_pool, item_q))]
        q = torch.cat(pool, 1)
        gamma, beta = self.film(stats).chunk(2, -1)
        q = self.dropout(q * (1 + gamma[:, None]) + beta[:, None])
        valid = torch.arange(seq.shape[1], device=seq.device)[None] < lengths[:, None]
        keep = valid[..., None].to(seq.dtype)
        pre_block = seq
        seq = self.dropout(seq)
        for blk in self.blocks:
            seq = seq + blk["seq_ffn"](blk["seq_norm"](seq)) * keep
            q = q + blk["cross"](q, seq, key_lengths=lengths) * has_events[:, None, None].to(q.dtype)
            q = blk["mixer"](q)
        score = (-self.decay[0] * age - self.decay[1] * gap).masked_fill(~valid, -math.inf)
        weights = torch.softmax(score, 1).nan_to_num(0.0)  # a row without events: all zero
        summary = (weights[..., None] * pre_block).sum(1)
        last = q[:, -1] + torch.sigmoid(self.decay_gate(summary)) * summary
        q = torch.cat([q[:, :-1], last[:, None]], 1)
        embedding = self.emb_proj(q.flatten(1))
        seq_mean = masked_mean(pre_block, valid)
        fm = torch.cat([user @ item.transpose(1, 2), seq_mean[:, None] @ item.transpose(1, 2)], 1)
        fm = self.fm_norm(fm.flatten(1) / math.sqrt(c.d_model))
        return self.out(self.head(torch.cat([embedding, fm], -1))), embedding
