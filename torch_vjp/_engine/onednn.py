"""A graph pass of ``compile=True``: float32 matrix products on the CPU by oneDNN's kernel
where it is the faster one on this machine.

NOTE [oneDNN products]
Once the basis is folded (NOTE [the basis folded] in :mod:`torch_vjp._engine.basis_fold`),
a compiled Jacobian of an MLP spends most of its time in ``mm``. Inductor hands a CPU
``mm`` to ``aten.mm``, which runs MKL's ``sgemm``; on some processors (AMD's among them) MKL
takes a generic code path, and oneDNN's kernel for the same product
(``mkldnn._linear_pointwise``, which torch's own ``Linear`` fusion in inductor calls) runs
about twice as fast: 1.19 ms against 2.77 ms for a 1024 x 256 by 256 x 1024 product on 2
cores of an AMD EPYC, and the compiled Jacobian of the 1024 -> 256 -> 256 -> 1024 MLP in
2.10 ms against 4.12 (benchmarks/bench_onednn.py). Inductor uses that kernel only for a
product with a constant weight (a frozen model), which a Jacobian's products are not.

So, where :func:`faster_here` found oneDNN the faster of the two on this machine (one
measurement per process, on the first compiled program), :class:`OneDnnProducts`, an
inductor post-grad pass, puts ``torch_vjp::mm`` (and ``torch_vjp::addmm``, with a bias
vector) in place of each float32 CPU ``mm`` large enough for it to pay (:data:`MIN_WORK`
multiply-adds; under it the kernel's fixed cost of about 10 us loses, as
benchmarks/bench_onednn.py shows); elsewhere nothing changes. The result is the same product in float32, rounded as another blocking of the
sum rounds it; the first call's comparison with the eager result allows for float32
rounding (:func:`~torch_vjp._engine.compile_checks.results_agree`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["OneDnnProducts", "faster_here", "MIN_WORK"]

aten = torch.ops.aten

#: The least ``m * k * n`` of a product the pass hands to oneDNN, and the least ``m`` and
#: ``n``: a smaller one (a row vector by a matrix) is faster in ``aten.mm``.
MIN_WORK = 1 << 20
MIN_SIDE = 8

_LOCK = threading.Lock()
_FASTER: bool | None = None
_OPS: Any = None


def _linear(a: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """``a @ w.T + bias`` by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a, w, bias, "none", [], "")


def _ops() -> Any:
    """``torch.ops.torch_vjp``, with ``mm`` and ``addmm`` defined (once per process)."""
    global _OPS
    with _LOCK:
        if _OPS is None:
            @torch.library.custom_op("torch_vjp::mm", mutates_args=(), device_types="cpu")
            def mm(a: Tensor, b: Tensor) -> Tensor:
                return _linear(a, b.t(), None)

            @mm.register_fake
            def _(a: Tensor, b: Tensor) -> Tensor:
                return a.new_empty((a.shape[0], b.shape[1]))

            @torch.library.custom_op("torch_vjp::addmm", mutates_args=(), device_types="cpu")
            def addmm(bias: Tensor, a: Tensor, b: Tensor) -> Tensor:
                return _linear(a, b.t(), bias)

            @addmm.register_fake
            def _(bias: Tensor, a: Tensor, b: Tensor) -> Tensor:
                return a.new_empty((a.shape[0], b.shape[1]))

            _OPS = torch.ops.torch_vjp
    return _OPS


def faster_here() -> bool:
    """Whether oneDNN's float32 product beats ``aten.mm`` on this machine by a clear margin
    (a 256 x 256 product, the better of five alternated timings of each): measured once per
    process, a few milliseconds. False where torch has no oneDNN."""
    global _FASTER
    if _FASTER is None:
        _FASTER = _measure()
    return _FASTER


def _measure() -> bool:
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=gen)
    b = torch.randn(256, 256, generator=gen)
    try:
        if not torch.allclose(_linear(a, b.t(), None), a @ b, rtol=1e-4, atol=1e-3):
            return False
    except RuntimeError:  # (a build whose kernel refuses this machine)
        return False
    best = {"mm": float("inf"), "onednn": float("inf")}
    with torch.no_grad():
        for _ in range(5):
            for name, run in (("mm", lambda: torch.mm(a, b)),
                              ("onednn", lambda: _linear(a, b.t(), None))):
                start = time.perf_counter()
                for _ in range(4):
                    run()
                best[name] = min(best[name], time.perf_counter() - start)
    return best["onednn"] < 0.8 * best["mm"]


def _val(node: Any) -> Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, Tensor) else None


def _eligible(node: torch.fx.Node) -> bool:
    """A float32 CPU product of two matrices, :data:`MIN_WORK` or more."""
    a, b = _val(node.args[-2]), _val(node.args[-1])
    if a is None or b is None or a.dim() != 2 or b.dim() != 2:
        return False
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" \
            or b.device.type != "cpu" or a.is_sparse or b.is_sparse:
        return False
    try:
        m, k, n = int(a.shape[0]), int(a.shape[1]), int(b.shape[1])
    except TypeError:  # (a symbolic size)
        return False
    return m >= MIN_SIDE and n >= MIN_SIDE and m * k * n >= MIN_WORK


class OneDnnProducts(CustomGraphPass):
    """Inductor's post-grad pass of NOTE [oneDNN products]. Made before inductor compiles,
    it defines the two operators first: a program inductor finds in its cache on disk calls
    them without running the pass."""

    def __init__(self) -> None:
        self.ops = _ops()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is aten.mm.default and not node.kwargs and _eligible(node):
                target, args = "mm", node.args
            elif (node.target is aten.addmm.default and not node.kwargs
                  and len(node.args) == 3 and _eligible(node)):
                bias, out = _val(node.args[0]), _val(node)
                if bias is None or out is None or bias.dim() != 1 \
                        or bias.shape[0] != out.shape[1] or bias.dtype != torch.float32:
                    continue
                target, args = "addmm", node.args
            else:
                continue
            with graph.inserting_before(node):
                new = graph.call_function(getattr(self.ops, target).default, tuple(args))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))
