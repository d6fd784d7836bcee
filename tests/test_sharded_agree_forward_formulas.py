"""A sharded Jacobian through an operator whose forward-mode formula torch has wrong (NOTE
[sharded forward mode through a wrong formula] in ``torch_vjp._sharded_formulas``): a named
``"fwd"`` or ``"fwd-loop"`` refuses on every rank, also where only one rank's f runs the
operator, and on a later call that each rank remembers differently; ``"auto"`` in forward
mode, where the values agree by a coincidence of the point (zeros, a sum that is 0) or are
not compared (an infinity in x), takes reverse mode on every rank with the one-process
warning; and reverse mode through det at a singular matrix runs det's backward in grad
mode, as on one process. It had returned Jacobians wrong by the size of the entries without
a word.
float64, against reverse rows one at a time (``torch.scatter_reduce``'s backward is right;
torch.func.jacrev cannot run it). Two ranks, gloo on CPU, one spawned group; a rank left
waiting fails the test at its deadline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

from _references import alike, caught, in_gloo_group, meet, reverse_rows

D = torch.float64
INF = float("inf")
IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3])
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _prod_by_scatter(a):
    return torch.ones(4, dtype=D).scatter_reduce(0, IDX, a.repeat(2), "prod",
                                                 include_self=False)


def _prod_by_hand(a):
    """What :func:`_prod_by_scatter` computes, through torch.prod (whose forward-mode
    formula is right)."""
    src = a.repeat(2)
    return torch.stack([src[IDX == j].prod() for j in range(4)])


def _tall(prod):
    """4 inputs, 804 outputs: "auto" starts from forward mode."""
    def f(a):
        return torch.cat([prod(a[:4]) * a[:4].sum(), a[:4].sin().repeat(200)])
    return f


_X1 = torch.rand(4, dtype=D, generator=torch.Generator().manual_seed(4)) + 0.5


def _summing_to_zero():
    v = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    return v - v.mean()


def _refused(call, op):
    with pytest.raises(tv.StrategyError) as info:
        call()
    msg = str(info.value)
    for strategy in ("fwd", "fwd-loop"):
        if f"strategy={strategy!r}" in msg:
            break
    else:
        raise AssertionError(msg)
    assert msg.startswith(f"torch_vjp.jacobian: strategy={strategy!r} computes with "
                          f"forward-mode AD, and torch's forward-mode formula of {op} is "
                          f"wrong"), msg
    assert "so the Jacobian would be wrong" in msg, msg
    assert "Fix: strategy='rev' (reverse mode, whose formula is right), or 'auto'" in msg, msg
    return msg


def _named_forward_refuses(rank, world, group):
    """Every rank refuses a named forward strategy, on the first call (read) and the next
    (remembered): where every rank's f runs the operator, and where only rank 1's does
    (rank 0 computes the same products through torch.prod; rank 1 then remembers the
    operator and rank 0 none, and rank 1 refused before calling f while rank 0 ran its
    products). f is called as often on every rank."""
    scatter = "torch.scatter_reduce(reduce='prod')"
    calls = [0]

    def one_rank_scatters(a):
        calls[0] += 1
        meet(group, world)
        return _tall(_prod_by_scatter if rank == 1 else _prod_by_hand)(a)

    for strategy in ("fwd", "fwd-loop"):
        f = _tall(_prod_by_scatter)
        for _ in range(2):
            _refused(lambda: tv.jacobian(f, _X1, strategy=strategy, process_group=group),
                     scatter)
            _refused(lambda: tv.jacobian(one_rank_scatters, _X1, strategy=strategy,
                                         process_group=group), scatter)
    alike(calls[0], group, world)
    # (the premise: the products rank 0 computes are right, rank 1's wrong)
    t = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(9))
    want = reverse_rows(_tall(_prod_by_hand), _X1) @ t
    fwd = torch.func.jvp(_tall(_prod_by_scatter), (_X1,), (t,))[1]
    assert (fwd - want).abs().max() > 1
    torch.testing.assert_close(torch.func.jvp(_tall(_prod_by_hand), (_X1,), (t,))[1], want)

    # det at a singular matrix: the shards hold columns of the singular matrix on rank 0
    # and of the regular one on rank 1
    A = torch.stack([SINGULAR, torch.randn(3, 3, dtype=D, generator=torch.Generator()
                                           .manual_seed(1))]).reshape(-1)
    msg = _refused(lambda: tv.jacobian(lambda m: torch.linalg.det(m.reshape(-1, 3, 3)), A,
                                       strategy="fwd", process_group=group),
                   "torch.linalg.det")
    assert "refused at every point" in msg, msg
    b = torch.randn(3, 2, dtype=D, generator=torch.Generator().manual_seed(2))
    u = torch.triu(torch.rand(3, 3, dtype=D, generator=torch.Generator().manual_seed(5))) + 1
    msg = _refused(lambda: tv.jacobian(
        lambda m: torch.triangular_solve(b, m.reshape(3, 3)).solution, u.reshape(-1),
        strategy="fwd", process_group=group), "torch.triangular_solve")
    assert "torch.linalg.solve_triangular" in msg, msg


def _auto_message(said):
    """The one warning of a call that took reverse mode for a wrong forward formula."""
    assert len(said) == 1, said
    msg = said[0]
    assert msg.startswith("torch_vjp.jacobian: forward mode (strategy='auto' chooses it for "
                          "a Jacobian with more output than input elements) agrees with a "
                          "reverse product at this point, but it runs torch's forward-mode "
                          "formula of torch.scatter_reduce(reduce='prod') in f ("), msg
    assert "computed the Jacobian with reverse mode" in msg, msg
    assert "Pass strategy='rev' to compute it that way directly" in msg, msg
    return msg


def _auto_takes_reverse_mode(rank, world, group):
    """At a first point where forward mode agrees with the reverse product (zeros; a sum
    that is 0, where only rank 1's f runs the operator), every rank computes reverse-mode
    rows, warns once, and remembers reverse mode: the next call, at a point where forward
    mode is wrong by 5-7, is right. f is called as often on every rank."""
    calls = [0]

    def one_rank_scatters(a):
        calls[0] += 1
        meet(group, world)
        return _tall(_prod_by_scatter if rank == 1 else _prod_by_hand)(a)

    plain = _tall(_prod_by_scatter)
    for f, x0 in ((plain, torch.zeros(4, dtype=D)), (one_rank_scatters, _summing_to_zero())):
        want = _tall(_prod_by_hand)
        got, said = caught(lambda: tv.jacobian(f, x0, process_group=group))
        torch.testing.assert_close(got, reverse_rows(want, x0), rtol=1e-10, atol=1e-10)
        assert "only by a coincidence of the point" in _auto_message(said)
        got, said = caught(lambda: tv.jacobian(f, _X1, process_group=group))
        torch.testing.assert_close(got, reverse_rows(want, _X1), rtol=1e-10, atol=1e-10)
        assert not said, said
    alike(calls[0], group, world)


def _auto_at_a_point_it_cannot_check(rank, world, group):
    """x holds an infinity in an entry f never reads: no values are compared, and every
    rank takes reverse mode from the graph (forward mode is wrong by 5-7 at this point),
    warns that the values went unchecked, and remembers nothing."""
    calls = [0]

    def scatter_unread_entry(a):
        calls[0] += 1
        meet(group, world)
        return _tall(_prod_by_scatter)(a)

    x = torch.cat([_X1, torch.tensor([INF], dtype=D)])
    got, said = caught(lambda: tv.jacobian(scatter_unread_entry, x, process_group=group))
    torch.testing.assert_close(got, reverse_rows(_tall(_prod_by_hand), x), rtol=1e-10,
                               atol=1e-10)
    assert "Here the point x holds a NaN or an infinity" in _auto_message(said)
    assert not [k for k in fwdcheck.CHECKED if "scatter_unread_entry" in repr(k)]
    alike(calls[0], group, world)


def _auto_through_det_at_a_singular_matrix(rank, world, group):
    """Reverse mode through det at a singular matrix (a shard of rank 0's in the wide
    Jacobian; in the tall one, forward mode's route after the graph names det): the rows
    run det's backward in grad mode, as on one process (its branch without grad mode is
    wrong there by the size of the entries, and every rank had returned those rows), equal
    to torch.func.jacrev's."""
    W = torch.randn(40, dtype=D, generator=torch.Generator().manual_seed(7))
    A = torch.stack([SINGULAR, torch.randn(3, 3, dtype=D, generator=torch.Generator()
                                           .manual_seed(1))]).reshape(-1)

    def wide(m):
        return torch.linalg.det(m.reshape(-1, 3, 3))

    def tall(m):  # (9 inputs, 40 outputs: "auto" starts from forward mode)
        return torch.linalg.det(m.reshape(3, 3)) * W + m.sum()

    for f, x in ((wide, A), (tall, A[:9])):
        got, _ = caught(lambda: tv.jacobian(f, x, process_group=group))
        torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-10, atol=1e-10)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_named_forward_refuses, _auto_takes_reverse_mode,
                                           _auto_at_a_point_it_cannot_check,
                                           _auto_through_det_at_a_singular_matrix))


def test_a_wrong_forward_formula_sets_the_route_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 240, forkserver=True)
