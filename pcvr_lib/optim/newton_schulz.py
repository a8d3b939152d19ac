"""Newton-Schulz orthogonalisation of (stacks of) matrices with batched matmuls.

Every iteration is an odd matrix polynomial X <- a X + b (X X^T) X + c (X X^T)^2 X, so it acts on each
singular value alone: sigma <- a sigma + b sigma^3 + c sigma^5, singular vectors unchanged. The input is
first divided by its Frobenius norm, which puts every singular value in [0, 1].

- cubic (1.5, -0.5, 0): the reference's iteration. Converges to 1 from any sigma in (0, sqrt(3)), but only
  by a factor 1.5 per step for small sigma: 5 steps bring 0.1 to 0.76 and 0.01 to 0.076.
- quintic (3.4445, -4.7750, 2.0315): the common Muon coefficients. Not convergent: it pushes every sigma
  above about 1e-3 into a band of roughly [0.68, 1.13] within 5 steps, which is what Muon needs.

Zero padding is exact for these polynomials, and a stacked (B, m, n) batch is B independent problems.
"""

from __future__ import annotations

import math

import torch

from .errors import OptimizerError

CUBIC = (1.5, -0.5, 0.0)
QUINTIC = (3.4445, -4.7750, 2.0315)
COEFFICIENTS = {"cubic": CUBIC, "quintic": QUINTIC}

# Below this Frobenius norm (or when it is not finite) the update is defined as zero.
TINY_NORM = 1e-12


def resolve_coefficients(name: str) -> tuple[float, float, float]:
    try:
        return COEFFICIENTS[name]
    except KeyError:
        raise OptimizerError(
            f"unknown Newton-Schulz iteration {name!r}; known: {', '.join(sorted(COEFFICIENTS))}"
        ) from None


def scalar_map(sigma, steps: int, coefficients: tuple[float, float, float]):
    """What `steps` iterations do to one normalised singular value (a float or a tensor)."""
    a, b, c = coefficients
    for _ in range(steps):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def safe_inverse_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 / ||x_i||_F, ||x_i||_F) per matrix of a (B, m, n) stack, in at least fp32; the inverse is 0 where
    the norm is tiny, infinite (its reciprocal is 0) or NaN (the comparison is false)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=dtype)
    return torch.where(norm > TINY_NORM, norm.reciprocal(), 0.0), norm


def newton_schulz_(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """Run the iteration on an already normalised stack x (B, r, c) with r <= c; returns the result."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # (B, r, r): the small Gram matrix since r <= c
        if c != 0.0:
            # poly = b*G + c*G@G, then X <- a*X + poly@X
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
        else:
            x = torch.baddbmm(x, gram, x, beta=a, alpha=b)
    return x


def orthogonalize(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] | str = CUBIC,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor of each matrix in g ((m, n) or (B, m, n)).

    Each matrix is divided by its own Frobenius norm (a matrix whose norm is tiny or not finite gives a
    zero result), iterated in `compute_dtype` (default: g's dtype) on its wide orientation, and returned
    in that dtype and g's orientation. The result is not rescaled.
    """
    if isinstance(coefficients, str):
        coefficients = resolve_coefficients(coefficients)
    if steps < 1:
        raise ValueError(f"Newton-Schulz steps must be >= 1, got {steps}")
    squeeze = g.dim() == 2
    if squeeze:
        g = g.unsqueeze(0)
    if g.dim() != 3:
        raise ValueError(f"orthogonalize expects a matrix or a (B, m, n) stack, got shape {tuple(g.shape)}")
    transpose = g.shape[-2] > g.shape[-1]
    x = g.mT if transpose else g
    dtype = compute_dtype or g.dtype
    inv, _ = safe_inverse_norm(x)
    # inv is 0 for a non-finite matrix; inf*0 = nan there, which nan_to_num turns into the zero update.
    x = torch.nan_to_num_((x * inv).to(dtype), nan=0.0, posinf=0.0, neginf=0.0)
    # (x * inv) is computed in fp32 (inv is fp32), then rounded once to the compute dtype
    x = newton_schulz_(x, steps, coefficients)
    if transpose:
        x = x.mT
    return x.squeeze(0) if squeeze else x


def muon_scale(rows: int, cols: int) -> float:
    """The reference's shape factor sqrt(max(1, rows / cols))."""
    return math.sqrt(max(1.0, rows / cols))


def orthogonality_error(o: torch.Tensor) -> dict:
    """How far a matrix (or the worst of a stack) is from orthogonal, from its singular values in fp64."""
    o = o.detach().to(torch.float64)
    if o.dim() == 2:
        o = o.unsqueeze(0)
    s = torch.linalg.svdvals(o)
    return {
        "sigma_min": float(s.min()),
        "sigma_max": float(s.max()),
        "max_abs_sigma_minus_1": float((s - 1).abs().max()),
    }
