"""The built-in Jacobian benchmark suite behind ``python -m torch_vjp bench``.

* :mod:`~torch_vjp.bench.workloads`: the workloads (:data:`WORKLOADS`), each written once
  for torch and for ``jax.numpy``, with deterministic float64 weights.
* :mod:`~torch_vjp.bench.methods`: the methods compared (:data:`METHODS`): torch_vjp's
  strategies, ``torch.func``, ``torch.autograd`` and, when installed, jax; the slow ones
  (Python loops, full-then-diagonal) run only on request.
* :mod:`~torch_vjp.bench.suite`: the runner (:func:`run_suite`), which checks every method
  against a float64 reference before timing it in interleaved rounds, and the tables and
  JSON of its results: each time a median with its interquartile range, a noisy one
  flagged, a method that torch itself refuses shown as not supported by torch.
* :mod:`~torch_vjp.bench.plot`: the figure (:func:`plot_suite`; needs matplotlib): the
  measured rule of thumb (reverse or forward mode by input and output size), then one
  panel per workload.

``benchmarks/bench_jacobian.py`` in the repository builds its ratio grid from the same
workloads and methods.

Example:
    >>> from torch_vjp.bench import get_workloads, run_suite
    >>> result = run_suite(get_workloads("jacobian_of"), methods=["torch_vjp jacobian_of"],
    ...                    min_run_time=0.01, progress=False, use_jax=False)
    >>> [(r.method, r.status) for r in result.workloads[0].results]
    [('torch_vjp jacobian_of', 'ok')]
"""

from __future__ import annotations

from torch_vjp.bench.methods import (
    HEADLINE,
    METHODS,
    Method,
    get_methods,
    jax_available,
    jax_runs_on,
    reference,
)
from torch_vjp.bench.runner import environment, run_suite
from torch_vjp.bench.suite import (
    SCHEMA,
    MethodResult,
    SuiteResult,
    WorkloadResult,
    load_json,
    tool_of,
)
from torch_vjp.bench.workloads import WORKLOADS, Case, Workload, get_workloads

__all__ = [
    "Workload",
    "Case",
    "WORKLOADS",
    "get_workloads",
    "Method",
    "METHODS",
    "HEADLINE",
    "get_methods",
    "jax_available",
    "jax_runs_on",
    "reference",
    "run_suite",
    "environment",
    "load_json",
    "SuiteResult",
    "WorkloadResult",
    "MethodResult",
    "tool_of",
    "SCHEMA",
    "plot_suite",
]


def plot_suite(*args, **kwargs):  # noqa: D401 - thin lazy wrapper
    """Draws a :class:`SuiteResult` to a PNG; see :func:`torch_vjp.bench.plot.plot_suite`."""
    from torch_vjp.bench.plot import plot_suite as _plot_suite

    return _plot_suite(*args, **kwargs)
