"""A model's forward under torch.compile, for training as well as inference.

Every model traces as one graph (fullgraph=True) on every backend: the kernels are torch.library custom
ops with fake kernels, sequence trimming keeps the static length under compilation, and the sparse tables'
gradients are captured as fixed-size pieces (`tables.RowCapture`; AOTAutograd cannot produce sparse
gradients). Modes:

- "compile": torch.compile(fullgraph=True), inductor's default mode;
- "graph": the same with mode="reduce-overhead": inductor's CUDA graphs (CUDA only), which replay the
  forward and the backward with one launch each.

(A third mode, "captured", is not compiled: the whole eager step, optimizers included, as one CUDA graph;
`models.captured`.)

A training forward returns the logits; after `loss.backward()`, `after_backward()` gives the tables their
gradients (`optim.train_step(..., after_backward=compiled.after_backward)`). The optimizers run eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.sequences import at_static_lengths
from pcvr_lib.models.tables import RowCapture

MODES = ("eager", "compile", "graph", "captured")


def mode_problem(mode: str, device: torch.device | str) -> str | None:
    """Why `mode` cannot run on `device` (None when it can)."""
    if mode not in MODES:
        return f"unknown mode {mode!r} (one of {', '.join(MODES)})"
    if mode in ("graph", "captured") and torch.device(device).type != "cuda":
        return f"mode {mode!r} replays CUDA graphs and needs a CUDA device; use 'compile' on the CPU"
    return None


class CompiledModel:
    """`model` compiled in `mode` ("compile" or "graph"); called like the model. The module itself stays
    `self.model` (parameters, state dict, train/eval)."""

    def __init__(self, model: nn.Module, mode: str = "compile", compiler="inductor"):
        if mode not in ("compile", "graph"):
            raise ValueError(f"CompiledModel: mode must be 'compile' or 'graph', got {mode!r}")
        self.model = model
        self.mode = mode
        # `compiler`: torch.compile's backend; the CPU tests pass "aot_eager" (the same traced forward and
        # backward graphs, run without inductor's minute of code generation per model)
        self.forward = torch.compile(model, fullgraph=True, backend=compiler,
                                     mode="reduce-overhead" if mode == "graph" else None)
        self._captures: dict[tuple, RowCapture] = {}
        self._pending: RowCapture | None = None

    def __call__(self, batch: Batch) -> torch.Tensor:
        if not (self.model.training and torch.is_grad_enabled()):
            return self.forward(batch)
        key = tuple((t.shape, t.dtype, t.device) for t in batch.tensors())
        capture = self._captures.get(key)
        if capture is None:  # one eager forward at the compiled shapes, once per batch shape; it leaves the
            # random state (dropout draws) as it was
            cuda = [batch.device] if batch.device.type == "cuda" else []
            with at_static_lengths(), torch.random.fork_rng(devices=cuda):
                capture = self._captures[key] = RowCapture.plan(lambda: self.model(batch))
        with capture.active():
            logits = self.forward(batch)
        self._pending = capture
        return logits

    def after_backward(self) -> None:
        """The captured row gradients of the last training forward become the tables' gradients."""
        if self._pending is not None:
            self._pending.install_gradients()
            self._pending = None
