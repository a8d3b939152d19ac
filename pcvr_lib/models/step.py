"""One model on one operator backend, ready to run a training step or an inference pass on a fixed batch:
what the model-level benchmark times and what the backend tests compare (the same step as `pcvr train`:
BCE on the logits, `optim.train_step` with fused AdamW on the dense and sparse Adagrad on the tables), eagerly,
compiled (`models.compiled`) or captured whole as one CUDA graph per phase (`models.captured`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pcvr_lib.data.batch import Batch
from pcvr_lib.models.captured import StepGraph, capture_training, copy_batch_, same_layout
from pcvr_lib.models.common import BACKEND_OPTIONS
from pcvr_lib.models.compiled import CompiledModel, mode_problem
from pcvr_lib.models.registry import build_model
from pcvr_lib.models.sequences import at_static_lengths


def backend_options(backend: str) -> dict[str, str]:
    """Every operator switch of a model config set to `backend`."""
    return {name: backend for name in BACKEND_OPTIONS}


class ModelStep:
    """`name` built with `seed` on `backend` (every operator switch; `config` may override single switches),
    with its optimizers, on `batch`, run in `mode` (`compiled.MODES`: eager, compile, graph, captured). In
    mode captured each phase is captured at its first call (`models.captured`: the batch's memory and the
    learning rates are fixed from then on) and replayed at every call."""

    def __init__(self, name: str, schema, batch: Batch, backend: str, *, config: dict | None = None,
                 seed: int = 0, device: str | torch.device = "cpu", max_grad_norm: float = 1.0,
                 mode: str = "eager", compiler="inductor"):
        from pcvr_lib.optim import build_optimizer_set

        problem = mode_problem(mode, device)
        if problem:
            raise ValueError(f"ModelStep: {problem}")
        torch.manual_seed(seed)  # the same initial weights on every backend
        self.model = build_model(name, schema, {**backend_options(backend), **(config or {})}).to(device)
        self._graphs: dict[str, StepGraph] = {}
        self.batch = batch.to(device)
        # fused AdamW: one kernel per step, its step counts on the device (torch's for-each AdamW keeps them on
        # the host and reads them there); capturable where a CUDA graph captures its step
        self.optimizers = build_optimizer_set(self.model.dense_parameters(), self.model.sparse_parameters(),
                                              dense="fused_adamw",
                                              dense_options={"capturable": mode == "captured"})
        self.max_grad_norm = max_grad_norm
        self.mode = mode
        self.forward = self.model if mode in ("eager", "captured") else CompiledModel(self.model, mode, compiler)

    @property
    def batch(self) -> Batch:
        return self._batch

    @batch.setter
    def batch(self, batch: Batch) -> None:
        """The batch the next call runs on. Once a phase is captured its graph reads the memory of the batch
        it was captured on, so a new batch is copied into that memory (same shapes and dtypes, or an error)."""
        if not self._graphs:
            self._batch = batch
            return
        if not same_layout(self._batch, batch):
            raise ValueError("ModelStep: in mode captured every batch must have the shapes and dtypes of the one "
                             f"captured on (batch size {self._batch.batch_size}, the same sequence lengths); got "
                             f"batch size {batch.batch_size} or other lengths: drop the last partial batch, or "
                             "build a ModelStep per batch shape")
        copy_batch_(self._batch, batch)

    def loss(self) -> torch.Tensor:
        logits = self.forward(self.batch)
        return F.binary_cross_entropy_with_logits(logits.float().squeeze(-1), self.batch.label.float())

    def train_step(self) -> dict:
        """One step; loss, grad_norm and clip_coef come back as device tensors (no host sync; in mode
        captured the graph's own, overwritten by the next step)."""
        if self.mode == "captured":
            if "train_step" not in self._graphs:
                self._graphs["train_step"] = capture_training(self.model, self.optimizers, self._static_train_step)
            return self._graphs["train_step"].replay()
        return self._train_step()

    def _train_step(self) -> dict:
        from pcvr_lib.optim import train_step

        self.model.train()
        after_backward = getattr(self.forward, "after_backward", None)
        return train_step(self.loss(), self.optimizers, max_grad_norm=self.max_grad_norm, skip_nonfinite=False,
                          after_backward=after_backward, read=False)

    def _static_train_step(self) -> dict:
        with at_static_lengths():
            return self._train_step()

    @torch.no_grad()
    def infer(self) -> torch.Tensor:
        """The logits of the batch (in mode captured the graph's own, overwritten by the next call)."""
        if self.mode == "captured":
            if "infer" not in self._graphs:
                self._graphs["infer"] = StepGraph(self._static_infer)
            return self._graphs["infer"].replay()
        self.model.eval()
        return self.forward(self.batch)

    @torch.no_grad()
    def _static_infer(self) -> torch.Tensor:
        self.model.eval()
        with at_static_lengths():
            return self.forward(self.batch)

    @torch.no_grad()
    def eval_loss(self) -> float:
        self.model.eval()
        return float(self.loss())
