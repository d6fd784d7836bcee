"""compile=True's products with the standard basis, read off instead of multiplied
(torch_vjp/_engine/basis_fold.py; NOTE [the basis folded]).

Every result is checked in float64 against torch.func.jacrev; the compiled graphs are read
after inductor's post-grad passes, so that what was folded is counted, not assumed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.config as inductor_config

import torch_vjp as tv
from torch_vjp._engine import basis_fold, compiled

D = torch.float64
aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _products(call):
    """``call()``'s result, and the number of ``mm`` and ``bmm`` nodes of each graph it
    compiled."""
    seen = []

    def record(graph):  # (a pass without uuid: inductor's graph cache is not used)
        seen.append(sum(n.target in (aten.mm.default, aten.bmm.default)
                        for n in graph.nodes))

    with inductor_config.patch(post_grad_custom_post_pass=record):
        result = call()
    return result, seen


def _weights(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, dtype=D, generator=g) for s in shapes]


def test_the_basis_products_of_a_first_and_last_layer_are_read_off(monkeypatch):
    # (fwd: the basis times W.T, and the products of W's and V's zero tangents; without the
    # fold inductor multiplied each: 5 products where the Jacobian needs 2 besides f's own)
    W, V = _weights((16, 6), (5, 16))
    x = torch.randn(6, dtype=D)
    f = lambda x: V @ torch.tanh(W @ x)  # noqa: E731
    got, folded = _products(lambda: tv.jacobian(f, x, strategy="fwd", compile=True))
    torch.testing.assert_close(got, torch.func.jacrev(f)(x))
    monkeypatch.setattr(basis_fold.BasisFold, "__call__", lambda self, graph: None)
    g = lambda x: V @ torch.tanh(W @ x)  # noqa: E731  (its own entry)
    same, unfolded = _products(lambda: tv.jacobian(g, x, strategy="fwd", compile=True))
    torch.testing.assert_close(same, got)
    assert len(folded) == len(unfolded) == 1
    assert unfolded[0] - folded[0] >= 1 and folded[0] <= 3, (folded, unfolded)


@pytest.mark.parametrize("strategy", ["fwd", "rev"])
def test_the_basis_product_of_a_batch_jacobian_is_read_off(monkeypatch, strategy):
    # (the basis, repeated over the batch, times W.T (fwd) or V (rev): a bmm of B copies
    # of one product)
    W, V = _weights((16, 6), (5, 16))
    x = torch.randn(8, 6, dtype=D)
    f = lambda x: torch.tanh(x @ W.T) @ V.T  # noqa: E731
    got, folded = _products(lambda: tv.batch_jacobian(f, x, strategy=strategy, compile=True))
    torch.testing.assert_close(
        got, torch.func.vmap(torch.func.jacrev(lambda r: V @ torch.tanh(W @ r)))(x))
    monkeypatch.setattr(basis_fold.BasisFold, "__call__", lambda self, graph: None)
    g = lambda x: torch.tanh(x @ W.T) @ V.T  # noqa: E731  (its own entry)
    same, unfolded = _products(lambda: tv.batch_jacobian(g, x, strategy=strategy,
                                                         compile=True))
    torch.testing.assert_close(same, got)
    assert len(folded) == len(unfolded) == 1
    assert unfolded[0] - folded[0] >= 1, (folded, unfolded)


@pytest.mark.parametrize("strategy", ["fwd", "rev"])
@pytest.mark.parametrize("form", ["W @ x", "x @ W.T", "two inputs", "batch"])
def test_folded_jacobians_equal_jacrev(strategy, form):
    W, V, b = _weights((7, 5), (7, 3), (7,))
    if form == "W @ x":
        f, args, argnums = (lambda x: torch.sin(W @ x + b)), (torch.randn(5, dtype=D),), 0
    elif form == "x @ W.T":
        f, args, argnums = (lambda x: torch.sin(x @ W.T) @ W), (torch.randn(5, dtype=D),), 0
    elif form == "two inputs":  # (shifted identities: the second input's rows start at 5)
        f, args, argnums = ((lambda x, y: torch.tanh(W @ x + V @ y)),
                            (torch.randn(5, dtype=D), torch.randn(3, dtype=D)), (0, 1))
    else:
        f, args, argnums = (lambda x: torch.tanh(x @ W.T)), (torch.randn(4, 5, dtype=D),), 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            args = tuple(a + 0.1 for a in args)
            got = tv.jacobian(f, *args, argnums=argnums, strategy=strategy, compile=True)
            torch.testing.assert_close(got, torch.func.jacrev(f, argnums=argnums)(*args))
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


@pytest.mark.parametrize("strategy", ["fwd", "rev"])
def test_chunks_of_the_basis_fold_with_their_offsets(strategy):
    # (chunks of 2 rows: each chunk's basis is a shifted, partly empty identity, its product
    # the operand's rows or columns at an offset, zero-padded)
    W, V = _weights((6, 5), (5, 6))
    f = lambda x, y: torch.tanh(W @ x) * torch.sin(V @ y).sum()  # noqa: E731
    x, y = torch.randn(5, dtype=D), torch.randn(6, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = tv.jacobian(f, x, y, argnums=(0, 1), strategy=strategy, chunk_size=2,
                          compile=True)
    for a, b in zip(got, torch.func.jacrev(f, argnums=(0, 1))(x, y)):
        torch.testing.assert_close(a, b)


def test_a_nan_weight_compiles_unfolded_and_agrees_with_eager():
    # (rev: the basis times W. Folded, W[1, 2] = NaN reaches fewer entries than eager's
    # product, where 0 * NaN is NaN: the first call's comparison rebuilds the program
    # unfolded, which agrees, and the entry is compiled: no warning)
    W = torch.randn(3, 3, dtype=D)
    W[1, 2] = float("nan")
    f = lambda x: W @ torch.tanh(x)  # noqa: E731
    before = compiled.builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(3):
            x = torch.randn(3, dtype=D)
            got = tv.jacobian(f, x, strategy="rev", compile=True)
            torch.testing.assert_close(got, tv.jacobian(f, x, strategy="rev"), equal_nan=True)
            assert got.isnan().any()
    assert compiled.builds() - before == 1
    assert [e.run is not None for e in compiled._CACHE.values()] == [True]


def test_shifted_eye_reads_only_comparisons_of_two_ranges():
    def graph_of(make):
        g = torch.fx.Graph()
        node = make(g)
        g.output(node)
        return g, node

    def iota(g, n, start, dim):
        node = g.call_function(torch.ops.prims.iota.default, (n,),
                               {"start": start, "step": 1, "dtype": torch.int64,
                                "device": torch.device("cpu"), "requires_grad": False})
        node.meta["val"] = torch.empty(n, dtype=torch.int64, device="meta")
        out = g.call_function(aten.unsqueeze.default, (node, dim))
        out.meta["val"] = node.meta["val"].unsqueeze(dim)
        return out

    def eye(g, c, s, m, o):
        a, b = iota(g, c, s, 1), iota(g, m, o, 0)
        node = g.call_function(aten.eq.Tensor, (a, b))
        node.meta["val"] = torch.empty(c, m, dtype=torch.bool, device="meta")
        return node

    _, node = graph_of(lambda g: eye(g, 4, 2, 6, 0))
    assert basis_fold.shifted_eye(node) == (4, 6, 2)

    def transposed(g):
        node = g.call_function(aten.permute.default, (eye(g, 4, 0, 6, 3), [1, 0]))
        node.meta["val"] = torch.empty(6, 4, dtype=torch.bool, device="meta")
        return node

    _, node = graph_of(transposed)
    assert basis_fold.shifted_eye(node) == (6, 4, 3)

    def less(g):  # (not an equality: a triangle, not a basis)
        a, b = iota(g, 4, 0, 1), iota(g, 4, 0, 0)
        node = g.call_function(aten.lt.Tensor, (a, b))
        node.meta["val"] = torch.empty(4, 4, dtype=torch.bool, device="meta")
        return node

    _, node = graph_of(less)
    assert basis_fold.shifted_eye(node) is None


def _basis_graph(c, s, m, o, shape, w_shape, transposed=False, batch=None):
    """A graph of ``mm`` (or ``bmm``) with the basis ``E[r, j] = (s + r == o + j)`` as its
    first operand (second where ``transposed``), repeated over ``batch`` and reshaped to
    ``shape`` where given, and a weight placeholder of ``w_shape``."""
    g = torch.fx.Graph()
    w = g.placeholder("w")
    w.meta["val"] = torch.empty(w_shape, dtype=D)

    def add(target, args, kwargs=None):
        node = g.call_function(target, args, kwargs or {})
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        node.meta["val"] = target(*vals, **(kwargs or {}))
        return node

    def iota(n, start, dim):
        node = add(torch.ops.prims.iota.default, (n,),
                   {"start": start, "step": 1, "dtype": torch.int64,
                    "device": torch.device("cpu"), "requires_grad": False})
        return add(aten.unsqueeze.default, (node, dim))

    e = add(aten.eq.Tensor, (iota(c, s, 1), iota(m, o, 0)))
    e = add(torch.ops.prims.convert_element_type.default, (e, D))
    if batch is not None:
        e = add(aten.expand.default, (add(aten.unsqueeze.default, (e, 1)), [c, batch, m]))
    if shape is not None:
        e = add(aten.reshape.default, (e, list(shape)))
    if transposed:
        out = add(aten.mm.default, (w, add(aten.permute.default, (e, [1, 0]))))
    elif e.meta["val"].dim() == 3:
        out = add(aten.bmm.default, (e, add(aten.expand.default, (w, [c, *w_shape]))))
    else:
        out = add(aten.mm.default, (e, w))
    g.output(out)
    return g


@pytest.mark.parametrize("case", [
    dict(c=4, s=0, m=4, o=0, shape=None, w_shape=(4, 3)),  # the identity
    dict(c=2, s=2, m=5, o=0, shape=None, w_shape=(5, 3)),  # a chunk of rows 2, 3
    dict(c=5, s=0, m=3, o=2, shape=None, w_shape=(3, 3)),  # a second input's rows
    dict(c=3, s=2, m=4, o=0, shape=None, w_shape=(4, 2)),  # a chunk over the end
    dict(c=4, s=1, m=4, o=0, shape=None, w_shape=(2, 4), transposed=True),
    dict(c=3, s=0, m=3, o=0, shape=None, w_shape=(3, 4), batch=2),  # bmm, repeated
    dict(c=3, s=0, m=3, o=0, shape=(6, 3), w_shape=(3, 4), batch=2),  # mm, rows in order
    dict(c=3, s=0, m=3, o=0, shape=(3, 6), w_shape=(6, 4), batch=2),  # (not the rows)
    dict(c=4, s=0, m=8, o=0, shape=(16, 2), w_shape=(2, 3)),  # (a basis split: not one)
])
def test_the_folded_graph_computes_what_the_product_did(case):
    w = torch.randn(case["w_shape"], dtype=D)
    graph = _basis_graph(**case)
    want = torch.fx.GraphModule(torch.nn.Module(), graph)(w)
    before = sum(n.target in (aten.mm.default, aten.bmm.default) for n in graph.nodes)
    basis_fold.BasisFold()(graph)
    graph.lint()
    after = sum(n.target in (aten.mm.default, aten.bmm.default) for n in graph.nodes)
    got = torch.fx.GraphModule(torch.nn.Module(), graph)(w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    folds = case.get("shape") not in ((3, 6), (16, 2))
    assert (before, after) == ((1, 0) if folds else (1, 1))
