"""A sharded Jacobian whose opening exchange (NOTE [sharded Jacobian] in
``torch_vjp._sharded``) cannot be prepared on one rank: what that rank says of its call (the
checksums of f's arguments) raises there. That rank raises its own error, untouched, and
the others an error naming it, instead of waiting in the exchange until the group's
timeout. Two ranks, gloo on CPU, one spawned group; a rank left waiting fails the test at
its deadline."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import in_gloo_group

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _Unreadable(torch.Tensor):
    """A tensor whose values cannot be read as float64 (its ``to`` raises)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise ValueError("this tensor's values cannot be converted here")
        return super().__torch_function__(func, types, args, kwargs or {})


def _checks(rank, world, group):
    x = torch.linspace(0.2, 0.9, 4, dtype=DT)
    w = torch.arange(1.0, 5.0, dtype=DT)
    w = w.as_subclass(_Unreadable) if rank == 1 else w

    def f(x, w):
        return x.sin() * w.as_subclass(torch.Tensor)

    if rank == 1:
        with pytest.raises(ValueError, match="values cannot be converted here"):
            tv.jacobian(f, x, w, strategy="rev", process_group=group)
    else:
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)rank 1 of the process_group rejected its call before any product, so "
                r"this rank \(0\) has no whole Jacobian to return\. Rank 1 said: ValueError: "
                r"this tensor's values cannot be converted here.*rank 1's traceback")):
            tv.jacobian(f, x, w, strategy="rev", process_group=group)
    # the group still works
    got = tv.jacobian(f, x, torch.arange(1.0, 5.0, dtype=DT), strategy="rev",
                      process_group=group)
    want = torch.func.jacrev(lambda x: x.sin() * torch.arange(1.0, 5.0, dtype=DT))(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_checks,))


def test_a_call_one_rank_cannot_describe_raises_on_every_rank(spawn_within):
    spawn_within(_two_ranks, 2, 120, forkserver=True)
