"""``jacobian(compile=True)``: the program :func:`~torch_vjp._engine.compiled.compiled_call`
compiles for a Jacobian, with its result buffer.

NOTE [the result buffer of a compiled Jacobian]
A compiled program allocates its result with torch's allocator, whose fresh buffer of tens of
megabytes costs a page fault per 4 kB page when the kernel first writes it (the cost NOTE
[huge pages] in :mod:`torch_vjp._engine.memory` describes). Where the Jacobian is one
tensor of at least ``HUGE_PAGE_MIN_BYTES`` (sized by one call of ``f`` when the entry is
built), the program takes that buffer as an argument instead: each call allocates it with
``new_buffer``, which asks for huge pages, and inductor writes the Jacobian's kernel into it
(with NOTE [a basis inductor fuses], elementwise 4096's compiled call went from 39.7-49.3 ms
to 10.5-10.9 ms, two alternated runs of the suite's compiled and jax rows, old and new code,
2 threads; jax.jit 19-22 ms in the same runs). The buffer is new on
every call, so no result is ever overwritten by a later call; a program whose Jacobian comes
out with another shape (a recompile for a changed global, say) returns its own result and
leaves the buffer unused.

NOTE [reverse products batched wrongly]
The eager "rev" reads f's graph for the operators torch differentiates wrongly (NOTE [named
reverse strategies and wrong formulas] in :mod:`torch_vjp._engine.wrongops`) and computes
its rows one product at a time where f's graph holds ``torch.cdist`` (whose backward torch
batches wrongly), or refuses (``torch.as_strided_scatter``). The compiled program computes
its reverse products under torch.vmap, and the first call's comparison with the eager
result does not catch it everywhere: where f multiplies what passes through cdist by a
factor that is 0 at the first call's point, the wrong rows agree there, and every later
call returned them wrong (by several units at a scale of one). So ``build`` reads the graph
of one call of f (first calls only) and, where a reverse-mode program would run through one
of those operators, compiles nothing: the signature stays eager, whose answer is the eager
path's, with a warning that says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from torch_vjp._engine.compile_checks import graph_safe_mode
from torch_vjp._engine.compiled import Built, compiled_call
from torch_vjp._engine.context import graph_mode
from torch_vjp._engine.forms import (auto_mode, forward_mode_agrees, output_of, plain_context,
                                     plain_jacobian)
from torch_vjp._engine.memory import HUGE_PAGE_MIN_BYTES, new_buffer
from torch_vjp._engine.problem import normalize_argnums
from torch_vjp._engine.wrongops import wrong_ops
from torch_vjp._errors import passes_through
from torch_vjp._strategies import get_strategy

__all__ = ["compiled_jacobian", "wrong_reverse"]


def compiled_jacobian(
    f: Callable[..., Any], primals: tuple[Any, ...], options: tuple[Any, ...],
    eager: Callable[[], Any],
) -> Any:
    """``jacobian(compile=True)``; ``options`` are ``(argnums, has_aux, strategy,
    chunk_size, create_graph)`` and ``eager`` the eager call, whose first run checks every
    option, so that a cached entry exists only for options that are valid."""
    call = "torch_vjp.jacobian"
    argnums, has_aux, strategy, chunk_size, create_graph = options

    def build() -> Callable[..., Any] | Built:
        mode = get_strategy(strategy, call=call).mode
        if mode is None:
            mode = auto_mode(f, primals, argnums, has_aux)
            if mode == "fwd" and not forward_mode_agrees(f, primals, argnums, has_aux):
                mode = "rev"  # (an operation without a forward-mode formula, torch.cdist,
                # or with a wrong one, torch.triangular_solve)
        context, detached = graph_mode(create_graph, call=call)
        mode = graph_safe_mode(mode, get_strategy(strategy, call=call).mode is not None,
                               detached)  # (NOTE [forward mode with create_graph, eager])
        if mode == "rev":  # NOTE [reverse products batched wrongly]
            why = wrong_reverse(f, primals, argnums, has_aux)
            if why is not None:
                return Built(None, why=why)

        def program(f: Callable[..., Any], *args: Any) -> Any:
            with plain_context(context, detached):
                return plain_jacobian(f, args, argnums, has_aux, mode, chunk_size)

        block = _large_block(f, primals, argnums, has_aux) if detached else None
        if block is None:
            return program
        like, shape = block

        def program_into(f: Callable[..., Any], *args: Any) -> Any:
            with plain_context(context, detached):  # (args: the primals, then the buffer)
                return plain_jacobian(f, args[:-1], argnums, has_aux, mode, chunk_size,
                                      out=args[-1])
        return Built(program_into, lambda: (new_buffer(like, shape),))

    return compiled_call(call, f, options, primals, eager, build)


def wrong_reverse(f: Callable[..., Any], primals: tuple[Any, ...], argnums: Any,
                   has_aux: bool) -> str | None:
    """Why a reverse-mode program of f must not be compiled (NOTE [reverse products batched
    wrongly]): f's graph, from one call on copies of ``primals`` (the differentiated ones
    requiring grad, passed as copies that f may write in place), holds an operator whose
    backward torch batches wrongly, or computes wrongly; None where it holds neither, or
    where f cannot run so (the compiled program and its check decide, as before)."""
    nums = normalize_argnums(argnums, len(primals), call="torch_vjp.jacobian")
    args = list(tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t,
                         primals))
    for i in nums:
        args[i] = tree_map(lambda t: t.requires_grad_().clone() if isinstance(t, Tensor)
                           and (t.is_floating_point() or t.is_complex()) else t, args[i])
    try:
        with torch.enable_grad():
            res = f(*args)
    except Exception as err:  # noqa: BLE001 - the eager call ran f: its errors are said
        if passes_through(err):
            raise
        return None
    out = res[0] if has_aux and isinstance(res, tuple) else res
    batching, alone = wrong_ops([o for o in tree_leaves(out) if isinstance(o, Tensor)])
    if batching is not None:
        return (f"f's graph holds {batching}, whose backward torch batches wrongly under "
                f"torch.vmap (the rows are off by a relative error near 1, each alone is "
                f"right); the compiled program would compute its reverse products under "
                f"torch.vmap, and the eager call computes them one at a time")
    if alone is not None:
        return (f"f's graph holds {alone}, whose backward formula torch has wrong for the "
                f"tensor scattered into, which f computes from its differentiated inputs; "
                f"the compiled program would compute with reverse mode through it")
    return None


def _large_block(
    f: Callable[..., Any], primals: tuple[Any, ...], argnums: Any, has_aux: bool
) -> tuple[Tensor, tuple[int, ...]] | None:
    """For a Jacobian that is one tensor of at least ``HUGE_PAGE_MIN_BYTES``: an empty
    tensor of its dtype and device, and its shape (one call of ``f``); else None. See NOTE
    [the result buffer of a compiled Jacobian]."""
    if not isinstance(argnums, int) or not isinstance(primals[argnums], Tensor):
        return None
    out = output_of(f, primals, has_aux)
    if not isinstance(out, Tensor) or out.dtype != primals[argnums].dtype:
        return None
    shape = (*out.shape, *primals[argnums].shape)
    if math.prod(shape) * out.element_size() < HUGE_PAGE_MIN_BYTES:
        return None
    return out.new_empty(0), shape
