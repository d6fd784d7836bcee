"""jacobian_of called inside torch.func transforms (vmap, grad, jacrev, jacfwd) on a graph
built outside them: the Jacobian against torch.func.jacrev in float64, and the .grad of the
graph's tensors that retain theirs as it was."""

from __future__ import annotations

import torch

import torch_vjp as tv

D = torch.float64


def test_jacobian_of_inside_vmap_checks_a_new_graph_structure():
    # the first vectorised Jacobian of a graph structure is checked against one backward
    # pass with a random cotangent (NOTE [jacobian_of, checked once]); under torch.vmap's
    # default randomness='error' drawing it raised vmap's RuntimeError
    x = torch.rand(3, 5, dtype=D, requires_grad=True)
    y = torch.atan2(x, x.roll(1, 0) + 2).logsumexp(1)  # (a structure of its own)
    vs = torch.randn(2, 3, dtype=D)
    got = torch.vmap(lambda v: torch.einsum("o,oij->ij", v, tv.jacobian_of(
        y, x, retain_graph=True)))(vs)
    J = torch.func.jacrev(lambda t: torch.atan2(t, t.roll(1, 0) + 2).logsumexp(1))(
        x.detach())
    torch.testing.assert_close(got, torch.einsum("ko,oij->kij", vs, J), rtol=1e-12,
                               atol=1e-12)
