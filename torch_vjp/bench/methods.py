"""The methods the suite compares: torch_vjp's strategies and the tools users would otherwise use.

Each :class:`Method` turns a built :class:`~torch_vjp.bench.workloads.Case` into a
zero-argument callable that computes the workload's Jacobian the way that tool does
(``prepare``); the runner calls it once to check it against the reference, then times it.
Methods of jax are written against the workload's ``jax_fn`` with the same weights, and are
listed only when ``jax`` can be imported (it is optional).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torch_vjp.bench.workloads import Case, Kind

__all__ = ["Method", "Prepared", "METHODS", "HEADLINE", "COMPILED", "get_methods", "jax_available", "jax_runs_on", "reference"]


@dataclass(frozen=True)
class Prepared:
    """A method made ready for one case.

    Attributes:
        run: Computes the result once (what is timed); jax results are waited for.
        to_torch: Turns ``run()``'s result into torch tensors for the correctness check.
    """

    run: Callable[[], Any]
    to_torch: Callable[[Any], Any] = lambda result: result


@dataclass(frozen=True)
class Method:
    """One way to compute a workload's Jacobian.

    Attributes:
        name: Shown in tables, plots and JSON (``"torch_vjp auto"``).
        family: ``"torch_vjp"``, ``"torch.func"``, ``"torch.autograd"`` or ``"jax"``: the
            plot's colour.
        kind: The workload kind it serves.
        prepare: ``prepare(case) -> Prepared``.
        slow: Run only on request (``--all``): a Python loop over every row or column, or a
            full Jacobian where only its diagonal blocks are wanted. They are 20 to 30,000
            times slower than the vectorised methods and would take most of the suite's time.
    """

    name: str
    family: str
    kind: Kind
    prepare: Callable[[Case], Prepared]
    slow: bool = False

    @property
    def needs_jax(self) -> bool:
        return self.family == "jax"


def jax_available() -> bool:
    """True when ``jax`` can be imported (the suite then adds its methods)."""
    return importlib.util.find_spec("jax") is not None


def jax_runs_on(device: str | torch.device) -> bool:
    """True when jax is installed and has a device of ``device``'s kind: always for the
    CPU, for ``cuda[:N]`` where jax has (at least N + 1) GPUs. The suite's jax methods run
    on the same device as torch's.

    Example:
        >>> jax_runs_on("cpu") == jax_available()
        True
        >>> jax_runs_on("meta")  # no jax device of that kind
        False
    """
    device = torch.device(device)
    if not jax_available():
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    # jax takes most of a GPU's memory on its first use unless told otherwise; the suite
    # shares the GPU with torch.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    try:
        return len(jax.devices("gpu")) > (device.index or 0)
    except RuntimeError:  # no GPU backend in this jax install
        return False


# --------------------------------------------------------------------------------------
# torch_vjp
# --------------------------------------------------------------------------------------


def _tv_jacobian(strategy: str, compile: bool = False) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        from torch_vjp.jacobians import jacobian

        return Prepared(lambda: jacobian(case.f, *case.primals, argnums=case.argnums,
                                         strategy=strategy, compile=compile))

    return prepare


def _tv_batch(strategy: str, compile: bool = False) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        from torch_vjp.jacobians import batch_jacobian

        (x,) = case.primals
        return Prepared(lambda: batch_jacobian(case.f, x, strategy=strategy, compile=compile))

    return prepare


def _diagonal_blocks(jac: Tensor) -> Tensor:
    """``(B, m, B, n)`` full Jacobian of a row-wise function -> ``(B, m, n)`` per-example blocks."""
    return jac.diagonal(dim1=0, dim2=2).movedim(-1, 0)


def _tv_full_then_diagonal(case: Case) -> Prepared:
    from torch_vjp.jacobians import jacobian

    (x,) = case.primals
    return Prepared(lambda: _diagonal_blocks(jacobian(case.f, x)))


def _graph(case: Case) -> tuple[Tensor, Tensor]:
    """The input (a fresh leaf that requires grad) and the output graph built from it."""
    x = case.primals[0].detach().requires_grad_(True)
    return x, case.f(x)


def _tv_jacobian_of(case: Case) -> Prepared:
    from torch_vjp.jacobians import jacobian_of

    x, y = _graph(case)
    return Prepared(lambda: jacobian_of(y, x, retain_graph=True))


# --------------------------------------------------------------------------------------
# torch.func
# --------------------------------------------------------------------------------------


def _func(transform: str) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        jac = getattr(torch.func, transform)(case.f, argnums=case.argnums)
        return Prepared(lambda: jac(*case.primals))

    return prepare


def _vmap_single(transform: str) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        fn = torch.func.vmap(getattr(torch.func, transform)(case.f_single))
        (x,) = case.primals
        return Prepared(lambda: fn(x))

    return prepare


def _func_full_then_diagonal(case: Case) -> Prepared:
    jac = torch.func.jacrev(case.f)
    (x,) = case.primals
    return Prepared(lambda: _diagonal_blocks(jac(x)))


# --------------------------------------------------------------------------------------
# torch.autograd
# --------------------------------------------------------------------------------------


def _autograd_functional(**options: Any) -> Callable[[Case], Prepared]:
    """``torch.autograd.functional.jacobian``, which takes a tensor or a tuple of tensors:
    other arguments are bound, a parameter dict is passed as a tuple and rebuilt."""

    def prepare(case: Case) -> Prepared:
        afj = functools.partial(torch.autograd.functional.jacobian, **options)
        if case.workload.primal_is_params:
            keys = list(case.primals[0])
            values = tuple(case.primals[0][k] for k in keys)

            def g(*vals: Tensor) -> Any:
                return case.f(dict(zip(keys, vals)))

            return Prepared(lambda: dict(zip(keys, afj(g, values))))
        nums = (case.argnums,) if isinstance(case.argnums, int) else tuple(case.argnums)

        def g(*xs: Tensor) -> Any:
            args = list(case.primals)
            for i, x in zip(nums, xs):
                args[i] = x
            return case.f(*args)

        inputs = tuple(case.primals[i] for i in nums)
        if isinstance(case.argnums, int):
            return Prepared(lambda: afj(g, inputs[0]))
        return Prepared(lambda: afj(g, inputs))

    return prepare


def _autograd_functional_full_then_diagonal(case: Case) -> Prepared:
    (x,) = case.primals
    return Prepared(lambda: _diagonal_blocks(
        torch.autograd.functional.jacobian(case.f, x, vectorize=True)))


def _grad_loop(case: Case) -> Prepared:
    x, y = _graph(case)
    flat = y.reshape(-1)

    def run() -> Tensor:
        rows = [torch.autograd.grad(flat[i], x, retain_graph=True)[0] for i in range(flat.numel())]
        return torch.stack(rows).reshape(y.shape + x.shape)

    return Prepared(run)


def _grad_batched(case: Case) -> Prepared:
    x, y = _graph(case)
    flat = y.reshape(-1)

    def run() -> Tensor:
        basis = torch.eye(flat.numel(), dtype=flat.dtype, device=flat.device)
        (jac,) = torch.autograd.grad(flat, x, basis, retain_graph=True, is_grads_batched=True)
        return jac.reshape(y.shape + x.shape)

    return Prepared(run)


# --------------------------------------------------------------------------------------
# jax (optional)
# --------------------------------------------------------------------------------------


def _jax_modules() -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    return jax, jnp, lax


def _to_jax(tree: Any, device: torch.device) -> Any:
    """Torch tensors -> jax arrays (same values and dtype) on jax's device of the same kind
    and index as ``device`` (its CPU, or its GPU N for ``cuda:N``)."""
    jax, jnp, _ = _jax_modules()
    target = (jax.devices("cpu")[0] if device.type == "cpu"
              else jax.devices("gpu")[device.index or 0])

    def convert(t: Any) -> Any:
        return jax.device_put(jnp.asarray(t.detach().cpu().numpy()), target)

    if isinstance(tree, dict):
        return {k: convert(v) for k, v in tree.items()}
    return tuple(convert(t) for t in tree)


def _from_jax(tree: Any) -> Any:
    import numpy as np

    if isinstance(tree, dict):
        return {k: _from_jax(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return tuple(_from_jax(v) for v in tree)
    return torch.from_numpy(np.array(tree))


def _jax_device(case: Case) -> torch.device:
    """The device of the case's tensors, where jax must run too."""
    if case.workload.jax_fn is None:
        raise NotImplementedError(f"{case.workload.name} has no jax version")
    first = next(iter(case.params.values()), case.primals[0])
    device = first.device if isinstance(first, Tensor) else torch.device("cpu")
    if not jax_runs_on(device):
        raise NotImplementedError(f"jax has no {device.type} device here")
    return device


def _jax_jacobian(transform: str) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        device = _jax_device(case)
        jax, jnp, lax = _jax_modules()
        fn = case.workload.jax_fn
        params = _to_jax(case.params, device)
        if case.workload.primal_is_params:
            inputs = _to_jax(case.inputs, device)

            @jax.jit
            def jac(p: Any, *xs: Any) -> Any:
                with jax.default_matmul_precision("highest"):  # full float32, as torch
                    return getattr(jax, transform)(lambda q: fn(jnp, lax, q, *xs))(p)

            return Prepared(lambda: jax.block_until_ready(jac(params, *inputs)), _from_jax)
        argnums = case.argnums

        @jax.jit
        def jac(p: Any, *xs: Any) -> Any:
            with jax.default_matmul_precision("highest"):
                return getattr(jax, transform)(lambda *ys: fn(jnp, lax, p, *ys),
                                               argnums=argnums)(*xs)

        inputs = _to_jax(case.primals, device)
        return Prepared(lambda: jax.block_until_ready(jac(params, *inputs)), _from_jax)

    return prepare


def _jax_vmap_single(transform: str) -> Callable[[Case], Prepared]:
    def prepare(case: Case) -> Prepared:
        device = _jax_device(case)
        jax, jnp, lax = _jax_modules()
        fn = case.workload.jax_fn

        @jax.jit
        def jac(p: Any, x: Any) -> Any:
            with jax.default_matmul_precision("highest"):
                return jax.vmap(getattr(jax, transform)(lambda row: fn(jnp, lax, p, row)))(x)

        params = _to_jax(case.params, device)
        (x,) = _to_jax(case.primals, device)
        return Prepared(lambda: jax.block_until_ready(jac(params, x)), _from_jax)

    return prepare


# --------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------

_J = "jacobian"
_B = "batch_jacobian"
_G = "jacobian_of"

#: Every method, in the order tables and plots show them.
METHODS: tuple[Method, ...] = (
    # jacobian
    Method("torch_vjp auto", "torch_vjp", _J, _tv_jacobian("auto")),
    Method("torch_vjp rev", "torch_vjp", _J, _tv_jacobian("rev")),
    Method("torch_vjp fwd", "torch_vjp", _J, _tv_jacobian("fwd")),
    Method("torch_vjp compiled", "torch_vjp", _J, _tv_jacobian("auto", compile=True)),
    Method("torch_vjp rev-loop", "torch_vjp", _J, _tv_jacobian("rev-loop"), slow=True),
    Method("torch_vjp fwd-loop", "torch_vjp", _J, _tv_jacobian("fwd-loop"), slow=True),
    Method("torch.func.jacrev", "torch.func", _J, _func("jacrev")),
    Method("torch.func.jacfwd", "torch.func", _J, _func("jacfwd")),
    Method("autograd.functional.jacobian", "torch.autograd", _J, _autograd_functional(), slow=True),
    Method("autograd.functional.jacobian(vectorize=True)", "torch.autograd", _J,
           _autograd_functional(vectorize=True)),
    Method("autograd.functional.jacobian(forward-mode)", "torch.autograd", _J,
           _autograd_functional(vectorize=True, strategy="forward-mode")),
    Method("jax.jit(jax.jacrev)", "jax", _J, _jax_jacobian("jacrev")),
    Method("jax.jit(jax.jacfwd)", "jax", _J, _jax_jacobian("jacfwd")),
    # batch_jacobian
    Method("torch_vjp batch_jacobian", "torch_vjp", _B, _tv_batch("auto")),
    Method("torch_vjp batch_jacobian rev", "torch_vjp", _B, _tv_batch("rev")),
    Method("torch_vjp batch_jacobian fwd", "torch_vjp", _B, _tv_batch("fwd")),
    Method("torch_vjp batch_jacobian compiled", "torch_vjp", _B,
           _tv_batch("auto", compile=True)),
    Method("torch_vjp jacobian + diagonal", "torch_vjp", _B, _tv_full_then_diagonal, slow=True),
    Method("vmap(jacrev(f_single))", "torch.func", _B, _vmap_single("jacrev")),
    Method("vmap(jacfwd(f_single))", "torch.func", _B, _vmap_single("jacfwd")),
    Method("torch.func.jacrev + diagonal", "torch.func", _B, _func_full_then_diagonal, slow=True),
    Method("autograd.functional.jacobian(vectorize=True) + diagonal", "torch.autograd", _B,
           _autograd_functional_full_then_diagonal, slow=True),
    Method("jax.jit(vmap(jacrev))", "jax", _B, _jax_vmap_single("jacrev")),
    Method("jax.jit(vmap(jacfwd))", "jax", _B, _jax_vmap_single("jacfwd")),
    # jacobian_of
    Method("torch_vjp jacobian_of", "torch_vjp", _G, _tv_jacobian_of),
    Method("autograd.grad loop", "torch.autograd", _G, _grad_loop, slow=True),
    Method("autograd.grad(is_grads_batched=True)", "torch.autograd", _G, _grad_batched),
)

#: torch_vjp's compiled method on each kind of workload (``compile=True``, strategy auto):
#: the summary compares it with jax.jit's methods.
COMPILED: dict[str, str] = {
    _J: "torch_vjp compiled",
    _B: "torch_vjp batch_jacobian compiled",
}

#: The method that stands for "torch_vjp with default settings" on each kind of workload.
HEADLINE: dict[str, str] = {
    _J: "torch_vjp auto",
    _B: "torch_vjp batch_jacobian",
    _G: "torch_vjp jacobian_of",
}


def get_methods(kind: str, *, names: list[str] | tuple[str, ...] | None = None,
                jax: bool = True, include_slow: bool = False) -> list[Method]:
    """The methods that serve one kind of workload.

    Args:
        kind: ``"jacobian"``, ``"batch_jacobian"`` or ``"jacobian_of"``.
        names: Keep only these method names (exact), slow or not; ``None`` keeps all
            (the slow ones only with ``include_slow``).
        jax: Include jax's methods (only takes effect when jax can be imported).
        include_slow: Include the Python-loop and full-then-diagonal methods
            (``Method.slow``).

    Returns:
        The methods, in :data:`METHODS` order.

    Example:
        >>> [m.name for m in get_methods("jacobian_of")]
        ['torch_vjp jacobian_of', 'autograd.grad(is_grads_batched=True)']
        >>> [m.name for m in get_methods("jacobian_of", include_slow=True)]
        ['torch_vjp jacobian_of', 'autograd.grad loop', 'autograd.grad(is_grads_batched=True)']
    """
    use_jax = jax and jax_available()
    return [
        m for m in METHODS
        if m.kind == kind
        and (use_jax or not m.needs_jax)
        and (m.name in names if names is not None else include_slow or not m.slow)
    ]


def reference(workload: Any, device: str | torch.device = "cpu") -> Any:
    """The workload's Jacobian in float64 by ``torch.func.jacrev`` (independent of torch_vjp).

    For ``"batch_jacobian"`` workloads: the full Jacobian's diagonal blocks ``(B, m, n)``.

    Args:
        workload: A :class:`~torch_vjp.bench.workloads.Workload`.
        device: Where to compute it.

    Returns:
        The reference result, in the structure the workload's methods return.
    """
    case = workload.build(torch.float64, device)
    if workload.kind == "batch_jacobian":
        return _diagonal_blocks(torch.func.jacrev(case.f)(*case.primals))
    return torch.func.jacrev(case.f, argnums=case.argnums)(*case.primals)
