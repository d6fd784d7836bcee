"""jacobian_of's result holds storage of its own size: no row beyond the Jacobian's (a zero
row once put before the first chunk's, to find the tensors that retain their gradient) is
kept alive by a one-chunk result. float64, against a loop of torch.autograd.grad."""
import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _grad_rows(y, x):
    rows = [torch.autograd.grad(y.reshape(-1)[i], x, retain_graph=True)[0].reshape(-1)
            for i in range(y.numel())]
    return torch.stack(rows).reshape(*y.shape, *x.shape)


@pytest.mark.parametrize("n", [3, 16])
def test_a_one_chunk_result_owns_compact_storage(n):
    W = torch.randn(n, 5, dtype=D, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, dtype=D, requires_grad=True)
    y = torch.tanh(W @ x)
    J = tv.jacobian_of(y, x)
    torch.testing.assert_close(J, _grad_rows(y, x))
    assert J.untyped_storage().nbytes() == J.numel() * J.element_size()


def test_compact_storage_with_a_tensor_retaining_its_gradient_inside():
    x = torch.randn(4, dtype=D, requires_grad=True)
    h = x * 2.0
    h.retain_grad()
    G = torch.arange(4.0, dtype=D)
    h.grad = G.clone()
    y = h.sin()
    J = tv.jacobian_of(y, x)
    assert torch.equal(h.grad, G)
    assert J.untyped_storage().nbytes() == J.numel() * J.element_size()
    torch.testing.assert_close(J, _grad_rows(y, x))  # (its passes add to h.grad)


def test_several_inputs_each_own_compact_storage():
    x = torch.randn(3, dtype=D, requires_grad=True)
    z = torch.randn(2, dtype=D, requires_grad=True)
    y = torch.cat([x.sin(), z.exp()]) * x.sum()
    Jx, Jz = tv.jacobian_of(y, [x, z])
    torch.testing.assert_close(Jx, _grad_rows(y, x))
    torch.testing.assert_close(Jz, _grad_rows(y, z))
    for J in (Jx, Jz):
        assert J.untyped_storage().nbytes() == J.numel() * J.element_size()
