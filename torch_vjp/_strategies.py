"""The registry of Jacobian strategies, and the rule by which ``"auto"`` picks one.

A strategy says which products build the Jacobian and whether they are vectorised:

=============  ======================================================  ============
name           products                                                 vectorised
=============  ======================================================  ============
``"rev"``      one VJP per output element (rows of J)                   ``torch.vmap``
``"fwd"``      one JVP per input element (columns of J)                 ``torch.vmap``
``"rev-loop"`` one VJP per output element                               Python loop
``"fwd-loop"`` one JVP per input element                                Python loop
``"auto"``     ``"rev"`` or ``"fwd"`` by size; a loop when vmap fails   see below
=============  ======================================================  ============

NOTE [auto crossover]
``"rev"`` costs one forward pass plus ``n_out`` vectorised VJPs, ``"fwd"`` ``n_in``
vectorised JVPs, so ``"fwd"`` wins when ``n_out`` is large enough against ``n_in``. Two
measured constants say where: a JVP under vmap costs more than a VJP (forward mode carries
primal and tangent through every operation), :data:`FWD_OUT_IN_RATIO` times as much; and
forward mode pays a larger fixed cost per call (every operation of ``f`` runs through the
forward-mode and vmap layers), worth :data:`FWD_OFFSET` VJPs. ``"auto"`` picks ``"fwd"``
when ``n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET``. The constants were measured, not
guessed: ``benchmarks/crossover.py`` times both strategies on a sweep of tanh MLPs, fits the
rule with the least worst-case regret, and checks ``"auto"`` on the benchmark grid; its
results are in ``benchmarks/results/crossover.json`` and ``.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch_vjp._errors import StrategyError

__all__ = [
    "Strategy",
    "StrategyName",
    "STRATEGIES",
    "FWD_OUT_IN_RATIO",
    "FWD_OFFSET",
    "get_strategy",
    "choose_mode",
    "PerSampleStrategyName",
    "PER_SAMPLE_STRATEGIES",
    "get_per_sample_strategy",
]

StrategyName = Literal["auto", "rev", "fwd", "rev-loop", "fwd-loop"]


@dataclass(frozen=True)
class Strategy:
    """One way to build a Jacobian.

    Attributes:
        name: the registry key, as users pass it (``strategy="rev"``).
        mode: ``"rev"`` (VJPs, one per output element), ``"fwd"`` (JVPs, one per input
            element), or ``None`` for ``"auto"``, which decides per call.
        vectorized: whether the products run under ``torch.vmap`` (``False``: a Python loop,
            for functions that vmap cannot batch).
        summary: one line for tables and docs.
    """

    name: str
    mode: Literal["rev", "fwd"] | None
    vectorized: bool
    summary: str


STRATEGIES: dict[str, Strategy] = {
    "auto": Strategy(
        "auto",
        None,
        True,
        "rev or fwd by input and output size; a loop strategy when vmap cannot batch f",
    ),
    "rev": Strategy("rev", "rev", True, "one VJP per output element, vectorised with vmap"),
    "fwd": Strategy("fwd", "fwd", True, "one JVP per input element, vectorised with vmap"),
    "rev-loop": Strategy("rev-loop", "rev", False, "one VJP per output element, Python loop"),
    "fwd-loop": Strategy("fwd-loop", "fwd", False, "one JVP per input element, Python loop"),
}

#: ``"auto"`` picks ``"fwd"`` when ``n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET``.
#: Measured by ``benchmarks/crossover.py``; see NOTE [auto crossover].
FWD_OUT_IN_RATIO = 2.0
FWD_OFFSET = 128


def get_strategy(name: object, *, call: str) -> Strategy:
    """Looks a strategy up by name.

    Args:
        name: the ``strategy=`` argument as given.
        call: the public call named in the message.

    Returns:
        The registered :class:`Strategy`.

    Raises:
        StrategyError: ``name`` is not registered.

    Example:
        >>> get_strategy("fwd", call="torch_vjp.jacobian").vectorized
        True
    """
    try:
        return STRATEGIES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        pass
    hint = ""
    if isinstance(name, str):
        low = name.strip().lower().replace("_", "-")
        aliases = {
            "reverse": "rev", "reverse-mode": "rev", "backward": "rev", "jacrev": "rev",
            "forward": "fwd", "forward-mode": "fwd", "jacfwd": "fwd",
            "loop": "rev-loop", "for-loop": "rev-loop",
        }
        guess = low if low in STRATEGIES else aliases.get(low)
        if guess is not None:
            hint = f" Did you mean {guess!r}?"
    raise StrategyError(
        f"{call}: unknown strategy {name!r}. Supported: {tuple(STRATEGIES)}.{hint}"
    )


PerSampleStrategyName = Literal["auto", "hooks", "vmap", "loop"]

#: The per-sample strategies (``torch_vjp.per_sample_grads`` and friends): name -> summary.
PER_SAMPLE_STRATEGIES: dict[str, str] = {
    "auto": "per-layer rules where every use of a parameter has one, vmap for the rest (the "
            "Python loop where vmap cannot batch the model)",
    "hooks": "per-layer rules only: one forward and backward of the batch",
    "vmap": "torch.func.vmap over the per-example gradient",
    "loop": "one forward and backward per example",
}


def get_per_sample_strategy(name: object, *, call: str) -> str:
    """Checks a per-sample ``strategy=`` argument.

    Raises:
        StrategyError: ``name`` is not one of :data:`PER_SAMPLE_STRATEGIES`.

    Example:
        >>> get_per_sample_strategy("vmap", call="torch_vjp.per_sample_grads")
        'vmap'
    """
    if isinstance(name, str) and name in PER_SAMPLE_STRATEGIES:
        return name
    lines = "\n".join(f"    {k!r}: {v}" for k, v in PER_SAMPLE_STRATEGIES.items())
    raise StrategyError(
        f"{call}: invalid strategy {name!r}. Supported: {tuple(PER_SAMPLE_STRATEGIES)}.\n"
        f"{lines}"
    )


def choose_mode(n_in: int, n_out: int) -> Literal["rev", "fwd"]:
    """The mode ``"auto"`` uses for a Jacobian with ``n_out`` rows and ``n_in`` columns.

    Args:
        n_in: number of input elements (columns of J).
        n_out: number of output elements (rows of J).

    Returns:
        ``"fwd"`` when ``n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET``, else ``"rev"``.

    Example:
        >>> choose_mode(8, 512), choose_mode(512, 8), choose_mode(256, 256)
        ('fwd', 'rev', 'rev')
    """
    return "fwd" if n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET else "rev"
