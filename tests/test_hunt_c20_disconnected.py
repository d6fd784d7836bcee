"""The disconnection check (checked mode) in reverse mode, where an output requires grad
through a tensor f made itself with requires_grad=True rather than through the input: its
all-zero Jacobian block is not the derivative, and reverse mode must say so as forward
mode does (NOTE [the disconnection check])."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64

_MESSAGE = (r"the output of f does not depend on primals\[0\] through autograd, although "
            r"its value changes when primals\[0\] changes: its Jacobian block is all zeros, "
            r"which is not its derivative")


def _own_leaf(x):
    # (a weight made inside f, with requires_grad=True, times the input's values detached)
    return torch.ones(x.shape, dtype=x.dtype, requires_grad=True) * x.detach()


def _force(x):
    # the force-field idiom: the energy's gradient with respect to a fresh leaf made from
    # the input's values; its Jacobian through autograd is zeros, its derivative the
    # energy's Hessian
    with torch.enable_grad():
        p = x.detach().requires_grad_()
        energy = (p.sin() * p.cumsum(0)).sum()
        return torch.autograd.grad(energy, p, create_graph=True)[0]


def _jacobian_warnings(call):
    with warnings.catch_warnings(record=True) as caught, tv.checked():
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught
                    if issubclass(w.category, tv.JacobianWarning)]


@pytest.mark.parametrize("f, strategy", [
    (_own_leaf, "auto"), (_own_leaf, "rev"), (_own_leaf, "rev-loop"),
    (_force, "auto"), (_force, "rev-loop"),
    # (forward mode warned already: a tangent does not reach the fresh leaf)
    (_own_leaf, "fwd"), (_force, "fwd-loop"),
], ids=["own-leaf-auto", "own-leaf-rev", "own-leaf-rev-loop", "force-auto",
        "force-rev-loop", "own-leaf-fwd", "force-fwd-loop"])
def test_a_zero_block_through_a_leaf_f_made_is_warned_in_every_mode(f, strategy):
    x = torch.randn(4, dtype=D)
    J, messages = _jacobian_warnings(lambda: tv.jacobian(f, x, strategy=strategy))
    # the Jacobian itself is what autograd gives (torch.func's too): zeros
    torch.testing.assert_close(J, torch.zeros(4, 4, dtype=D))
    assert any(re_search(_MESSAGE, m) for m in messages), messages


def test_batch_jacobian_warns_for_a_leaf_f_made():
    x = torch.randn(3, 4, dtype=D)
    J, messages = _jacobian_warnings(lambda: tv.batch_jacobian(_own_leaf, x, strategy="rev"))
    torch.testing.assert_close(J, torch.zeros(3, 4, 4, dtype=D))
    assert any("the output of f does not depend on x through autograd" in m
               for m in messages), messages


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_an_output_connected_to_the_input_beside_a_leaf_f_made_is_not_warned(strategy):
    # the fresh leaf makes the output require grad, and the input reaches it too: its
    # block is the derivative, non-zero, and nothing is said, on any call
    x = torch.randn(4, dtype=D)

    def f(x):
        return torch.full(x.shape, 2.0, dtype=x.dtype, requires_grad=True) * x.sin()

    for _ in range(2):
        J, messages = _jacobian_warnings(lambda: tv.jacobian(f, x, strategy=strategy))
        torch.testing.assert_close(J, torch.diag(2 * x.cos()))
        assert not [m for m in messages if "through autograd" in m], messages


def re_search(pattern, text):
    import re

    return re.search(pattern, text) is not None
