"""Shared model building blocks: the model config and contract, attention / feed-forward / mixing layers,
bounded embedding tables, the sequence tokenizer, the dense projector and the feature encoder. Time buckets
and sequence helpers are in `sequences`; the operator call sites (attention, norms, embedding bags, each on
its backend) in `kernel_ops`.

Every model takes a `pcvr_lib.data.batch.Batch` and returns logits [B, 1]. Embedding tables are the
"sparse" parameters (sparse gradients, Adagrad); everything else is "dense" (AdamW).

Embedding layout: one `nn.Embedding` holds every feature's table back to back. Row 0 is the shared
padding row (always zero, never updated); feature f owns rows [base_f, base_f + n_f). An id i > 0 maps
to row base_f + ((i - 1) mod n_f). As in the reference, a vocabulary above `emb_skip_threshold` is either
dropped (every id reads the zero padding row) or, with `emb_hash_large`, hashed to N = threshold rows
(`id -> ((id-1) mod N) + 1`); otherwise n_f = vocab_f - 1 (the identity). `vocab_cap` is the CPU smoke's
reduction on top of that: no table keeps more than `vocab_cap` rows (hashing), so the tables stay bounded
on a 2-core machine while widths and depths keep the reference's defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pcvr_lib.data.batch import Batch, SequenceBlock
from pcvr_lib.models.kernel_ops import RMSNorm, attention, field_means
from pcvr_lib.models.sequences import NUM_SEQ_STATS, NUM_TIME_BUCKETS, sequence_stats, time_buckets, trim_sequence
from pcvr_lib.models.tables import SparseTable
from pcvr_lib.schema import Schema

BACKENDS = ("torch", "triton", "tilelang")
BACKEND_OPTIONS = ("attention_backend", "rms_norm_backend", "embedding_backend")  # model options naming one


# --------------------------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    """Fields shared by every model; each model's config subclasses this with its own defaults."""

    d_model: int = 64
    num_blocks: int = 2
    num_heads: int = 4
    emb_dim: int = 64  # width of each feature embedding before projection to d_model (reference: 64)
    emb_skip_threshold: int = 1_000_000  # vocabularies above this are dropped, or hashed with emb_hash_large
    emb_hash_large: bool = False  # hash vocabularies above the threshold to `threshold` rows instead of dropping
    seq_emb_skip_threshold: int | None = None  # the sequence features' own threshold (None: the same)
    vocab_cap: int | None = None  # smoke reduction: at most this many rows per feature table (hashed)
    dropout: float = 0.0
    # operator backends (torch / triton / tilelang): attention; RMSNorm and LayerNorm (one norm family);
    # the embedding-bag mean of the multi-valued sparse fields
    attention_backend: str = "torch"
    rms_norm_backend: str = "torch"
    embedding_backend: str = "torch"

    def validate(self) -> None:
        for name in ("d_model", "num_blocks", "num_heads", "emb_dim", "emb_skip_threshold", "vocab_cap",
                     "seq_emb_skip_threshold"):
            value = getattr(self, name)
            if value is None and name in ("vocab_cap", "seq_emb_skip_threshold"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.emb_hash_large, bool):
            raise ValueError(f"model config emb_hash_large must be true or false, got {self.emb_hash_large!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"model config d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"model config head width d_model/num_heads={self.d_model // self.num_heads} must be even")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model config dropout must be in [0, 1), got {self.dropout!r}")
        for name in BACKEND_OPTIONS:
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"model config {name} must be one of {BACKENDS}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> ModelConfig:
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown option(s) {unknown}; known: {sorted(known)}")
        config = cls(**values)
        config.validate()
        return config


# ---------------------------------------------------------------------------------------------- layers
class MultiHeadAttention(nn.Module):
    """Projections + `attention()`; optional QK-RMSNorm and rotary positions (for TokenFormer)."""

    def __init__(self, d_model: int, num_heads: int, config: ModelConfig, qk_norm: bool = False, rope: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.backend = config.attention_backend
        # QK-RMSNorm over the full width, before the head split (as the reference's TokenFormer)
        self.q_norm = RMSNorm(d_model, backend=config.rms_norm_backend) if qk_norm else None
        self.k_norm = RMSNorm(d_model, backend=config.rms_norm_backend) if qk_norm else None
        self.rope = rope

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, **mask_args) -> torch.Tensor:
        context = x if context is None else context
        q = self.q(x)
        k, v = self.kv(context).chunk(2, dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if self.rope:
            q, k = apply_rope(q), apply_rope(k)
        o = attention(q, k, v, backend=self.backend, **mask_args)
        b, _, s, _ = o.shape
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_tables(s: int, d: int, device: torch.device, dtype: torch.dtype, base: float):
    key = (s, d, str(device), dtype, base)
    tables = _ROPE_TABLES.get(key)
    if tables is None:
        if len(_ROPE_TABLES) > 64:
            _ROPE_TABLES.clear()
        inv_freq = base ** (-torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)
        angles = torch.arange(s, device=device, dtype=torch.float64)[:, None] * inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: pairs (i, i + d/2)
        tables = (angles.cos().to(dtype), angles.sin().to(dtype))
        _ROPE_TABLES[key] = tables
    return tables


def apply_rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding over the sequence dim of (B, H, S, D), D even (rotate-half pairing);
    the cos/sin tables are built once per (S, D, device, dtype)."""
    s, d = x.shape[-2], x.shape[-1]
    cos, sin = _rope_tables(s, d, x.device, x.dtype, base)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FeedForward(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, d_out or d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def rank_mix(x: torch.Tensor) -> torch.Tensor:
    """RankMixer's parameter-free token mixing: [B, T, d] viewed as [B, T, T, d / T], the two token axes
    swapped, so output token i holds chunk i of every input token (needs d % T == 0)."""
    b, t, d = x.shape
    return x.view(b, t, t, d // t).transpose(1, 2).reshape(b, t, d)


class RankMixerBlock(nn.Module):
    """y = LN(x + FFN(LN(rank_mix(x)))) with one shared 4x GELU FFN (the reference's RankMixer)."""

    def __init__(self, tokens: int, d_model: int, ffn_mult: int = 4, tokens_from: str = ""):
        super().__init__()
        if d_model % tokens:
            low, high = d_model // tokens * tokens, (d_model // tokens + 1) * tokens
            nearest = f"{low} or {high}" if low else str(high)
            raise ValueError(
                f"RankMixer mixes {tokens} tokens{f' ({tokens_from})' if tokens_from else ''}, so model option d_model "
                f"must be a multiple of {tokens}, got {d_model}: pass --model-config '{{\"d_model\": {high}}}' "
                f"(the nearest multiples: {nearest})")
        self.norm = nn.LayerNorm(d_model)
        hidden = ffn_mult * d_model
        self.ffn = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model))
        self.out_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(x + self.ffn(self.norm(rank_mix(x))))


class PerTokenLinear(nn.Module):
    """A separate Linear(d_in, d_out) for each of T token slots: [B, T, d_in] -> [B, T, d_out]."""

    def __init__(self, tokens: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(tokens, d_in, d_out) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.zeros(tokens, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btd,tde->bte", x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)

# ---------------------------------------------------------------------------------------- embeddings
def table_rows(vocab: int, threshold: int, hash_large: bool, cap: int | None) -> int:
    """Rows a feature of vocabulary `vocab` owns (0 = dropped: every id reads the zero padding row)."""
    n = max(vocab - 1, 1)
    if vocab > threshold:
        if not hash_large:
            return 0
        n = threshold
    return n if cap is None else min(n, cap)


class FeatureEmbeddings(nn.Module):
    """Every int feature's table (user, item, each domain's side features) in one sparse nn.Embedding.

    threshold / hash_large: the reference's `emb_skip_threshold` (vocabularies above it dropped, or hashed
    to `threshold` rows); seq_threshold: the sequence features' own threshold; vocab_cap: the smoke's bound
    on any table. columns: C independent tables per feature (QueryFormer's packed columns: feature f owns
    C * n_f rows, column c at base_f + c * n_f); the lookups then return a column axis.
    """

    def __init__(self, schema: Schema, emb_dim: int, vocab_cap: int | None = None, *, threshold: int = 1_000_000,
                 hash_large: bool = False, seq_threshold: int | None = None, columns: int = 1,
                 sides: tuple[str, ...] = ("user", "item"), backend: str = "torch"):
        super().__init__()
        self.emb_dim = emb_dim
        self.backend = backend  # embedding-bag mean of the multi-valued fields (`fields`)
        self.vocab_cap = vocab_cap
        self.columns = columns
        next_row = 1  # row 0 = padding
        self.hashed_features: list[str] = []
        self.dropped_features: list[str] = []

        def place(vocab: int, label: str, limit: int) -> tuple[int, int]:
            """(base row, rows per column) of one feature; a dropped feature maps every id to row 0."""
            nonlocal next_row
            n = table_rows(vocab, limit, hash_large, vocab_cap)
            if n == 0:
                self.dropped_features.append(label)
                return 0, 1
            if n < vocab - 1:
                self.hashed_features.append(label)
            base = next_row
            next_row += n * columns
            return base, n

        for side in sides:  # a model with its own field tables leaves the sides out
            group = schema.int_group(side)
            bases, mods, keep, feature_of = [], [], [], []
            for index, feat in enumerate(group):
                base, n = place(feat.vocab_size, f"{side}_int_{feat.fid}", threshold)
                bases += [base] * feat.dim
                mods += [n] * feat.dim
                keep += [base > 0] * feat.dim
                feature_of += [index] * feat.dim
            self.register_buffer(f"{side}_base", torch.tensor(bases, dtype=torch.long), persistent=False)
            self.register_buffer(f"{side}_mod", torch.tensor(mods, dtype=torch.long), persistent=False)
            self.register_buffer(f"{side}_keep", torch.tensor(keep, dtype=torch.bool), persistent=False)
            self.register_buffer(f"{side}_feature", torch.tensor(feature_of, dtype=torch.long), persistent=False)
            setattr(self, f"{side}_features", len(group))
            setattr(self, f"{side}_multi", any(f.dim > 1 for f in group))
            # bags for the kernels' embedding-bag mean (`field_means`): feature f's slots, padded with slot D
            # (a zero column)
            width = max((f.dim for f in group), default=1)
            bags = torch.full((len(group), width), len(bases), dtype=torch.long)
            start = 0
            for index, feat in enumerate(group):
                bags[index, :feat.dim] = torch.arange(start, start + feat.dim)
                start += feat.dim
            self.register_buffer(f"{side}_bags", bags, persistent=False)
        for domain in schema.domains:
            bases, mods, keep = [], [], []
            for feat in domain.side_features:
                base, n = place(feat.vocab_size, f"{domain.name}_{feat.fid}", seq_threshold or threshold)
                bases.append(base)
                mods.append(n)
                keep.append(base > 0)
            for name, values, dtype in (("base", bases, torch.long), ("mod", mods, torch.long),
                                        ("keep", keep, torch.bool)):
                self.register_buffer(f"seq_{name}_{domain.name}", torch.tensor(values, dtype=dtype)[:, None],
                                     persistent=False)
        self.table = SparseTable(next_row, emb_dim)
        nn.init.normal_(self.table.weight, std=0.05)
        with torch.no_grad():
            self.table.weight[0].zero_()

    @staticmethod
    def _rows(ids: torch.Tensor, base: torch.Tensor, mod: torch.Tensor, keep: torch.Tensor | None = None,
              columns: int = 1) -> torch.Tensor:
        """Table rows of `ids` (0 for id 0 and for dropped features); with columns > 1 a trailing column
        axis [..., C]."""
        ids = ids.long()
        present = ids > 0 if keep is None else (ids > 0) & keep
        rows = torch.where(present, base + torch.remainder(ids - 1, mod), torch.zeros_like(ids))
        if columns == 1:
            return rows
        offsets = torch.arange(columns, device=ids.device) * mod[..., None]
        return torch.where(present[..., None], rows[..., None] + offsets, torch.zeros_like(offsets))

    def _side_rows(self, batch: Batch, side: str) -> torch.Tensor:
        block = batch.user if side == "user" else batch.item
        return self._rows(block.int_values, getattr(self, f"{side}_base"), getattr(self, f"{side}_mod"),
                          getattr(self, f"{side}_keep"), self.columns)

    def fields(self, batch: Batch, side: str) -> torch.Tensor:
        """[B, n_features, emb_dim] ([B, C, n_features, emb_dim] with columns): per feature the mean
        embedding of its non-zero ids (0 when none, and for a dropped feature)."""
        rows = self._side_rows(batch, side)
        if self.columns > 1:
            rows = rows.transpose(1, 2)  # [B, C, D]
        if not getattr(self, f"{side}_multi"):
            return self.table(rows)  # [B, (C,) D, E]: one id per feature, no mean to take
        return field_means(self.table, rows, getattr(self, f"{side}_feature"), getattr(self, f"{side}_features"),
                           getattr(self, f"{side}_bags"), self.backend)

    def field_present(self, batch: Batch, side: str) -> torch.Tensor:
        """[B, n_features] bool: the feature has at least one non-missing id (one flag per feature, not
        per slot)."""
        block = batch.user if side == "user" else batch.item
        ok = (~block.int_missing) & (block.int_values != 0)
        n = getattr(self, f"{side}_features")
        counts = ok.new_zeros(ok.shape[0], n, dtype=torch.long).index_add(
            1, getattr(self, f"{side}_feature"), ok.long())
        return counts > 0

    def sequence(self, seq: SequenceBlock, domain: str) -> torch.Tensor:
        """[B, L, F * emb_dim] ([B, C, L, F * emb_dim] with columns): the concatenated side-feature
        embeddings of each event."""
        rows = self._rows(seq.values, getattr(self, f"seq_base_{domain}"), getattr(self, f"seq_mod_{domain}"),
                          getattr(self, f"seq_keep_{domain}"), self.columns)
        emb = self.table(rows)  # [B, F, L, (C,) E]
        if self.columns == 1:
            b, f, length, e = emb.shape
            return emb.permute(0, 2, 1, 3).reshape(b, length, f * e)
        b, f, length, c, e = emb.shape
        return emb.permute(0, 3, 2, 1, 4).reshape(b, c, length, f * e)


class SequenceTokenizer(nn.Module):
    """Event tokens of one domain: concat feature embeddings -> Linear -> SiLU -> LayerNorm, plus a
    time-bucket embedding of (request - event)."""

    def __init__(self, n_features: int, emb_dim: int, d_model: int):
        super().__init__()
        self.proj = nn.Linear(n_features * emb_dim, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.time = nn.Embedding(NUM_TIME_BUCKETS, d_model)
        nn.init.normal_(self.time.weight, std=0.02)

    def forward(self, embeddings: torch.Tensor, seq: SequenceBlock, request_ts: torch.Tensor) -> torch.Tensor:
        valid = seq.valid_mask()
        tokens = self.norm(F.silu(self.proj(embeddings)))
        tokens = tokens + self.time(time_buckets(request_ts, seq.timestamps, valid))
        return tokens * valid[:, :, None].to(tokens.dtype)


class DenseProjector(nn.Module):
    """[values, missing] -> Linear -> SiLU -> LayerNorm. Values pass through sign * log1p(|x|) first so
    that a heavy-tailed dense feature cannot swamp the projection."""

    def __init__(self, width: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(2 * width, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, values: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        x = torch.cat([torch.sign(values) * torch.log1p(values.abs()), missing.to(values.dtype)], dim=-1)
        return self.norm(F.silu(self.proj(x)))


def embeddings_for(schema: Schema, config: ModelConfig, columns: int = 1,
                   sides: tuple[str, ...] = ("user", "item")) -> FeatureEmbeddings:
    """The feature tables of a model config (its thresholds, hashing and the smoke's cap)."""
    return FeatureEmbeddings(schema, config.emb_dim, config.vocab_cap, threshold=config.emb_skip_threshold,
                             hash_large=config.emb_hash_large, seq_threshold=config.seq_emb_skip_threshold,
                             columns=columns, sides=sides, backend=config.embedding_backend)


class FeatureEncoder(nn.Module):
    """What all models share: field embeddings, dense tokens (user dense + sequence statistics, item
    dense when the schema has any) and per-domain sequence tokens."""

    def __init__(self, schema: Schema, config: ModelConfig, dense_tokens: bool = True):
        super().__init__()
        self.schema = schema
        self.domains = [d.name for d in schema.domains]
        self.embeddings = embeddings_for(schema, config)
        d = config.d_model
        self.user_dense = self.item_dense = None
        if dense_tokens:  # a model with its own dense tokenizer leaves these out
            self.user_dense = DenseProjector(schema.dense_width("user") + NUM_SEQ_STATS * len(self.domains), d)
            if schema.dense_width("item"):
                self.item_dense = DenseProjector(schema.dense_width("item"), d)
        self.tokenizers = nn.ModuleDict(
            {dom.name: SequenceTokenizer(len(dom.side_features), config.emb_dim, d) for dom in schema.domains}
        )

    @property
    def n_dense_tokens(self) -> int:
        return 1 + (self.item_dense is not None)

    def user_dense_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """User dense values with every domain's sequence statistics appended, and their missing mask."""
        stats = [sequence_stats(batch.sequences[name], batch.request_timestamp) for name in self.domains]
        values = torch.cat([batch.user.dense_values, *stats], dim=-1)
        missing = torch.cat([batch.user.dense_missing, *[torch.zeros_like(s, dtype=torch.bool) for s in stats]], -1)
        return values, missing

    def dense_tokens(self, batch: Batch) -> torch.Tensor:
        """[B, 1 or 2, d]: the user dense token (with sequence statistics) and the item dense token."""
        values, missing = self.user_dense_inputs(batch)
        tokens = [self.user_dense(values, missing)]
        if self.item_dense is not None:
            tokens.append(self.item_dense(batch.item.dense_values, batch.item.dense_missing))
        return torch.stack(tokens, dim=1)

    def sequence_tokens(
        self, batch: Batch, domain: str, max_len: int | None = None, tail: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, SequenceBlock]:
        """(tokens [B, L', d], lengths [B], the trimmed block) of one domain."""
        seq = trim_sequence(batch.sequences[domain], max_len=max_len, tail=tail)
        emb = self.embeddings.sequence(seq, domain)
        return self.tokenizers[domain](emb, seq, batch.request_timestamp), seq.lengths.long(), seq


# ---------------------------------------------------------------------------------------- the contract
class PCVRModel(nn.Module):
    """Base class: `Model(schema, config)`, forward -> logits [B, 1], predict -> (logits, embedding)."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    # relative CPU cost of a training step (baseline = 1); the smoke starts the dearest runs first
    cost_hint: ClassVar[float] = 1.0
    # parameter name patterns whose gradient is exactly zero at initialisation by design (a gate in front
    # of a zero-initialised weight); the contract test checks they get one once that weight moves
    zero_gradient_at_init: ClassVar[tuple[str, ...]] = ()

    def __init__(self, schema: Schema, config: ModelConfig | dict | None = None):
        super().__init__()
        if config is None or isinstance(config, dict):
            config = self.config_class.from_dict(config)
        elif not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        else:
            config.validate()
        if not schema.domains:
            raise ValueError(f"model {self.name!r} needs at least one sequence domain, and the schema's \"seq\" is "
                             "empty: add a user-behaviour sequence domain to the schema (see "
                             "fixtures/sample_1000_raw.schema.json)")
        self.schema = schema
        self.config = config

    def predict(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.predict(batch)[0]

    def output_layer(self) -> nn.Linear:
        """The final Linear that produces the logit (its bias can be set to the label prior)."""
        return self.out

    @torch.no_grad()
    def set_output_prior(self, positive_rate: float) -> None:
        """Start the logit bias at log(p / (1 - p)) of the training labels' positive rate. Without it the
        first steps spend the sparse optimizer's large steps on lowering every score, which moves the
        embeddings of frequent ids most and so ranks frequent values low whatever the label says."""
        p = min(max(float(positive_rate), 1e-4), 1 - 1e-4)
        self.output_layer().bias.fill_(math.log(p / (1 - p)))

    def sparse_parameters(self) -> list[nn.Parameter]:
        """The embedding tables (sparse gradients; Adagrad): every nn.Embedding built with sparse=True."""
        return [m.weight for m in self.modules() if isinstance(m, nn.Embedding) and m.sparse]

    def dense_parameters(self) -> list[nn.Parameter]:
        sparse = {id(p) for p in self.sparse_parameters()}
        return [p for p in self.parameters() if id(p) not in sparse]

    def parameter_counts(self) -> dict[str, int]:
        sparse = sum(p.numel() for p in self.sparse_parameters())
        dense = sum(p.numel() for p in self.dense_parameters())
        return {"total": sparse + dense, "sparse": sparse, "dense": dense}
