"""checkpoint.host_copies: the batched device-to-host copy of a checkpoint's tensors. Its batched path runs
on a GPU; here it is forced onto CPU tensors (`batched=("cpu",)`) so that the joining, chunking and splitting
are checked bit for bit, and each copy owns its memory (safetensors refuses tensors that share storage)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pcvr_lib.train import checkpoint


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=g),
        torch.tensor(7.0),  # 0-dim (a step count)
        torch.randn(2, 4, generator=g).to(torch.bfloat16),
        torch.empty(0, 8),
        torch.randn(300, generator=g),
        torch.tensor([True, False, True]),
        torch.randn(4, 4, generator=g)[:, 1],  # not contiguous
        torch.full((3,), -0.0),  # -0.0 keeps its sign bit
        torch.randint(0, 100, (6, 2), generator=g),
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 64, 256 << 20])
def test_batched_copies_are_the_tensors_bit_for_bit_each_in_its_own_memory(tmp_path, chunk_bytes):
    tensors = _tensors()
    copies = checkpoint.host_copies(tensors, batched=("cpu",), chunk_bytes=chunk_bytes)
    assert len(copies) == len(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and c.device.type == "cpu"
        assert torch.equal(_bits(c), _bits(t))
    pointers = [c.untyped_storage().data_ptr() for c in copies if c.numel()]
    assert len(set(pointers)) == len(pointers)
    named = {f"t{i}": c for i, c in enumerate(copies)}
    save_file(named, str(tmp_path / "x.safetensors"))
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in named.items())


def test_on_host_keeps_the_state_dicts_structure():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)}, 1: {"sum": torch.zeros(3)}},
             "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999)}]}
    host = checkpoint._on_host(state)
    assert host["param_groups"] == state["param_groups"] and isinstance(host["param_groups"][0]["betas"], tuple)
    assert list(host["state"]) == [0, 1]
    assert torch.equal(host["state"][0]["exp_avg"], torch.ones(2, 2)) and float(host["state"][0]["step"]) == 3.0
