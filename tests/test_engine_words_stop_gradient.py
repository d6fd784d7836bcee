""""auto"'s warning where its reverse product disagrees with a forward product and a
central difference names the most common cause where f's graph holds no known wrong
operator: a part of f computed under torch.no_grad() (or torch.set_grad_enabled(False)),
which reverse mode treats as a constant and forward mode differentiates through (a
.detach()ed tensor is a constant to both). It says which
Jacobian "auto" returned and how to ask for the stop-gradient one (strategy='rev'), and
that choice gives torch.autograd's Jacobian. float64, against torch.func.jacrev and
torch.func.jvp columns."""

import pytest
import torch

import torch_vjp as tv

from _references import caught as _caught, central_difference as _fd, jvp_columns as _jvp_columns

D = torch.float64

# (each test sees its own first call of "auto": conftest's fresh_route_checks)
pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _no_grad_block(a):
    with torch.no_grad():
        s = a.sin()
    return a * s


def _no_grad_call(a):
    return a * torch.no_grad()(lambda: a.sin())()


def _grad_disabled(a):
    with torch.set_grad_enabled(False):
        s = a.cos()
    return a * s + a.exp()


@pytest.mark.parametrize("f", [_no_grad_block, _no_grad_call, _grad_disabled],
                         ids=["with_no_grad", "no_grad_call", "set_grad_enabled"])
def test_stop_gradient_is_named_and_rev_gives_the_autograd_jacobian(f):
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(5))
    full = _jvp_columns(f, x)
    torch.testing.assert_close(full, _fd(f, x))
    stopped = torch.func.jacrev(f)(x)
    assert (stopped - full).abs().max() > 0.1
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, full)
    told = [m for m in said if "disagrees with a forward product" in m]
    assert len(told) == 1, said
    msg = told[0]
    # what was found, the likely cause, what was returned, and how to choose
    assert "computed under torch.no_grad() (or torch.set_grad_enabled(False))" in msg
    assert "reverse mode treats that part as a constant" in msg
    assert "a central difference differentiate through it" in msg
    # (detach and inference-mode tensors stop forward mode too: not offered as causes)
    assert "is a constant to both modes, and is not the cause" in msg
    assert "strategy='auto' returned the Jacobian by forward mode" in msg
    assert ("on purpose, pass strategy='rev' for the stop-gradient Jacobian as "
            "torch.autograd computes it") in msg
    # (the cause given first; the wrong-backward causes stay as the alternatives)
    assert msg.index("torch.no_grad()") < msg.index("a backward formula in f does not match")
    # the suggested choice gives torch.autograd's Jacobian
    J_rev, said_rev = _caught(lambda: tv.jacobian(f, x, strategy="rev"))
    torch.testing.assert_close(J_rev, stopped)
    assert not [m for m in said_rev if "disagrees" in m], said_rev


def test_a_known_wrong_operator_is_still_named_without_the_guess():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=D, generator=g)

    def f(x):
        return torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, _jvp_columns(f, x))
    assert len(said) == 1, said
    msg = said[0]
    assert "(torch's for torch.as_strided_scatter)" in msg
    assert "torch.no_grad()" not in msg and "stop-gradient" not in msg
