"""A sharded Jacobian calls f as one process does. A named ``"rev"`` through an operator
whose batching rule torch has wrong (``torch.cdist``'s backward under ``torch.vmap``)
computes its rows again one reverse product at a time on every rank (NOTE [sharded reverse
mode through a wrong formula] in ``torch_vjp._sharded_formulas``), from the pullback of its
products' call of f, as one process does: it had called f a second time, so an f that draws
(dropout, ``torch.rand``) returned the Jacobian of another draw than one process's (off by
0.38), its random generator moved on twice, and an f that counts its calls was called once
more. float64, against one process and ``torch.autograd.functional.jacobian``. Two ranks,
gloo on CPU, one spawned group; a rank left waiting fails the test at its deadline."""

from __future__ import annotations

import random
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import alike, in_gloo_group

D = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _seeded(seed):
    """Every generator seeded alike on every rank (the random module's and numpy's too: a
    sharded call compares them, and calls f once more where they differ)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)


def _counted(f):
    calls = [0]

    def counted(a):
        calls[0] += 1
        return f(a)

    return counted, calls


def _jacobian(fn, x, seed, **kw):
    """``(J, calls, the generator's next draw)`` of ``tv.jacobian(fn, x, **kw)`` from
    ``seed``."""
    counted, calls = _counted(fn)
    _seeded(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(counted, x, **kw)
    return got, calls[0], torch.rand(2, dtype=D)


def _rerun_draws_once(rank, world, group):
    """Through cdist, under a named "rev": the Jacobian of the products' own draw (a scale
    drawn inside f, a dropout mask), f called as often as on one process, and the generator
    left where one process leaves it; with aux, aux of that call."""
    y = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(2))

    def scaled(a):
        return torch.cdist(a, y) * (1 + torch.rand((), dtype=D))

    def dropped(a):
        return torch.cdist(torch.nn.functional.dropout(a, 0.5, training=True), y)

    for fn in (scaled, dropped):
        one, one_calls, one_next = _jacobian(fn, x, 5, strategy="rev")
        got, calls, after = _jacobian(fn, x, 5, strategy="rev", process_group=group)
        # (the reference: f's draw from the seed, its Jacobian by plain autograd)
        _seeded(5)
        torch.testing.assert_close(
            one, torch.autograd.functional.jacobian(_frozen(fn), x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, one, rtol=1e-12, atol=1e-12)
        assert calls == one_calls == 1, (calls, one_calls)
        torch.testing.assert_close(after, one_next, rtol=0, atol=0)
        alike(got, group, world)
    # (with aux: the aux of the products' call)
    _seeded(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, aux = tv.jacobian(lambda a: (scaled(a), torch.rand(())), x, strategy="rev",
                             has_aux=True, process_group=group)
    _seeded(5)
    torch.rand((), dtype=D)
    assert aux == torch.rand(()), aux


def _frozen(fn):
    """``fn`` with the generator put back, before every call, where it is now."""
    state = torch.get_rng_state()

    def frozen(a):
        torch.set_rng_state(state)
        return fn(a)

    return frozen


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_rerun_draws_once,))


def test_a_named_rev_computed_again_without_vmap_calls_f_once(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
