"""How :func:`torch_vjp.check_function` calls the user's forward: every call with the same
random draws, and nothing of the caller's changed afterwards.

NOTE [check_function's draws]
check_function calls forward many times at nearby points (one forward and backward for the
structure, one for the probes, two per probe and input for the central differences) and
compares them. A forward that draws from torch's global generator (a dropout-like mask, a
random projection) draws differently on every call, so the finite differences would mix
masks and blame a correct backward by orders of magnitude. Each call therefore starts from
the generator state the caller had (:class:`SameDraws`): every forward sees the same draws,
the ones a plain call would have seen, and the finite differences are those of one fixed
function. The caller's state is put back at the end, so the global RNG is untouched whether
or not forward draws. CUDA generators are treated alike for the CUDA devices the inputs
live on.

Module buffers that a forward in training mode updates (BatchNorm's running statistics)
are put back by :func:`torch_vjp._engine.context.buffers_kept`, as the Jacobian functions do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from torch_vjp._engine.context import buffers_kept

__all__ = ["SameDraws", "kept"]


class SameDraws:
    """Gives every call of forward the random draws of the first (NOTE [check_function's
    draws]); use as a context manager around the whole check, and call :meth:`reset`
    before each call of forward."""

    def __init__(self, inputs: tuple[Any, ...]) -> None:
        self._cuda = sorted({
            t.device.index if t.device.index is not None else torch.cuda.current_device()
            for t in pytree.tree_leaves(inputs)
            if isinstance(t, Tensor) and t.device.type == "cuda"
        })
        self._cpu: Tensor | None = None
        self._gpu: list[Tensor] = []

    def __enter__(self) -> SameDraws:
        self._cpu = torch.get_rng_state()
        self._gpu = [torch.cuda.get_rng_state(d) for d in self._cuda]
        return self

    def reset(self) -> None:
        assert self._cpu is not None
        torch.set_rng_state(self._cpu)
        for d, state in zip(self._cuda, self._gpu):
            torch.cuda.set_rng_state(state, d)

    def __exit__(self, *exc: Any) -> None:
        self.reset()


@contextlib.contextmanager
def kept(fn: Any, is_function: bool, inputs: tuple[Any, ...]) -> Iterator[SameDraws]:
    """The whole check's calls: the same draws on every call of forward, the caller's RNG
    state and the buffers of the modules forward uses put back afterwards."""
    target = fn.forward if is_function else fn
    with buffers_kept(target, primals=inputs), SameDraws(inputs) as draws:
        yield draws
