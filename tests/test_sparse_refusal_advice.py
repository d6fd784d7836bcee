"""mode='fwd''s refusals explained with the fix that fits the case: a jvp staticmethod
for a custom autograd.Function only (a torch operator without a forward-mode formula has
none to give; the message said "give the Function a jvp staticmethod" for those too), a
dense tensor for a sparse constant, the math kernel for fused attention."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

_F64 = torch.float64


class _NoJvp(torch.autograd.Function):
    @staticmethod
    def forward(u):
        return u * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


_SPARSE = torch.eye(8, dtype=_F64).to_sparse()


def _margin(u):
    return torch.nn.functional.multi_margin_loss(u.view(2, 4), torch.tensor([0, 1])).reshape(1)


def _attention(u):
    q = u.view(1, 1, 2, 4)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q).reshape(-1)


_CASES = {
    # (f, what the message says was wrong, the fix besides reverse mode, or None)
    "torch_op": (_margin, "torch's aten::multi_margin_loss: torch has none for it", None),
    "custom_function": (lambda u: _NoJvp.apply(u), "a custom torch.autograd.Function "
                        "without a jvp staticmethod", "give the Function a jvp staticmethod"),
    "sparse_constant": (lambda u: _SPARSE @ u, "f multiplies by a sparse tensor",
                        "make that tensor a dense one"),
    "fused_attention": (_attention, "_scaled_dot_product_flash_attention_for_cpu",
                        "compute attention with the math kernel"),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_forward_modes_refusal_gives_the_fix_of_its_case(case):
    f, what, fix = _CASES[case]
    x = torch.randn(8, dtype=_F64, generator=torch.Generator().manual_seed(0))
    tv.sparse.clear_cache(f)
    with pytest.raises(NotImplementedError) as info:
        tv.sparse_jacobian(f, x, mode="fwd")
    assert isinstance(info.value, tv.TorchVJPError)
    msg = str(info.value)
    assert "mode='fwd' computes the products with forward-mode AD" in msg
    assert what in msg
    assert "torch said: NotImplementedError" in msg
    assert "Fix: mode='rev' or 'auto' (reverse mode needs only backward formulas)" in msg
    if fix is None:
        assert msg.rstrip().endswith("(reverse mode needs only backward formulas).")
        assert "staticmethod)." not in msg and "jvp staticmethod." not in msg
    else:
        assert f"formulas), or {fix}" in msg
    if case != "custom_function":
        assert "give the Function a jvp staticmethod" not in msg
