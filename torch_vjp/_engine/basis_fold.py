"""A graph pass of ``compile=True``: products with the standard basis, read off instead of
multiplied.

NOTE [the basis folded]
A Jacobian's products start from the standard basis (NOTE [a basis inductor fuses] in
:mod:`torch_vjp._engine.forms`), and the first linear layer ``f`` meets turns it into a
matrix product: ``jacfwd`` of ``x @ W.T`` multiplies the ``n x n`` basis by ``W.T``,
``jacrev`` of ``h @ W.T`` multiplies the ``m x m`` basis by ``W``. Inductor hands such
products to the BLAS kernel like any other, so the compiled program spends as much time
multiplying by the identity as on the layer's real product: for a 1024 -> 256 -> 256 -> 1024
MLP, a third of its arithmetic. XLA does not: it knows the product's answer.

While inductor compiles torch_vjp's program (the backend of
:class:`~torch_vjp._engine.compile_checks.GraphPrecision`), :class:`BasisFold` finds each
``mm`` with an operand that is, by construction, a shifted identity (the comparison of two
``arange`` ranges that :func:`~torch_vjp._engine.rows.basis_rows` writes under dynamo,
reshaped or cast but not otherwise changed) and puts in its place the rows (or columns) of
the other operand it selects, zero-padded where the basis rows lie outside the operand:
``E @ B`` with ``E[r, j] = (j == r + d)`` is ``B[r + d]`` where ``0 <= r + d < m``, else 0.

This is exact where the other operand is finite. Where it holds an infinity or NaN, the
product has NaN in entries the selection leaves finite (``0 * inf``), so the two differ; the
first call's comparison with the eager result then sends that signature to eager, with a
warning (NOTE [compiled Jacobians] in :mod:`torch_vjp._engine.compiled`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["BasisFold", "shifted_eye"]

aten = torch.ops.aten
_SAME_DATA = {  # ops that keep a tensor's elements in order (or cast them)
    aten.reshape.default, aten.view.default, aten._unsafe_view.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    torch.ops.prims.convert_element_type.default,
}


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except TypeError:  # (a symbolic size)
        return None


def _source(node: Any) -> Any:
    """The node ``node`` reshapes or casts, back to the first that does something else."""
    while isinstance(node, torch.fx.Node) and node.target in _SAME_DATA:
        node = node.args[0]
    return node


def _range(node: Any) -> tuple[int, int] | None:
    """``(start, length)`` where ``node`` is ``arange(start, start + length)`` (step 1),
    reshaped only."""
    node = _source(node)
    if not (isinstance(node, torch.fx.Node)
            and node.target is torch.ops.prims.iota.default):
        return None
    length = node.args[0]
    start, step = node.kwargs.get("start"), node.kwargs.get("step")
    if not all(type(v) is int for v in (length, start, step)) or step != 1:
        return None
    return start, length


def shifted_eye(node: Any) -> tuple[int, int, int] | None:
    """``(c, m, d)`` where ``node`` is the ``c x m`` matrix ``E[r, j] = (j == r + d)``, by
    construction (a comparison of a column of ``arange`` with a row of ``arange``, reshaped
    or cast); else None."""
    shape = _shape(node)
    if shape is None or len(shape) != 2:
        return None
    if (isinstance(node, torch.fx.Node) and node.target is aten.permute.default
            and list(node.args[1]) == [1, 0]):  # (the transpose: E[j, r] = (r == j + d))
        inner = shifted_eye(node.args[0])
        return None if inner is None else (inner[1], inner[0], -inner[2])
    eq = _source(node)
    if not (isinstance(eq, torch.fx.Node) and eq.target is aten.eq.Tensor
            and len(eq.args) == 2 and _shape(eq) == shape):
        return None
    c, m = shape
    sides = {}
    for arg in eq.args:
        found, arg_shape = _range(arg), _shape(arg)
        if found is None:
            return None
        if arg_shape == (c, 1) and found[1] == c:
            sides["row"] = found[0]
        elif arg_shape == (1, m) and found[1] == m:
            sides["col"] = found[0]
    if len(sides) != 2:
        return None
    return c, m, sides["row"] - sides["col"]


def _is_zero(node: Any) -> bool:
    """Whether ``node`` is zeros by construction: ``full(..., 0)``, expanded or reshaped."""
    while isinstance(node, torch.fx.Node) and node.target in (*_SAME_DATA,
                                                              aten.expand.default):
        node = node.args[0]
    return (isinstance(node, torch.fx.Node) and node.target is aten.full.default
            and len(node.args) == 2 and type(node.args[1]) in (int, float)
            and node.args[1] == 0)


def _pick(graph: torch.fx.Graph, at: torch.fx.Node, eye: tuple[int, int, int],
          other: torch.fx.Node, dim: int) -> torch.fx.Node | None:
    """Nodes, inserted before ``at``, computing ``E @ other`` (``dim`` 0) or ``other @ E``
    (``dim`` 1) for ``E`` the shifted identity ``eye`` describes, without a product; None
    where no row of ``E`` meets ``other``."""
    c, m, d = eye
    if dim == 0:  # E @ B: row r of the result is row r + d of B
        n, lo, hi, before = c, max(d, 0), min(m, c + d), max(-d, 0)
    else:  # A @ E: column j of the result is column j - d of A
        n, lo, hi, before = m, max(-d, 0), min(c, m - d), max(d, 0)
    shape = _shape(other)
    if hi <= lo or shape is None or len(shape) != 2:
        return None
    after = n - before - (hi - lo)
    with graph.inserting_before(at):
        picked = other
        if (lo, hi) != (0, shape[dim]):
            picked = graph.call_function(aten.slice.Tensor, (picked, dim, lo, hi))
            _meta(picked)
        if before or after:
            pad = [before, after] if dim == 1 else [0, 0, before, after]
            picked = graph.call_function(aten.constant_pad_nd.default, (picked, pad, 0.0))
            _meta(picked)
    return picked


def _contiguous(graph: torch.fx.Graph, at: torch.fx.Node, node: torch.fx.Node
                ) -> torch.fx.Node:
    """``node`` in a buffer of its own, as the product it replaces wrote one."""
    with graph.inserting_before(at):
        out = graph.call_function(aten.clone.default, (node,),
                                  {"memory_format": torch.contiguous_format})
    _meta(out)
    return out


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node) -> bool:
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return True


def _fold(graph: torch.fx.Graph, mm: torch.fx.Node) -> bool:
    a, b = mm.args[:2]
    val = mm.meta.get("val")
    if (_is_zero(a) or _is_zero(b)) and isinstance(val, torch.Tensor) and _shape(mm):
        with graph.inserting_before(mm):  # (a tangent that is zero: a weight not varied)
            zeros = graph.call_function(aten.full.default, (list(_shape(mm)), 0.0),
                                        {"dtype": val.dtype, "device": val.device})
        zeros.meta["val"] = val.new_zeros(val.shape)
        return _replace(graph, mm, zeros)
    eye, picked = shifted_eye(a), None
    if eye is not None:
        picked = _pick(graph, mm, eye, b, 0)
    elif (eye := shifted_eye(b)) is not None:
        picked = _pick(graph, mm, eye, a, 1)
    else:
        return _fold_repeated(graph, mm)
    if picked is None:
        return False
    return _replace(graph, mm, _contiguous(graph, mm, picked))


def _repeated_eye(node: Any) -> tuple[tuple[int, int, int], int] | None:
    """``(eye, B)`` where ``node`` is a shifted identity ``E`` (:func:`shifted_eye`'s
    ``eye``) repeated over a batch, ``A[k, b] = E[k]`` of shape ``(c, B, m)`` (a copy of it
    too, as forward mode's tangents under vmap are); else None."""
    shape = _shape(node)
    if shape is None or len(shape) != 3:
        return None
    while isinstance(node, torch.fx.Node) and (
            node.target is aten.expand.default
            or (node.target is aten.copy.default and _shape(node.args[1]) == shape)):
        node = node.args[0] if node.target is aten.expand.default else node.args[1]
    if not (isinstance(node, torch.fx.Node) and node.target is aten.unsqueeze.default
            and node.args[1] == 1):
        return None
    eye = shifted_eye(node.args[0])
    return (eye, shape[1]) if eye is not None and shape == (eye[0], shape[1], eye[1]) else None


def _repeat(graph: torch.fx.Graph, at: torch.fx.Node, rows: torch.fx.Node, batch: int,
            shape: tuple[int, ...]) -> torch.fx.Node:
    """``rows`` (``(c, n)``) repeated over a batch, ``(c, batch, n)``, as ``shape``."""
    c, n = _shape(rows)  # type: ignore[misc]
    with graph.inserting_before(at):
        out = graph.call_function(aten.unsqueeze.default, (rows, 1))
        _meta(out)
        out = graph.call_function(aten.expand.default, (out, [c, batch, n]))
        _meta(out)
        if tuple(shape) != (c, batch, n):
            out = graph.call_function(aten.reshape.default, (out, list(shape)))
            _meta(out)
    return _contiguous(graph, at, out)


def _fold_repeated(graph: torch.fx.Graph, mm: torch.fx.Node) -> bool:
    """``bmm(A, B)`` where ``A`` is the basis repeated over a batch (as batch_jacobian's
    rows are) and ``B[k] = W`` (one matrix for every basis row); or ``mm(A', W)`` where
    ``A'`` is such an ``A`` reshaped to ``(c * B, m)``. Row ``k`` of each batch is row
    ``k`` of ``E @ W``, which :func:`_pick` reads off."""
    a, b = mm.args[:2]
    shape = _shape(mm)
    if shape is None or not isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
        return False
    if mm.target is aten.bmm.default:
        found = _repeated_eye(a)
        w = b.args[0] if b.target is aten.expand.default else None
        if found is None or _shape(w) != _shape(b)[1:]:  # type: ignore[index]
            return False
    else:
        found = _repeated_eye(a.args[0]) if a.target in _SAME_DATA else None
        w = b
    if found is None or (mm.target is aten.mm.default
                         and _shape(a) != (found[0][0] * found[1], found[0][1])):
        return False  # (an mm: the rows of the repeated basis, (c * B, m), in order)
    eye, batch = found
    picked = _pick(graph, mm, eye, w, 0)
    if picked is None:
        return False
    return _replace(graph, mm, _repeat(graph, mm, picked, batch, shape))


def _meta(node: torch.fx.Node) -> None:
    """``node.meta["val"]``, from its arguments' (fake tensors: no arithmetic runs)."""
    args = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args)
    node.meta["val"] = node.target(*args, **node.kwargs)


class BasisFold(CustomGraphPass):
    """Inductor's post-grad pass of NOTE [the basis folded]."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        folded = False
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is aten.mm.default:
                folded = _fold(graph, node) or folded
            elif node.op == "call_function" and node.target is aten.bmm.default:
                folded = _fold_repeated(graph, node) or folded
        if folded:
            graph.eliminate_dead_code()

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
