"""jacobian_of called inside torch.func transforms (vmap, grad, jacrev, jacfwd) on a graph
built outside them: the Jacobian against torch.func.jacrev in float64, and the .grad of the
graph's tensors that retain theirs as it was."""

from __future__ import annotations

import pytest
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


TRANSFORMS = [
    pytest.param(lambda fn: torch.func.grad(lambda v: fn(v).sum()), id="grad"),
    pytest.param(torch.func.jacrev, id="jacrev"),
    pytest.param(lambda fn: torch.func.jacfwd(fn, randomness="same"), id="jacfwd"),
    pytest.param(torch.vmap, id="vmap"),
]


@pytest.mark.parametrize("chunk_size", [None, 1, 2], ids=["one-chunk", "loop", "chunks-of-2"])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_jacobian_of_inside_a_transform_keeps_a_retaining_tensors_grad(transform, chunk_size):
    # h, inside the graph, retains its gradient (NOTE [retain_grad inside the graph]): it
    # was looked for outside transforms only, so inside one the vectorised products left a
    # batched tensor in h.grad (torch's INTERNAL ASSERT at the next pass) and the loop added
    # every row into it
    x = torch.rand(4, dtype=D, requires_grad=True)
    h = x.exp()
    h.retain_grad()
    y = (h * h).sin()
    y.sum().backward(retain_graph=True)
    before = h.grad
    copy = before.clone()

    def fn(v):
        return tv.jacobian_of(y, x, retain_graph=True, chunk_size=chunk_size) * v

    def ref(v):
        return torch.func.jacrev(lambda t: (t.exp() ** 2).sin())(x.detach()) * v

    v = torch.rand(4, 4, dtype=D) if transform is torch.vmap else torch.rand(4, dtype=D)
    torch.testing.assert_close(transform(fn)(v), transform(ref)(v), rtol=1e-12, atol=1e-12)
    assert not torch._C._functorch.is_batchedtensor(h.grad)
    assert torch.equal(h.grad, copy)
    y.sum().backward()  # (the user's own pass afterwards adds as it would have)
    torch.testing.assert_close(h.grad, 2 * copy, rtol=1e-12, atol=1e-12)
