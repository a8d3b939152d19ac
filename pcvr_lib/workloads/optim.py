"""Workloads the optimizer benchmarks and tests train on.

- `mlp`: the reference's synthetic task: an MLP Linear(2F -> H), (depth - 1) x Linear(H -> H), GELU
  between them, Linear(H -> 1), on a fixed random batch with a binary target that depends on the inputs.
  Reference defaults: batch 512, F 128, H 512, depth 4.
- `pcvr_dense`: the dense parameter shapes of the `baseline` model (HyFormer, its default config, on the
  demo schema fixtures/sample_1000_raw.schema.json: token projections, per-domain sequence encoders,
  attention and its output gates, per-query generator FFNs, RankMixer FFNs, a head MLP, their norms),
  trained on a quadratic bowl towards a fixed random target so the step sees dense gradients of exactly
  these shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pcvr_lib.models import build_model
from pcvr_lib.schema import load_schema
from pcvr_lib.smoke import DEFAULT_SCHEMA


def pcvr_dense_shapes(d: int | None = None, model: str = "baseline") -> list[tuple[int, ...]]:
    """Shapes of `model`'s dense parameters (weights, biases and norm scales), built on the demo schema;
    `d` overrides its d_model."""
    overrides = {"vocab_cap": 1}  # the embedding tables are sparse parameters, not part of this workload
    if d is not None:
        overrides["d_model"] = d
    built = build_model(model, load_schema(DEFAULT_SCHEMA), overrides)
    return [tuple(p.shape) for p in built.dense_parameters()]


@dataclass
class Task:
    """Parameters and a loss closure; `loss()` runs the forward pass."""

    name: str
    module: nn.Module
    loss: callable

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())


def make_mlp(features: int = 128, hidden: int = 512, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(2 * features, hidden)]
    for _ in range(depth - 1):
        layers += [nn.GELU(), nn.Linear(hidden, hidden)]
    layers += [nn.GELU(), nn.Linear(hidden, 1)]
    return nn.Sequential(*layers)


def mlp_task(batch: int = 512, features: int = 128, hidden: int = 512, depth: int = 4, seed: int = 0,
             device="cpu") -> Task:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = make_mlp(features, hidden, depth).to(device)
    x = torch.randn(batch, 2 * features, generator=g)
    w = torch.randn(2 * features, generator=g)
    y = ((x @ w) + 0.5 * (x[:, :features] * x[:, features:]).sum(1) > 0).float().unsqueeze(1)
    x, y = x.to(device), y.to(device)

    def loss():
        return nn.functional.binary_cross_entropy_with_logits(model(x), y)

    return Task("mlp", model, loss)


def pcvr_dense_task(seed: int = 0, device="cpu", shapes: list[tuple[int, ...]] | None = None) -> Task:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or pcvr_dense_shapes()
    params = nn.ParameterList()
    for shape in shapes:
        fan_in = shape[-1]
        scale = fan_in**-0.5 if len(shape) >= 2 else 0.1
        params.append(nn.Parameter((torch.randn(shape, generator=g) * scale).to(device)))
    total = sum(p.numel() for p in params)
    target = (torch.randn(total, generator=g) * 0.05).to(device)

    def loss():
        flat = torch.cat([p.reshape(-1) for p in params])
        return (flat - target).square().mean() * 1e3

    return Task("pcvr_dense", params, loss)


WORKLOADS = {"mlp": mlp_task, "pcvr_dense": pcvr_dense_task}


def make_task(name: str, device="cpu", seed: int = 0, **options) -> Task:
    if name not in WORKLOADS:  # looked up first, so a KeyError inside a workload is not misreported
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed=seed, device=device, **options)
