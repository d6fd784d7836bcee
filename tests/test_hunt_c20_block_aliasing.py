"""Each Jacobian block handed to the user is its own memory, in every strategy: where f
returns one tensor twice, or a view of another of its outputs, forward mode's tangents of
those outputs share memory (torch.func.jacfwd returns such blocks as they are), and a write
into one block changed another (J["a"].mul_(2) doubled J["b"] too)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import torch_vjp as tv

D = torch.float64
STRATEGIES = ["auto", "rev", "fwd", "rev-loop", "fwd-loop"]


def _twice(x):
    y = x.sin()
    return (y, y)


def _view_beside(x):
    y = torch.outer(x, x).sin()
    return {"all": y, "row": y[1], "t": y.t()}


def _input_twice(x):
    return (x, x)


def _wide(x):  # (2 inputs, 24 outputs: "auto" picks forward mode)
    y = x.repeat(6).sin()
    return (y, y[:4])


CASES = {"same-output-twice": _twice, "views-of-one-output": _view_beside,
         "the-input-twice": _input_twice}


def _assert_independent(blocks, refs):
    for k, block in enumerate(blocks):
        torch.testing.assert_close(block, refs[k])
        before = [b.clone() for b in blocks]
        block.add_(1.0)
        for m, other in enumerate(blocks):
            want = before[m] + 1.0 if m == k else before[m]
            assert torch.equal(other, want), f"writing block {k} changed block {m}"
        block.sub_(1.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_jacobian_blocks_of_aliased_outputs_are_independent(case, strategy):
    f = CASES[case]
    x = torch.randn(3, dtype=D)
    _assert_independent(tree_leaves(tv.jacobian(f, x, strategy=strategy)),
                        tree_leaves(torch.func.jacrev(f)(x)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_and_argnums_blocks_of_aliased_outputs_are_independent(strategy):
    x = torch.randn(2, dtype=D)
    _assert_independent(tree_leaves(tv.jacobian(_wide, x, strategy=strategy)),
                        tree_leaves(torch.func.jacrev(_wide)(x)))
    f = lambda a, b: _twice(a * b)  # noqa: E731
    a, b = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    _assert_independent(
        tree_leaves(tv.jacobian(f, a, b, argnums=(0, 1), strategy=strategy)),
        tree_leaves(torch.func.jacrev(f, argnums=(0, 1))(a, b)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_jacobian_blocks_of_aliased_outputs_are_independent(strategy):
    x = torch.randn(4, 3, dtype=D)
    want = torch.vmap(torch.func.jacrev(_twice))(x)
    _assert_independent(tree_leaves(tv.batch_jacobian(_twice, x, strategy=strategy)),
                        tree_leaves(want))


def test_forward_blocks_are_still_views_where_nothing_is_shared():
    # (the copy is made for a shared output's block only: one output, one input, no copy)
    from torch_vjp._engine.blocks import fwd_blocks

    stacked = [torch.zeros(5, 3), torch.zeros(5, 2)]
    blocks, _ = fwd_blocks(stacked, [torch.Size([5])])
    assert blocks[0][0].data_ptr() == stacked[0].data_ptr()
    assert blocks[1][0].data_ptr() == stacked[1].data_ptr()
    shared = torch.zeros(5, 3)
    blocks, _ = fwd_blocks([shared, shared[:, 1:]], [torch.Size([5])])
    assert blocks[0][0].data_ptr() == shared.data_ptr()
    assert blocks[1][0].untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()
