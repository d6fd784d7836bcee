"""Sharded Jacobians of an ``f`` whose output differs between ranks though its arguments
and weights agree (NOTE [outputs alike on every rank] in ``torch_vjp._sharded``): every
rank raises, naming the output, and the group still works after. Two ranks, gloo on CPU."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

DT = torch.float64

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")



def _outputs_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        x = torch.arange(1.0, 6.0, dtype=DT)
        k = 3 + rank  # (a number of each rank's own, bound into f: not an argument)
        cases = [
            # reverse mode: rank 1 numbered its rows over 4 outputs, rank 0 over 3, and the
            # gathered Jacobian held another rank's rows, silently
            ("rev", lambda x: x[:k] * 2, r"output is \(4,\) on rank 1 but \(3,\) on rank 0"),
            ("auto", lambda x: x[:k] * 2, r"output is \(4,\) on rank 1 but \(3,\) on rank 0"),
            ("rev", lambda x: {"y": (x * 2)[:4].reshape(2, 2) if k == 3 else (x * 2)[:4]},
             r"output\['y'\] is \(4,\) on rank 1 but \(2, 2\) on rank 0"),
            # forward mode gathers tensors of the output's shape and dtype: gloo aborted the
            # process ("Received data size doesn't match expected size")
            ("fwd", lambda x: x[:k] * 2,
             r"output is \(4,\) float64 on rank 1 but \(3,\) float64 on rank 0"),
            ("fwd", lambda x: (x * 2).to(torch.float32 if k == 3 else DT),
             r"output is \(5,\) float64 on rank 1 but \(5,\) float32 on rank 0"),
        ]
        for strategy, f, says in cases:
            with pytest.raises(tv.JacobianCallError, match=(
                    r"(?s)^torch_vjp\.jacobian: the outputs of f differ between ranks: "
                    + says + r".*same shapes and dtypes on every rank.*Fix: make f the same "
                    r"function on every rank.*process_group=None")):
                tv.jacobian(f, x, strategy=strategy, process_group=group)
        # with shard=True too: each rank's range was of its own count of products
        with pytest.raises(tv.JacobianCallError, match=r"outputs of f differ between ranks"):
            tv.jacobian(lambda x: x[:k] * 2, x, strategy="rev", process_group=group,
                        shard=True)
        # batch_jacobian: the rows' shapes
        with pytest.raises(tv.JacobianCallError, match=(
                r"output is \(4,\) on rank 1 but \(3,\) on rank 0")):
            tv.batch_jacobian(lambda b: b[:, :k] * 2, x.reshape(1, 5).repeat(2, 1),
                              strategy="rev", process_group=group)
        # the group still works, and outputs alike on every rank are the Jacobian
        for strategy in ("rev", "fwd", "auto"):
            got = tv.jacobian(lambda x: x[:4] * x[1:], x, strategy=strategy,
                              process_group=group)
            torch.testing.assert_close(got, torch.func.jacrev(lambda x: x[:4] * x[1:])(x),
                                       rtol=0, atol=0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharded_jacobian_of_an_f_whose_outputs_differ_between_ranks_raises(spawn_within):
    spawn_within(_outputs_worker, 2, 120)
