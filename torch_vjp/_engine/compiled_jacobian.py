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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from torch_vjp._engine.compile_checks import graph_safe_mode
from torch_vjp._engine.compiled import Built, compiled_call
from torch_vjp._engine.context import graph_mode
from torch_vjp._engine.forms import (auto_mode, forward_mode_agrees, output_of, plain_context,
                                     plain_jacobian)
from torch_vjp._engine.memory import HUGE_PAGE_MIN_BYTES, new_buffer
from torch_vjp._strategies import get_strategy

__all__ = ["compiled_jacobian"]


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
