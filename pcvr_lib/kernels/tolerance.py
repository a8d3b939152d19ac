"""One tolerance table for every kernel check, and the comparison against an fp64 reference.

A result passes when, element-wise, |actual - expected| <= atol * scale + rtol * |expected|, where
`scale` is the RMS of the expected tensor (so atol is relative to the tensor's own magnitude: gradients
summed over many rows and tiny outputs are judged alike). Non-finite values must match exactly:
NaN where the reference is NaN, the same infinity where it is infinite; a NaN never passes otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float  # in units of the expected tensor's RMS
    rtol: float


# Rounding the fp32-accumulated result to the output dtype costs half an ulp (fp16 2^-11, bf16 2^-9);
# the table allows about four of those, fp32 a few accumulation roundings over long rows.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=8e-3, rtol=8e-3),
}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def tolerance(dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        names = [DTYPE_NAMES[d] for d in TOLERANCES]
        raise ValueError(f"no tolerance for dtype {dtype}; the table has {names}") from None


def max_errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |expected|) over the finite elements of the reference.

    The relative figure is normalised by the largest reference magnitude, not element-wise, so values
    near zero do not blow it up. NaN in `actual` where the reference is finite gives (nan, nan).
    """
    e = expected.detach().to(torch.float64)
    a = actual.detach().to(device=e.device, dtype=torch.float64)  # compared where the reference lives
    finite = torch.isfinite(e)
    if not finite.any():
        return 0.0, 0.0
    diff = (a[finite] - e[finite]).abs()
    if diff.numel() and torch.isnan(diff).any():
        return float("nan"), float("nan")
    max_abs = float(diff.max()) if diff.numel() else 0.0
    denom = float(e[finite].abs().max())
    return max_abs, (max_abs / denom if denom > 0 else max_abs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
                 what: str = "output", tol: Tolerance | None = None, scale: float | None = None) -> None:
    """Fail (AssertionError) unless `actual` matches the fp64 reference `expected` within the table.

    `scale` (default: the RMS of `expected`) is what atol is relative to. Pass the magnitude of the terms
    when the expected values are a near-cancelling difference of much larger ones (e.g. the input
    gradient of a norm over one element is pure rounding noise of size eps * terms).
    """
    if dtype is None:
        dtype = actual.dtype
    tol = tol or tolerance(dtype)
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    e = expected.detach().to(torch.float64)
    a = actual.detach().to(device=e.device, dtype=torch.float64)  # big tensors stay on the GPU

    e_nan, a_nan = torch.isnan(e), torch.isnan(a)
    if not torch.equal(e_nan, a_nan):
        bad = (e_nan != a_nan).nonzero().cpu()
        raise AssertionError(
            f"{what}: NaN pattern differs at {bad.shape[0]} of {a.numel()} elements "
            f"(actual NaN: {int(a_nan.sum())}, expected NaN: {int(e_nan.sum())}; first at {bad[0].tolist()})"
        )
    e_inf = torch.isinf(e)
    if not torch.equal(e_inf, torch.isinf(a)) or (e_inf.any() and not torch.equal(a[e_inf], e[e_inf])):
        raise AssertionError(f"{what}: infinities differ from the reference")

    finite = torch.isfinite(e)
    ef, af = e[finite], a[finite]
    if ef.numel() == 0:
        return
    scale = max(float(ef.pow(2).mean().sqrt()), scale or 0.0)
    diff = (af - ef).abs()
    allowed = tol.atol * max(scale, 1e-30) + tol.rtol * ef.abs()
    over = diff > allowed
    if over.any():
        max_abs, max_rel = max_errors(actual, expected)
        worst = int(torch.argmax(diff - allowed))
        raise AssertionError(
            f"{what} ({DTYPE_NAMES.get(dtype, dtype)}): {int(over.sum())} of {ef.numel()} elements outside "
            f"atol={tol.atol:g}*rms({scale:.3g}) + rtol={tol.rtol:g}*|ref|; max abs error {max_abs:.3g}, "
            f"max rel error {max_rel:.3g}; worst: got {float(af[worst]):.6g}, expected {float(ef[worst]):.6g}"
        )


# ------------------------------------------------------------------ the flash-attention rule

# one ulp of the dtype at magnitude 1: the rounding of the result itself
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def flash_rule(actual: torch.Tensor, expected: torch.Tensor, baseline_error: float, dtype: torch.dtype,
               what: str = "output") -> tuple[float, float]:
    """flash-attention's own test rule: max |actual - expected| (fp64 reference) must be at most twice the
    error of the baseline (torch's SDPA in the same dtype, `baseline_error`) plus one ulp of the dtype at
    the reference's largest magnitude. NaN never passes. Returns (max abs error, max rel error)."""
    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    assert not torch.isnan(a).any(), f"{what}: NaN in the result"
    if expected.numel() == 0:
        return 0.0, 0.0
    err = float((a - expected).abs().max())
    top = float(expected.abs().max())
    bound = 2.0 * baseline_error + ULP[dtype] * max(top, 1e-3)
    assert err <= bound, (f"{what}: max error {err:.3g} > 2 x the baseline's {baseline_error:.3g} + ulp*max|ref| "
                          f"({bound:.3g})")
    return err, (err / top if top > 0 else err)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in fp64 where the reference lives (0 for empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    return float((actual.detach().to(device=expected.device, dtype=torch.float64) - expected).abs().max())
