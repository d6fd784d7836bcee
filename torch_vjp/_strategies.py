"""The one registry of strategies (the Jacobian functions' and the per-sample functions'),
its one lookup :func:`get_strategy`, and the rule by which a Jacobian's ``"auto"`` picks.

A Jacobian strategy says which products build the Jacobian and whether they are vectorised:

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

Compiled (``compile=True``, and inside the user's ``torch.compile``), the costs differ:
inductor fuses forward mode's tangent arithmetic into the kernels of ``f`` itself, with no
fixed cost per operation, while reverse mode's backward of padding, slicing and indexing
becomes index arithmetic on every element of the Jacobian. :func:`choose_compiled_mode`
picks ``"fwd"`` when ``n_out >= n_in``: on the suite's square Jacobians, compiled forward
mode took 0.36x (laplace 64 x 64), 0.47x (pde 4096), 0.81x (elementwise 4096) and 0.85x
(two inputs) of compiled reverse mode's time, and 1.02-1.06x on the square MLPs (2
threads, one run, ``torch.utils.benchmark.Timer``). Where forward mode has no formula for an
operation of ``f`` (``torch.cdist``), ``compile=True`` finds it with one forward-mode product
when the entry is built and compiles reverse mode; inside the user's own ``torch.compile``
there is no such probe: pass ``strategy="rev"`` there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch_vjp._errors import StrategyError

__all__ = [
    "Strategy",
    "StrategyName",
    "STRATEGIES",
    "FWD_OUT_IN_RATIO",
    "FWD_OFFSET",
    "choose_compiled_mode",
    "get_strategy",
    "choose_mode",
    "PerSampleStrategyName",
    "PER_SAMPLE_STRATEGIES",
    "get_per_sample_strategy",
]

StrategyName = Literal["auto", "rev", "fwd", "rev-loop", "fwd-loop"]
PerSampleStrategyName = Literal["auto", "hooks", "vmap", "loop"]


@dataclass(frozen=True)
class Strategy:
    """One way to compute what a family of functions computes.

    Attributes:
        name: the registry key, as users pass it (``strategy="rev"``).
        summary: one line for tables, docs and messages.
        mode: for a Jacobian: ``"rev"`` (VJPs, one per output element), ``"fwd"`` (JVPs, one
            per input element), or ``None`` for ``"auto"``, which decides per call (and for
            every per-sample strategy).
        vectorized: whether the computation runs under ``torch.vmap`` (``False``: a Python
            loop, for functions that vmap cannot batch).
    """

    name: str
    summary: str
    mode: Literal["rev", "fwd"] | None = None
    vectorized: bool = True


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("auto", "rev or fwd by input and output size; a loop strategy when vmap "
                 "cannot batch f"),
        Strategy("rev", "one VJP per output element, vectorised with vmap", "rev"),
        Strategy("fwd", "one JVP per input element, vectorised with vmap", "fwd"),
        Strategy("rev-loop", "one VJP per output element, Python loop", "rev", False),
        Strategy("fwd-loop", "one JVP per input element, Python loop", "fwd", False),
    )
}

#: The per-sample strategies (``torch_vjp.per_sample_grads`` and friends).
PER_SAMPLE_STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("auto", "per-layer rules where every use of a parameter has one, vmap for "
                 "the rest (the Python loop where vmap cannot batch the model)"),
        Strategy("hooks", "per-layer rules only: one forward and backward of the batch"),
        Strategy("vmap", "torch.func.vmap over the per-example gradient"),
        Strategy("loop", "one forward and backward per example", vectorized=False),
    )
}

#: ``"auto"`` picks ``"fwd"`` when ``n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET``.
#: Measured by ``benchmarks/crossover.py``; see NOTE [auto crossover].
FWD_OUT_IN_RATIO = 2.0
FWD_OFFSET = 128


@dataclass(frozen=True)
class _Family:
    """The strategies of one family of functions, and how its messages name a wrong one."""

    strategies: dict[str, Strategy]
    word: str  # "unknown strategy 'x'" or "invalid strategy 'x'"
    listed: bool  # the message lists every strategy with its summary
    aliases: dict[str, str] = field(default_factory=dict)  # other names users try


#: The one registry: each family of functions and its strategies.
_REGISTRY: dict[str, _Family] = {
    "jacobian": _Family(
        STRATEGIES, "unknown", listed=False,
        aliases={
            "reverse": "rev", "reverse-mode": "rev", "backward": "rev", "jacrev": "rev",
            "forward": "fwd", "forward-mode": "fwd", "jacfwd": "fwd",
            "loop": "rev-loop", "for-loop": "rev-loop",
        },
    ),
    "per-sample": _Family(PER_SAMPLE_STRATEGIES, "invalid", listed=True),
}


def get_strategy(
    name: object, *, call: str, family: Literal["jacobian", "per-sample"] = "jacobian"
) -> Strategy:
    """Looks a strategy up by name: the one check of every ``strategy=`` argument.

    Args:
        name: the ``strategy=`` argument as given.
        call: the public call named in the message.
        family: whose strategies: the Jacobian functions' (:data:`STRATEGIES`) or the
            per-sample functions' (:data:`PER_SAMPLE_STRATEGIES`).

    Returns:
        The registered :class:`Strategy`.

    Raises:
        StrategyError: ``name`` is not registered in ``family``; the message names the
            valid ones (and the likely one, for a name users often try).

    Example:
        >>> get_strategy("fwd", call="torch_vjp.jacobian").vectorized
        True
        >>> get_strategy("loop", call="torch_vjp.per_sample_grads", family="per-sample").summary
        'one forward and backward per example'
    """
    fam = _REGISTRY[family]
    try:
        return fam.strategies[name]  # type: ignore[index]
    except (KeyError, TypeError):
        pass
    hint = ""
    if isinstance(name, str) and fam.aliases:
        low = name.strip().lower().replace("_", "-")
        guess = low if low in fam.strategies else fam.aliases.get(low)
        if guess is not None:
            hint = f" Did you mean {guess!r}?"
    elif name is None:  # (a config's unset value, passed on as it is)
        hint = (" None is not a strategy: leave strategy out, or pass 'auto', for the "
                "default choice.")
    listing = ""
    if fam.listed:
        listing = "\n" + "\n".join(f"    {k!r}: {v.summary}" for k, v in fam.strategies.items())
    raise StrategyError(
        f"{call}: {fam.word} strategy {name!r}. Supported: {tuple(fam.strategies)}.{hint}"
        f"{listing}"
    )


def get_per_sample_strategy(name: object, *, call: str) -> str:
    """The name of a per-sample strategy: ``get_strategy(name, call=call,
    family="per-sample").name``.

    Example:
        >>> get_per_sample_strategy("vmap", call="torch_vjp.per_sample_grads")
        'vmap'
    """
    return get_strategy(name, call=call, family="per-sample").name


def choose_mode(n_in: int, n_out: int) -> Literal["rev", "fwd"]:
    """The mode ``"auto"`` uses for a Jacobian with ``n_out`` rows and ``n_in`` columns.

    Args:
        n_in: number of input elements (columns of J).
        n_out: number of output elements (rows of J).

    Returns:
        ``"fwd"`` when ``n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET``, else ``"rev"``;
        ``"fwd"`` also where there is no input element (and some output element): forward
        mode then computes no product at all, where reverse mode would compute one per
        output element, each budgeted working memory (NOTE [memory model]).

    Example:
        >>> choose_mode(8, 512), choose_mode(512, 8), choose_mode(256, 256), choose_mode(0, 5)
        ('fwd', 'rev', 'rev', 'fwd')
    """
    if n_in == 0 < n_out:
        return "fwd"
    return "fwd" if n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET else "rev"


def choose_compiled_mode(n_in: int, n_out: int) -> Literal["rev", "fwd"]:
    """The mode ``"auto"`` uses for a compiled Jacobian (NOTE [auto crossover]): ``"fwd"``
    when ``n_out >= n_in``.

    Example:
        >>> choose_compiled_mode(256, 256), choose_compiled_mode(512, 8)
        ('fwd', 'rev')
    """
    return "fwd" if n_out >= n_in else "rev"
