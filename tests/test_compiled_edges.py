"""compile=True at the edges of what tests/test_compiled.py covers (NOTE [compiled
Jacobians] in torch_vjp/_engine/compiled.py): every result in float64 against torch.func,
and what a call leaves of the user's tensors and modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine import compiled

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class _Stats(torch.nn.Module):
    """A module whose training-mode forward updates running statistics in a kernel (no
    version bump eagerly, one compiled), as BatchNorm's do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rm", torch.zeros(3, dtype=D))
        self.register_buffer("rv", torch.ones(3, dtype=D))

    def forward(self, x):
        return F.batch_norm(x, self.rm, self.rv, training=True).sin()


@pytest.mark.parametrize("call,strategy", [("jacobian", "rev"), ("jacobian", "fwd"),
                                           ("hessian", "auto")])
def test_a_training_module_passed_as_an_argument_keeps_its_buffers(call, strategy):
    # (f(x, m) with argnums=0: the module is reached only through an argument, and the eager
    # call puts its buffers back; so must the first compiled run and every later call)
    m = _Stats()

    def f(x, m):
        return m(x) if call == "jacobian" else m(x).sum()

    def ref(x):
        out = torch.func.functional_call(m, {"rm": m.rm.clone(), "rv": m.rv.clone()}, (x,))
        return out if call == "jacobian" else out.sum()

    for i in range(3):
        x = torch.randn(4, 3, dtype=D) + i
        got = getattr(tv, call)(f, x, m, argnums=0, strategy=strategy, compile=True)
        want = (torch.func.jacrev if call == "jacobian" else torch.func.hessian)(ref)(x)
        torch.testing.assert_close(got, want)
        assert torch.equal(m.rm, torch.zeros(3, dtype=D)), i
        assert torch.equal(m.rv, torch.ones(3, dtype=D)), i
    (entry,) = compiled._CACHE.values()
    assert entry.run is not None
