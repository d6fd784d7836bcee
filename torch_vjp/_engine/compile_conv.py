"""A graph pass of ``compile=True``: a convolution's input gradient computed as the
transposed convolution it is.

NOTE [a convolution's input gradient, transposed]
A reverse-mode Jacobian through a convolution pulls its rows back with
``aten.convolution_backward`` asking for the input's gradient alone
(``output_mask=[True, False, False]``); inductor calls that operator as it is. On the CPU,
torch's backward kernel for a batch of rows is several times slower than the transposed
convolution that computes the same numbers (the input gradient of ``conv(x, w)`` is
``conv_transpose(g, w)`` with the same stride, padding, dilation and groups, and the
output padding that gives back ``x``'s size): for the suite's conv_input (10 rows through
two 3x3 convolutions), the two pull-backs took 220-330 us each as
``convolution_backward`` and 150-190 us as ``conv_transpose2d``, alone, 1 thread. So, while
inductor compiles torch_vjp's program (the backend of
:class:`~torch_vjp._engine.compile_checks.GraphPrecision`), :func:`conv_input_grads`
replaces each such node whose weight and bias gradients nothing asks for by
``aten.convolution`` with ``transposed=True``. Only the order of the sums changes (each
entry is the same sum of products).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

__all__ = ["conv_input_grads"]

aten = torch.ops.aten


@functools.cache
def conv_input_grads() -> Any:
    """Inductor's post-grad pass of NOTE [a convolution's input gradient, transposed] (a
    class made when a program is first compiled: inductor is imported then)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class ConvInputGrads(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op == "call_function" \
                        and node.target is aten.convolution_backward.default:
                    _transpose(graph, node)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return ConvInputGrads()


def _output_padding(grad: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor,
                    stride: Any, padding: Any, dilation: Any) -> list[int] | None:
    """The output padding with which the transposed convolution of ``grad`` has ``inp``'s
    size, or None where there is none (a size torch's transposed convolution cannot
    give, or a symbolic one)."""
    out = []
    try:
        for i in range(grad.dim() - 2):
            size = ((int(grad.shape[2 + i]) - 1) * stride[i] - 2 * padding[i]
                    + dilation[i] * (int(weight.shape[2 + i]) - 1) + 1)
            extra = int(inp.shape[2 + i]) - size
            if not 0 <= extra < max(stride[i], dilation[i]):
                return None
            out.append(extra)
    except (TypeError, IndexError):
        return None
    return out


def _transpose(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    if len(node.args) != 11 or node.kwargs:
        return
    grad, inp, weight, _, stride, padding, dilation, transposed, _, groups, mask = node.args
    if transposed or list(mask) != [True, False, False]:
        return
    users = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
               for u in users):
        return
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None
            for n in (grad, inp, weight)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return
    gv, iv, wv = vals
    if gv.dim() < 3 or gv.dtype != iv.dtype:
        return
    extra = _output_padding(gv, iv, wv, stride, padding, dilation)
    if extra is None:
        return
    args = (grad, weight, None, list(stride), list(padding), list(dilation), True, extra,
            groups)
    mode = getattr(gv, "fake_mode", None)
    if mode is None:
        return
    with mode:
        val = aten.convolution.default(gv, wv, None, *args[3:])
    if tuple(val.shape) != tuple(iv.shape):
        return
    with graph.inserting_before(node):
        new = graph.call_function(aten.convolution.default, args)
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    new.meta["val"] = val
    for u in users:
        u.replace_all_uses_with(new)
        graph.erase_node(u)
    graph.erase_node(node)
