""""auto"'s warning where its reverse product disagrees with a forward product and a
central difference (NOTE [a reverse product checked forward]) says what was found, and
names an operator only where f's graph holds one whose backward torch computes wrongly: a
write at a repeated index that does not accumulate is not blamed on
torch.as_strided_scatter. float64, against torch.func.jvp columns and finite differences."""

import pytest
import torch

import torch_vjp as tv

from _references import caught as _caught, central_difference as _fd, jvp_columns as _jvp_columns

D = torch.float64


# (each test sees its own first call of "auto": conftest's fresh_route_checks)
pytestmark = pytest.mark.usefixtures("fresh_route_checks")


_IDX = torch.tensor([0, 2, 0, 1])


def _index_put(x):
    return torch.zeros(3, dtype=x.dtype).index_put((_IDX,), x) * 2.0


def _setitem(x):
    out = torch.zeros(3, dtype=x.dtype)
    out[_IDX] = x.sin()
    return out


def _scatter(x):
    return torch.zeros(3, dtype=x.dtype).scatter(0, _IDX, x * x)


def _index_copy(x):
    return torch.zeros(3, dtype=x.dtype).index_copy(0, _IDX, x.exp())


@pytest.mark.parametrize("f", [_index_put, _setitem, _scatter, _index_copy],
                         ids=["index_put", "setitem", "scatter", "index_copy"])
def test_repeated_index_write_is_not_blamed_on_as_strided_scatter(f):
    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    want = _jvp_columns(f, x)
    torch.testing.assert_close(want, _fd(f, x))
    # (torch's backward gives both duplicates the gradient: reverse mode differs)
    assert (torch.func.jacrev(f)(x) - want).abs().max() > 0.1
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, want)
    told = [m for m in said if "disagrees with a forward product" in m]
    assert len(told) == 1, said
    msg = told[0]
    assert "as_strided_scatter" not in msg
    assert "and a central difference" in msg
    assert "a write at a repeated index that does not accumulate" in msg
    assert "an operator whose backward torch computes wrongly" in msg
    assert "strategy='auto' returned the Jacobian by forward mode" in msg
    assert "Pass strategy='fwd'" in msg


def test_as_strided_scatter_is_still_named():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=D, generator=g)

    def f(x):
        return torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = _jvp_columns(f, x)
    torch.testing.assert_close(want, _fd(f, x))
    J, said = _caught(lambda: tv.jacobian(f, x))
    torch.testing.assert_close(J, want)
    assert len(said) == 1, said
    msg = said[0]
    assert ("an operator in f has a wrong backward formula (torch's for "
            "torch.as_strided_scatter)") in msg
    assert "repeated index" not in msg
    assert "Pass strategy='fwd-loop'" in msg
