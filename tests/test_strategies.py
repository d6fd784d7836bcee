"""torch_vjp/_strategies.py: the one registry of strategies, its one lookup, and the rule by
which a Jacobian's "auto" picks a mode."""

from __future__ import annotations

import re

import pytest

import torch_vjp as tv
from torch_vjp._strategies import (
    FWD_OFFSET,
    FWD_OUT_IN_RATIO,
    PER_SAMPLE_STRATEGIES,
    STRATEGIES,
    choose_mode,
    get_per_sample_strategy,
    get_strategy,
)


@pytest.mark.parametrize("family, table", [("jacobian", STRATEGIES),
                                           ("per-sample", PER_SAMPLE_STRATEGIES)])
def test_every_registered_strategy_is_found_by_its_name(family, table):
    for name, strategy in table.items():
        assert get_strategy(name, call="c", family=family) is strategy
        assert strategy.name == name and strategy.summary


def test_jacobian_strategies_say_their_mode_and_whether_they_vectorise():
    assert {n: (s.mode, s.vectorized) for n, s in STRATEGIES.items()} == {
        "auto": (None, True), "rev": ("rev", True), "fwd": ("fwd", True),
        "rev-loop": ("rev", False), "fwd-loop": ("fwd", False),
    }


@pytest.mark.parametrize("name, hint", [
    ("bogus", ""), ("reverse", " Did you mean 'rev'?"), ("JACFWD", " Did you mean 'fwd'?"),
    ("for_loop", " Did you mean 'rev-loop'?"),
    (None, " None is not a strategy: leave strategy out, or pass 'auto', for the default "
           "choice."),
    (["rev"], ""),
], ids=repr)
def test_unknown_jacobian_strategy(name, hint):
    with pytest.raises(tv.StrategyError) as info:
        get_strategy(name, call="torch_vjp.jacobian")
    assert str(info.value) == (
        f"torch_vjp.jacobian: unknown strategy {name!r}. Supported: "
        f"('auto', 'rev', 'fwd', 'rev-loop', 'fwd-loop').{hint}"
    )
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", ["jacrev", "rev", None, ["vmap"]], ids=repr)
def test_invalid_per_sample_strategy_lists_each_with_its_summary(name):
    with pytest.raises(tv.StrategyError) as info:
        get_strategy(name, call="torch_vjp.per_sample_grads", family="per-sample")
    lines = str(info.value).split("\n")
    hint = ("" if name is not None else " None is not a strategy: leave strategy out, or "
            "pass 'auto', for the default choice.")
    assert lines[0] == (f"torch_vjp.per_sample_grads: invalid strategy {name!r}. Supported: "
                        f"('auto', 'hooks', 'vmap', 'loop').{hint}")
    assert [re.match(r"    '([a-z]+)': \S", line).group(1) for line in lines[1:]] == [
        "auto", "hooks", "vmap", "loop"]


def test_per_sample_lookup_by_name():
    assert get_per_sample_strategy("hooks", call="c") == "hooks"
    with pytest.raises(tv.StrategyError, match=r"^c: invalid strategy 'fwd'"):
        get_per_sample_strategy("fwd", call="c")


@pytest.mark.parametrize("n_in, n_out", [(8, 512), (512, 8), (256, 256), (1, 1), (100, 328),
                                         (100, 329)])
def test_auto_crossover(n_in, n_out):
    want = "fwd" if n_out > FWD_OUT_IN_RATIO * n_in + FWD_OFFSET else "rev"
    assert choose_mode(n_in, n_out) == want
