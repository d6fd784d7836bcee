"""jacobian_of's checks of its inputs: a sparse or nested input is refused with the reason
and the fix, as torch_vjp.jacobian refuses such a primal, instead of failing inside."""

from __future__ import annotations

import re

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _sparse_coo():
    xs = torch.randn(3, 3, dtype=D).to_sparse().requires_grad_()
    return torch.sparse.sum(xs * 2, dim=1).to_dense(), xs, "inputs", "layout torch.sparse_coo"


def _sparse_csr_in_a_list():
    xc = torch.randn(3, 3, dtype=D).to_sparse_csr().requires_grad_()
    return xc.to_dense() * 2, [xc], "inputs[0]", "layout torch.sparse_csr"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make", [_sparse_coo, _sparse_csr_in_a_list], ids=["coo", "csr-list"])
def test_jacobian_of_refuses_a_sparse_input_with_the_fix(make):
    # a COO input failed inside with torch's "reshape is not implemented for sparse tensors"
    y, inputs, name, layout = make()
    with pytest.raises(tv.JacobianCallError, match=(
            rf"^torch_vjp\.jacobian_of: {re.escape(name)} is a sparse tensor \({layout}\); "
            r"Jacobians here \(as in torch\.func and torch_vjp\.jacobian\) are taken with "
            r"respect to dense \(strided\) tensors, whose elements are the Jacobian's "
            r"columns\.\n  Fix: compute the outputs from a dense tensor, d = "
            rf"{re.escape(name)}\.to_dense\(\)\.requires_grad_\(\) .* and pass d; or use "
            r"torch_vjp\.grad")):
        tv.jacobian_of(y, inputs)
    # the dense route the message names gives the Jacobian
    d = (inputs[0] if isinstance(inputs, list) else inputs).detach().to_dense()
    d.requires_grad_()
    J = tv.jacobian_of(d * 2, d)
    torch.testing.assert_close(J, 2 * torch.eye(9, dtype=D).reshape(3, 3, 3, 3))


def test_jacobian_of_refuses_a_nested_input():
    nt = torch.nested.nested_tensor([torch.randn(2, dtype=D), torch.randn(3, dtype=D)],
                                    layout=torch.jagged, requires_grad=True)
    with pytest.raises(tv.JacobianCallError, match=(
            r"^torch_vjp\.jacobian_of: inputs is a nested tensor; Jacobians here .* dense "
            r"\(strided\) tensors.*\n  Fix: compute the outputs from a dense tensor")):
        tv.jacobian_of((nt * 2).values().sum(0, keepdim=True), nt)
