"""The model contract, per registered model, on random Batches built from the demo schema."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest
import torch

from pcvr_lib.models import build_model, model_class, model_names
from pcvr_lib.train import TrainConfig, load_checkpoint, save_checkpoint
from pcvr_lib.workloads.models import demo_schema, random_batch

MODELS = model_names()


@pytest.fixture(scope="module")
def schema():
    return demo_schema(max_len=12)


@pytest.fixture(scope="module")
def batch(schema):
    return random_batch(schema, batch=6, seed=3)


TEST_CAP = 256  # small hashed tables: building a model costs milliseconds, the layers keep their defaults


def _model(name, schema, seed=0, **overrides):
    """The model in eval mode (dropout and training-only token dropout off: outputs are a function of the
    inputs); `test_training_mode_forward_backward` covers the training paths."""
    torch.manual_seed(seed)
    return build_model(name, schema, {"vocab_cap": TEST_CAP, **overrides}).eval()


def test_registry_has_the_seven_models():
    assert MODELS[:7] == ["baseline", "interformer", "onetrans", "tokenformer", "symbiosis", "dualq", "queryformer"]
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        model_class("nope")


@pytest.mark.parametrize("name", MODELS)
def test_default_widths_depths_heads(name):
    """The reference's defaults (models-smoke.md, models-ii.md): d, blocks, heads, embedding dim, thresholds."""
    expected = {"baseline": (64, 2, 4, 64), "tokenformer": (64, 4, 4, 64), "onetrans": (64, 2, 4, 64),
                "interformer": (64, 2, 4, 64), "symbiosis": (256, 4, 8, 256), "dualq": (192, 2, 4, 64),
                "queryformer": (128, 2, 4, 64)}
    config = model_class(name).config_class()
    if name in expected:
        assert (config.d_model, config.num_blocks, config.num_heads, config.emb_dim) == expected[name]
        assert config.emb_skip_threshold == 1_000_000 and config.vocab_cap is None
        hashed = {"onetrans", "symbiosis", "dualq", "queryformer"}
        assert config.emb_hash_large == (name in hashed)
    extra = {"baseline": ("queries_per_domain", 2), "tokenformer": ("window", 64), "onetrans": ("top_k", 50),
             "symbiosis": ("seq_emb_skip_threshold", 10_000), "dualq": ("user_queries", 4),
             "queryformer": ("columns", 4), "interformer": ("summary_queries", 2)}
    if name in extra:
        assert getattr(config, extra[name][0]) == extra[name][1]


@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_and_finite(name, schema, batch):
    model = _model(name, schema)
    logits, embedding = model.predict(batch)
    assert logits.shape == (batch.batch_size, 1)
    assert embedding.shape[0] == batch.batch_size and embedding.dim() == 2
    assert torch.isfinite(logits).all() and torch.isfinite(embedding).all()
    assert torch.equal(model(batch), logits)


@pytest.mark.parametrize("name", MODELS)
def test_backward_reaches_every_dense_parameter_and_every_table(name, schema, batch):
    model = _model(name, schema)
    model(batch).sum().backward()
    sparse = model.sparse_parameters()
    assert sparse, "a model must expose its embedding tables as sparse parameters"
    sparse_ids = {id(p) for p in sparse}
    assert all(id(p) not in sparse_ids for p in model.dense_parameters())
    assert len(sparse) + len(model.dense_parameters()) == len(list(model.parameters()))
    for pname, p in model.named_parameters():
        if id(p) in sparse_ids:
            # COO, or dense where the batch reads the table more often than it has rows (models.tables)
            assert p.grad is not None, f"{pname} gets no gradient"
            g = p.grad.to_dense()
            assert torch.isfinite(g).all() and g.abs().sum() > 0, pname
            assert (g[0] == 0).all(), f"{pname}: the padding row must get no gradient"
        else:
            assert p.grad is not None, f"{pname} gets no gradient"
            assert torch.isfinite(p.grad).all(), pname
    dead = [n for n, p in model.named_parameters() if id(p) not in sparse_ids and p.grad.abs().sum() == 0]
    # a gate in front of a zero-initialised weight (the reference's init) has a zero gradient at step 0 only
    expected = [n for n in dead if any(fnmatch.fnmatch(n, pat) for pat in model.zero_gradient_at_init)]
    assert dead == expected, f"dense parameters with an all-zero gradient: {sorted(set(dead) - set(expected))}"
    if expected:
        with torch.no_grad():
            for p in model.dense_parameters():
                if p.dim() > 1 and not p.any():
                    p.normal_(std=0.02)
        model.zero_grad()
        model(batch).sum().backward()
        still = [n for n, p in model.named_parameters() if n in expected and p.grad.abs().sum() == 0]
        assert not still, f"no gradient even with the zero-initialised weights moved: {still}"


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_logits(name, schema, batch):
    a = _model(name, schema, seed=5)(batch)
    b = _model(name, schema, seed=5)(batch)
    c = _model(name, schema, seed=6)(batch)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("name", MODELS)
def test_padding_beyond_length_is_ignored(name, schema, batch):
    """Values and timestamps past each row's length must not change the logits."""
    model = _model(name, schema).eval()
    noisy = batch.clone()
    for seq in noisy.sequences.values():
        invalid = ~seq.valid_mask()
        seq.values[invalid[:, None, :].expand_as(seq.values)] = 7
        seq.timestamps[invalid] = 123
    with torch.no_grad():
        torch.testing.assert_close(model(noisy), model(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_round_trip_identical_predictions(name, schema, batch, tmp_path):
    model = _model(name, schema, seed=11).eval()
    config = TrainConfig(model=name, data="unused.parquet", run_dir=str(tmp_path), max_lens="seq_a:12,seq_b:12,"
                         "seq_c:12,seq_d:12", model_config={"vocab_cap": TEST_CAP})
    folder = save_checkpoint(tmp_path, model, schema, config, step=3, auc=0.61234567)
    assert folder.name == "global_step3.AUC=0.612346"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json", "model.safetensors", "schema.json",
                                                       "train_config.json"]
    rebuilt, _, loaded_config, _ = load_checkpoint(tmp_path)
    rebuilt.eval()
    assert loaded_config.model_config == dataclasses.asdict(model.config)
    with torch.no_grad():
        assert torch.equal(rebuilt(batch), model(batch))


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_on_cpu_is_finite(name, schema, batch):
    model = _model(name, schema)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch)
    assert torch.isfinite(logits.float()).all()
    ref = model(batch)
    assert (logits.float() - ref).abs().max() < 0.5  # bf16 keeps the same ballpark


@pytest.mark.parametrize("name", MODELS)
def test_vocab_cap_bounds_the_tables(name, schema):
    small = _model(name, schema, vocab_cap=64)
    tables = small.sparse_parameters()
    rows = sum(t.shape[0] for t in tables)
    n_features = len(schema.user_int) + len(schema.item_int) + sum(len(d.side_features) for d in schema.domains)
    columns = getattr(small.config, "columns", 1)  # queryformer: C tables per feature
    assert rows <= len(tables) + 64 * n_features * columns


def test_config_errors_name_the_option(schema):
    with pytest.raises(ValueError, match="unknown option"):
        build_model("baseline", schema, {"d_modle": 64})
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        build_model("baseline", schema, {"d_model": 62, "num_heads": 4})
    with pytest.raises(ValueError, match="attention_backend"):
        build_model("onetrans", schema, {"attention_backend": "cuda"})


@pytest.mark.parametrize("name", MODELS)
def test_output_prior_sets_the_logit_bias(name, schema):
    model = _model(name, schema)
    model.set_output_prior(0.1)
    bias = model.output_layer().bias
    assert bias.shape == (1,) and torch.sigmoid(bias).item() == pytest.approx(0.1)


@pytest.mark.parametrize("name", MODELS)
def test_gpu_backends_route_to_the_kernel_package_without_fallback(name, schema, batch):
    """A non-torch backend reaches pcvr_lib.kernels (which refuses CPU tensors or head dim 16 here) or is
    refused by the model with a clear message; it never silently runs torch instead."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal path")
    model = _model(name, schema, attention_backend="triton", rms_norm_backend="triton", embedding_backend="triton")
    with pytest.raises((ValueError, RuntimeError),
                       match="flash_attention|rms_norm|layer_norm|embedding_bag|attention backend 'triton'"):
        model(batch)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("option,op", [("rms_norm_backend", "rms_norm|layer_norm"),
                                       ("embedding_backend", "embedding_bag_mean")])
def test_each_operator_switch_reaches_its_kernel(name, option, op, schema, batch):
    """One switch alone sends its operator to the kernel package (which refuses CPU tensors here): every
    model has norms, and every model reads the demo schema's multi-valued fields through the bag mean."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal path")
    with pytest.raises(RuntimeError, match=f"({op}).*requires CUDA"):
        _model(name, schema, **{option: "triton"})(batch)
