"""The Jacobian workloads of the benchmark suite, each written once for torch and for jax.

A :class:`Workload` makes its weights and inputs deterministically (float64, from a seed
derived from its name) and casts them to the dtype and device asked for, so the float64
build is the reference's input and the float32 build is what is timed; the jax version of
the function receives the very same weights. Both ``python -m torch_vjp bench`` and
``benchmarks/bench_jacobian.py`` take their workloads from :data:`WORKLOADS`.

Kinds of workload:

* ``"jacobian"``: ``f(*primals)``, differentiated with respect to ``argnums``.
* ``"batch_jacobian"``: ``f`` maps a batch row by row, ``(B, n) -> (B, m)``; the wanted
  result is the per-example Jacobians ``(B, m, n)``. ``f_single`` maps one row.
* ``"jacobian_of"``: the output was already computed (an autograd graph exists); the wanted
  result is its Jacobian with respect to the input.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["Workload", "Case", "WORKLOADS", "STRUCTURED", "get_workloads"]

Kind = Literal["jacobian", "batch_jacobian", "jacobian_of"]


@dataclass(frozen=True)
class Case:
    """A workload built for one dtype and device.

    Attributes:
        workload: The :class:`Workload` it was built from.
        f: The torch function (weights bound); for ``"batch_jacobian"`` the batched one.
        primals: The arguments of ``f``.
        argnums: Which arguments are differentiated.
        params: The weights (a dict of tensors), as passed to the jax function.
        inputs: The workload's inputs (for a parameter Jacobian, the data bound into ``f``).
        f_single: For ``"batch_jacobian"``: ``f`` on one row, ``(n,) -> (m,)``.
    """

    workload: Workload
    f: Callable[..., Any]
    primals: tuple[Any, ...]
    argnums: int | tuple[int, ...]
    params: dict[str, Tensor]
    inputs: tuple[Tensor, ...] = ()
    f_single: Callable[[Tensor], Tensor] | None = None


@dataclass(frozen=True)
class Workload:
    """One benchmark workload.

    Attributes:
        name: Short identifier, used by ``--only`` and in JSON (``"mlp_8x512"``).
        title: What it is, for tables and plots (``"tanh MLP 8 -> 512"``).
        kind: ``"jacobian"``, ``"batch_jacobian"`` or ``"jacobian_of"`` (module docstring).
        make: ``make(gen) -> (params, inputs)``: float64 weights (dict) and inputs (tuple),
            drawn from the generator ``gen``.
        torch_fn: ``torch_fn(params, *inputs)``; for ``"batch_jacobian"`` on one row.
        jax_fn: The same function in ``jax.numpy``, ``jax_fn(jnp, lax, params, *inputs)``
            (the modules are passed in so that this file never imports jax), or ``None``.
        argnums: The differentiated arguments.
        quick: Part of the ``--quick`` suite.
        primal_is_params: The single primal is the ``params`` dict itself (a Jacobian with
            respect to a module's parameters); ``torch_fn(params, *inputs)`` still applies.
    """

    name: str
    title: str
    kind: Kind
    make: Callable[[torch.Generator], tuple[dict[str, Tensor], tuple[Tensor, ...]]]
    torch_fn: Callable[..., Any]
    jax_fn: Callable[..., Any] | None = None
    argnums: int | tuple[int, ...] = 0
    quick: bool = False
    primal_is_params: bool = False
    module: Callable[[dict[str, Tensor]], torch.nn.Module] | None = field(default=None, repr=False)

    def build(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Case:
        """The workload's function and arguments in ``dtype`` on ``device``.

        The weights and inputs are drawn in float64 from a seed fixed by the workload's
        name, then cast, so every dtype sees the same numbers (up to rounding).

        Args:
            dtype: The floating dtype of weights and inputs.
            device: Where they live.

        Returns:
            A :class:`Case`.
        """
        gen = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        params64, inputs64 = self.make(gen)
        params = {k: v.to(dtype=dtype, device=device) for k, v in params64.items()}
        inputs = tuple(x.to(dtype=dtype, device=device) for x in inputs64)
        if self.primal_is_params:
            module = self.module(params) if self.module is not None else None

            def f_params(p: dict[str, Tensor]) -> Any:
                if module is not None:
                    return torch.func.functional_call(module, p, inputs)
                return self.torch_fn(p, *inputs)

            return Case(self, f_params, (params,), 0, params, inputs)
        if self.kind == "batch_jacobian":
            def f_single(x: Tensor) -> Tensor:
                return self.torch_fn(params, x)

            def f_batch(x: Tensor) -> Tensor:
                return self.torch_fn(params, x)  # row-wise: x @ W.T acts per row

            return Case(self, f_batch, inputs, 0, params, inputs, f_single)

        def f(*xs: Tensor) -> Any:
            return self.torch_fn(params, *xs)

        return Case(self, f, inputs, self.argnums, params, inputs)


# --------------------------------------------------------------------------------------
# Functions, written once for an array namespace ``xp`` (torch or jax.numpy) where the
# syntax allows, else once per framework.
# --------------------------------------------------------------------------------------


def _dense(gen: torch.Generator, n_out: int, n_in: int) -> tuple[Tensor, Tensor]:
    w = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) / n_in**0.5
    b = 0.1 * torch.randn(n_out, generator=gen, dtype=torch.float64)
    return w, b


def _mlp_make(n_in: int, n_out: int, hidden: int = 256, batch: int | None = None):
    def make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        sizes = [n_in, hidden, hidden, n_out]
        params = {}
        for i in range(3):
            params[f"w{i}"], params[f"b{i}"] = _dense(gen, sizes[i + 1], sizes[i])
        shape = (n_in,) if batch is None else (batch, n_in)
        return params, (torch.randn(*shape, generator=gen, dtype=torch.float64),)

    return make


def _mlp(xp: Any, p: dict[str, Any], x: Any) -> Any:
    """tanh MLP with two hidden layers and a linear output layer; rows of ``x`` independent."""
    h = xp.tanh(x @ p["w0"].T + p["b0"])
    h = xp.tanh(h @ p["w1"].T + p["b1"])
    return h @ p["w2"].T + p["b2"]


def _mlp_torch(p: dict[str, Tensor], x: Tensor) -> Tensor:
    return _mlp(torch, p, x)


def _mlp_jax(jnp: Any, lax: Any, p: dict[str, Any], x: Any) -> Any:
    return _mlp(jnp, p, x)


def _elementwise(xp: Any, p: dict[str, Any], x: Any) -> Any:
    return x * xp.tanh(x) + xp.sin(x)


def _elementwise_make(n: int):
    def make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        return {}, (torch.randn(n, generator=gen, dtype=torch.float64),)

    return make


def _two_input(xp: Any, p: dict[str, Any], x: Any, y: Any) -> Any:
    return xp.tanh(x @ p["a"].T + y @ p["b"].T) * (y @ p["c"].T)


def _two_input_make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
    n_x, n_y, n_out = 128, 64, 256
    params = {
        "a": torch.randn(n_out, n_x, generator=gen, dtype=torch.float64) / n_x**0.5,
        "b": torch.randn(n_out, n_y, generator=gen, dtype=torch.float64) / n_y**0.5,
        "c": torch.randn(n_out, n_y, generator=gen, dtype=torch.float64) / n_y**0.5,
    }
    x = torch.randn(n_x, generator=gen, dtype=torch.float64)
    y = torch.randn(n_y, generator=gen, dtype=torch.float64)
    return params, (x, y)


def _conv_make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
    params = {
        "c1": torch.randn(8, 3, 3, 3, generator=gen, dtype=torch.float64) / 27**0.5,
        "c1b": 0.1 * torch.randn(8, generator=gen, dtype=torch.float64),
        "c2": torch.randn(8, 8, 3, 3, generator=gen, dtype=torch.float64) / 72**0.5,
        "c2b": 0.1 * torch.randn(8, generator=gen, dtype=torch.float64),
    }
    params["fc"], params["fcb"] = _dense(gen, 10, 8 * 8 * 8)
    return params, (torch.randn(3, 16, 16, generator=gen, dtype=torch.float64),)


def _conv_torch(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """conv(3->8, 3x3) -> tanh -> conv(8->8, 3x3, stride 2) -> tanh -> linear(512->10)."""
    conv2d = torch.nn.functional.conv2d
    h = torch.tanh(conv2d(x.unsqueeze(0), p["c1"], p["c1b"], padding=1))
    h = torch.tanh(conv2d(h, p["c2"], p["c2b"], stride=2, padding=1))
    return h.reshape(-1) @ p["fc"].T + p["fcb"]


def _conv_jax(jnp: Any, lax: Any, p: dict[str, Any], x: Any) -> Any:
    def conv(h: Any, w: Any, b: Any, stride: int) -> Any:
        out = lax.conv_general_dilated(h, w, (stride, stride), [(1, 1), (1, 1)],
                                       dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return out + b[None, :, None, None]

    h = jnp.tanh(conv(x[None], p["c1"], p["c1b"], 1))
    h = jnp.tanh(conv(h, p["c2"], p["c2b"], 2))
    return h.reshape(-1) @ p["fc"].T + p["fcb"]


def _params_make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
    params = {}
    params["0.weight"], params["0.bias"] = _dense(gen, 32, 16)
    params["2.weight"], params["2.bias"] = _dense(gen, 10, 32)
    return params, (torch.randn(8, 16, generator=gen, dtype=torch.float64),)


def _params_module(params: dict[str, Tensor]) -> torch.nn.Module:
    """``nn.Sequential(Linear(16, 32), Tanh(), Linear(32, 10))`` holding ``params``."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    reference = next(iter(params.values()))
    model = model.to(dtype=reference.dtype, device=reference.device)
    with torch.no_grad():
        for name, value in model.named_parameters():
            value.copy_(params[name])
    return model


def _params_torch(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(x @ p["0.weight"].T + p["0.bias"])
    return h @ p["2.weight"].T + p["2.bias"]


def _params_jax(jnp: Any, lax: Any, p: dict[str, Any], x: Any) -> Any:
    h = jnp.tanh(x @ p["0.weight"].T + p["0.bias"])
    return h @ p["2.weight"].T + p["2.bias"]


def _ns_jax(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adapts an ``fn(xp, p, *x)`` written for any array namespace to ``jax_fn``'s signature."""

    def jax_fn(jnp: Any, lax: Any, p: dict[str, Any], *xs: Any) -> Any:
        return fn(jnp, p, *xs)

    jax_fn.__name__ = f"{fn.__name__.lstrip('_')}_jax"
    return jax_fn


def _ns_torch(fn: Callable[..., Any]) -> Callable[..., Any]:
    def torch_fn(p: dict[str, Tensor], *xs: Tensor) -> Any:
        return fn(torch, p, *xs)

    torch_fn.__name__ = f"{fn.__name__.lstrip('_')}_torch"
    return torch_fn


def _mlp_workload(n_in: int, n_out: int, quick: bool) -> Workload:
    return Workload(
        name=f"mlp_{n_in}x{n_out}",
        title=f"tanh MLP {n_in} -> 256 -> 256 -> {n_out}",
        kind="jacobian",
        make=_mlp_make(n_in, n_out),
        torch_fn=_mlp_torch,
        jax_fn=_mlp_jax,
        quick=quick,
    )


# Structured workloads: Jacobians that are mostly zeros (banded, stencils, block diagonal),
# where torch_vjp.sparse_jacobian needs a handful of products instead of one per row or
# column (benchmarks/bench_sparse.py).

#: Grid points of the 1-d residual, and the side of the 2-d grid.
PDE_1D_N, LAPLACE_2D_N = 4096, 64
#: The Bratu parameter: -laplace(u) = lambda * exp(u), in grid units.
BRATU_LAMBDA = 1.0


def _grid_make(n: int):
    def make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        return {}, (0.1 * torch.randn(n, generator=gen, dtype=torch.float64),)

    return make


def _pde_1d_torch(p: dict[str, Tensor], u: Tensor) -> Tensor:
    """The residual of the 1-d Bratu problem on the interior points, zero boundary values:
    ``u[i-1] - 2 u[i] + u[i+1] + h**2 lambda exp(u[i])``; its Jacobian is tridiagonal."""
    h = 1.0 / (u.shape[0] + 1)
    up = torch.nn.functional.pad(u, (1, 1))
    return up[2:] - 2 * up[1:-1] + up[:-2] + h**2 * BRATU_LAMBDA * torch.exp(u)


def _pde_1d_jax(jnp: Any, lax: Any, p: dict[str, Any], u: Any) -> Any:
    h = 1.0 / (u.shape[0] + 1)
    up = jnp.pad(u, (1, 1))
    return up[2:] - 2 * up[1:-1] + up[:-2] + h**2 * BRATU_LAMBDA * jnp.exp(u)


def _laplace_2d_torch(p: dict[str, Tensor], u: Tensor) -> Tensor:
    """The 2-d Bratu residual on an N x N grid, flattened: the 5-point Laplacian plus
    ``h**2 lambda exp(u)``, zero boundary values; 5 non-zeros per row of the Jacobian."""
    n = LAPLACE_2D_N
    h = 1.0 / (n + 1)
    g = u.reshape(n, n)
    up = torch.nn.functional.pad(g, (1, 1, 1, 1))
    lap = up[2:, 1:-1] + up[:-2, 1:-1] + up[1:-1, 2:] + up[1:-1, :-2] - 4 * g
    return (lap + h**2 * BRATU_LAMBDA * torch.exp(g)).reshape(-1)


def _laplace_2d_jax(jnp: Any, lax: Any, p: dict[str, Any], u: Any) -> Any:
    n = LAPLACE_2D_N
    h = 1.0 / (n + 1)
    g = u.reshape(n, n)
    up = jnp.pad(g, ((1, 1), (1, 1)))
    lap = up[2:, 1:-1] + up[:-2, 1:-1] + up[1:-1, 2:] + up[1:-1, :-2] - 4 * g
    return (lap + h**2 * BRATU_LAMBDA * jnp.exp(g)).reshape(-1)


def _rowwise_make(gen: torch.Generator) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
    params, (x,) = _mlp_make(32, 32, batch=64)(gen)
    return params, (x.reshape(-1),)


def _rowwise_mlp_torch(p: dict[str, Tensor], x: Tensor) -> Tensor:
    """The batch MLP on a flat batch: (64 * 32,) -> (64 * 32,), 64 diagonal blocks."""
    return _mlp(torch, p, x.reshape(64, 32)).reshape(-1)


def _rowwise_mlp_jax(jnp: Any, lax: Any, p: dict[str, Any], x: Any) -> Any:
    return _mlp(jnp, p, x.reshape(64, 32)).reshape(-1)


#: The structured workloads (``elementwise_4096``, above, is the fourth).
STRUCTURED: tuple[Workload, ...] = (
    Workload(
        name="pde_1d_4096",
        title="1-d Bratu residual, 4096 points (tridiagonal Jacobian)",
        kind="jacobian",
        make=_grid_make(PDE_1D_N),
        torch_fn=_pde_1d_torch,
        jax_fn=_pde_1d_jax,
    ),
    Workload(
        name="laplace_2d_64x64",
        title="2-d Bratu residual, 5-point Laplacian + exp, 64 x 64 grid",
        kind="jacobian",
        make=_grid_make(LAPLACE_2D_N**2),
        torch_fn=_laplace_2d_torch,
        jax_fn=_laplace_2d_jax,
    ),
    Workload(
        name="rowwise_mlp_64x32",
        title="tanh MLP 32 -> 256 -> 256 -> 32 row by row on a flat batch of 64 (2048 -> 2048)",
        kind="jacobian",
        make=_rowwise_make,
        torch_fn=_rowwise_mlp_torch,
        jax_fn=_rowwise_mlp_jax,
    ),
)

#: Every workload of the suite, in the order tables and plots show them.
WORKLOADS: tuple[Workload, ...] = (
    _mlp_workload(8, 512, quick=True),
    _mlp_workload(512, 8, quick=True),
    _mlp_workload(256, 256, quick=False),
    _mlp_workload(1024, 1024, quick=False),
    Workload(
        name="elementwise_4096",
        title="elementwise x*tanh(x)+sin(x), 4096 elements",
        kind="jacobian",
        make=_elementwise_make(4096),
        torch_fn=_ns_torch(_elementwise),
        jax_fn=_ns_jax(_elementwise),
    ),
    Workload(
        name="two_input",
        title="two inputs: tanh(A x + B y) * (C y), x (128,), y (64,) -> (256,)",
        kind="jacobian",
        make=_two_input_make,
        torch_fn=_ns_torch(_two_input),
        jax_fn=_ns_jax(_two_input),
        argnums=(0, 1),
        quick=True,
    ),
    Workload(
        name="batch_mlp_64x32",
        title="per-example Jacobians, B=64, tanh MLP 32 -> 256 -> 256 -> 32",
        kind="batch_jacobian",
        make=_mlp_make(32, 32, batch=64),
        torch_fn=_mlp_torch,
        jax_fn=_mlp_jax,
        quick=True,
    ),
    Workload(
        name="conv_input",
        title="small conv net, Jacobian w.r.t. its input image (3, 16, 16) -> (10,)",
        kind="jacobian",
        make=_conv_make,
        torch_fn=_conv_torch,
        jax_fn=_conv_jax,
    ),
    Workload(
        name="module_params",
        title="Jacobian w.r.t. a module's parameters (functional_call), "
        "Linear(16,32)-Tanh-Linear(32,10), batch 8",
        kind="jacobian",
        make=_params_make,
        torch_fn=_params_torch,
        jax_fn=_params_jax,
        primal_is_params=True,
        module=_params_module,
    ),
    Workload(
        name="jacobian_of_256",
        title="Jacobian of an already computed output: tanh MLP 64 -> 256 -> 256 -> 256",
        kind="jacobian_of",
        make=_mlp_make(64, 256),
        torch_fn=_mlp_torch,
        jax_fn=None,
        quick=True,
    ),
    *STRUCTURED,
)


def get_workloads(only: str | list[str] | tuple[str, ...] | None = None, *, quick: bool = False
                  ) -> list[Workload]:
    """The workloads to run.

    Args:
        only: Names, or parts of names, to keep (a comma-separated string or a list), in
            any case, chosen among all workloads; ``None`` keeps all (or the quick ones).
        quick: Without ``only``, keep only the workloads of the ``--quick`` suite.

    Returns:
        The selected workloads, in :data:`WORKLOADS` order.

    Raises:
        ValueError: A filter in ``only`` matches no workload (the message lists them).

    Example:
        >>> [w.name for w in get_workloads("mlp_8x512,batch")]
        ['mlp_8x512', 'batch_mlp_64x32']
    """
    if only is None:
        return [w for w in WORKLOADS if w.quick or not quick]
    # (in any case: the names are lower case, and --only MLP meant them)
    given = [s.strip() for s in (only.split(",") if isinstance(only, str) else only) if s.strip()]
    filters = [s.lower() for s in given]
    for spelled, pattern in zip(given, filters):
        if not any(pattern in w.name for w in WORKLOADS):
            names = ", ".join(w.name for w in WORKLOADS)
            raise ValueError(f"no workload matches {spelled!r}; workloads: {names}")
    return [w for w in WORKLOADS if any(pattern in w.name for pattern in filters)]
