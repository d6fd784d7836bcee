"""sparse_jacobian leaves a model's buffers as they were (SPEC §0: BatchNorm running
statistics), whatever route its "auto" takes and whatever its checks run: a module in
training mode that also draws random numbers (dropout) makes "auto"'s first check measure
the rounding of reverse products on one more call of f, and that call used to move the
running statistics for good."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3),
                               torch.nn.Dropout(0.3)).double().train()


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_csr],
                         ids=["strided", "csr"])
def test_a_training_model_with_dropout_keeps_its_running_statistics(layout):
    net = _net(0)
    bn = net[1]
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(1))
    x0 = x.clone()
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (auto's warnings: plain autograd, a random f)
        J = tv.sparse_jacobian(net, x, layout=layout)
    for name, value in net.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert bn.num_batches_tracked.item() == 0 and net.training and bn.training
    assert torch.equal(x, x0)
    # the Jacobian is that of the one call whose draws it holds: f's rows depend on its
    # dropout mask, and its entries are those of plain autograd's with the same draws
    torch.manual_seed(5)
    with torch.no_grad():
        kept = {k: v.clone() for k, v in net.state_dict().items()}
    ref = torch.autograd.functional.jacobian(net, x).reshape(12, 12)
    net.load_state_dict(kept)
    dense = J.to_dense() if layout != torch.strided else J
    assert dense.shape == (12, 12)
    torch.testing.assert_close(dense, ref)
