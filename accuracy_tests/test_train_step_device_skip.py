"""A non-finite training step skipped on the device (`train_step(read=False)`: fused AdamW's found_inf, sparse
Adagrad's skip), as a captured step needs it: the same result as the host's skip, without a host read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcvr_lib.kernels.testing import count_host_reads
from pcvr_lib.optim import OptimizerError, OptimizerSet, build_optimizer, build_optimizer_set, train_step


@pytest.mark.parametrize("dense_table", [False, True])
def test_a_non_finite_step_skipped_on_the_device_equals_the_host_skip(dense_table):
    """read=False decides the skip on the device (fused AdamW's found_inf, sparse Adagrad's skip): over five
    steps with a NaN loss at the third, weights and optimizer state end as with the host's skip, and the
    skipped step reads nothing back. dense_table: the table's gradient is dense (models.tables' rule)."""
    ids = torch.tensor([1, 2, 2, 5, 9, 2])

    def run(read: bool):
        torch.manual_seed(4)
        emb = nn.Embedding(12, 3, sparse=not dense_table)
        lin = nn.Linear(3, 2)
        opts = build_optimizer_set(lin.parameters(), emb.parameters(), dense="fused_adamw",
                                   dense_options=dict(lr=1e-2), sparse_options=dict(lr=0.05))
        skipped = []
        for step in range(5):
            loss = lin(emb(ids + step % 2)).pow(2).mean() * (float("nan") if step == 2 else 1.0)
            with count_host_reads() as reads:
                info = train_step(loss, opts, max_grad_norm=1.0, skip_nonfinite=True, read=read)
            if not read:
                assert reads == [], reads
            skipped.append(bool(info["skipped"]))
        return [*lin.parameters(), emb.weight], opts, skipped

    host, host_opts, host_skipped = run(read=True)
    device, device_opts, device_skipped = run(read=False)
    assert host_skipped == device_skipped == [False, False, True, False, False]
    for a, b in zip(host, device, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    for p_host, p_device in zip(host[:2], device[:2], strict=True):
        state_host, state_device = host_opts.dense.state[p_host], device_opts.dense.state[p_device]
        assert float(state_device["step"]) == float(state_host["step"]) == 4.0
        torch.testing.assert_close(state_device["exp_avg_sq"], state_host["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(device_opts.sparse.state[device[2]]["sum"], host_opts.sparse.state[host[2]]["sum"],
                               rtol=1e-6, atol=1e-9)


def test_a_device_skip_needs_optimizers_that_can_skip_there():
    lin = nn.Linear(3, 1)
    opts = OptimizerSet(build_optimizer("adamw", lin.parameters()))
    with pytest.raises(OptimizerError, match="fused_adamw"):
        train_step(lin(torch.ones(1, 3)).sum(), opts, skip_nonfinite=True, read=False)
