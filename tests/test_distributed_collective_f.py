"""Sharded Jacobians whose ranks must pair their calls: of an ``f`` that runs a collective
itself (``dist.all_reduce`` inside f), every rank calls f as many times (NOTE [every rank
runs as many products] in ``torch_vjp._sharded_work``), with fewer products than ranks and
shares of unequal sizes, in every strategy, and with chunks each rank plans its own way
(NOTE [the ranks agree on their chunks]); outputs of f that differ between ranks (NOTE
[outputs alike on every rank] in ``torch_vjp._sharded``); "auto"'s check at the scale of
the numbers it compares, on every rank; "auto" through a wrong backward formula (NOTE [a
sharded reverse product checked forward] in ``torch_vjp._sharded_forward``). Two ranks, gloo on CPU, one spawned group for all of them (a third rank asserts nothing
these do not: a rank without products, shares of unequal sizes); a rank left waiting fails
the test at its deadline instead of blocking the suite."""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv
from torch_vjp._sharded_work import shard_range

from _references import caught as _caught, central_difference as _fd, in_gloo_group
from _references import jvp_columns as _jvp_columns

DT = torch.float64
STRATEGIES = ("rev", "fwd", "auto", "rev-loop", "fwd-loop")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class _Mine(Exception):
    pass


def _collective_checks(rank, world, group):
    """An f that runs a collective itself, every strategy: fewer columns or rows than ranks,
    and shares of unequal sizes."""
    w = torch.tensor([2.0, 3.0, 0.5, -1.5, 0.25], dtype=DT)

    def f(x):
        # (the collective sums equal values: the mean is the rank's own value, and the
        # in-place all_reduce carries no derivative, hence the division)
        y = x.sin() * w[: x.numel()]
        dist.all_reduce(y, group=group)
        return y / world

    def single(x):
        return x.sin() * w[: x.numel()] / world

    # fewer columns or rows than ranks (some rank has none), and shares of unequal
    # sizes: 1 and 3 on 2 ranks, 2 and 4 on 3
    for n in (world - 1, world + 1):
        x = torch.linspace(0.1, 0.9, n, dtype=DT)
        want = torch.func.jacfwd(single)(x)
        for strategy in STRATEGIES:
            for kwargs in ({}, {"chunk_size": 1}):
                what = f"rank {rank}, n={n}, {strategy}, {kwargs}"
                sh = _whole_and_shard(f, x, want, strategy, group, kwargs, what)
                assert (sh.start, sh.stop) == shard_range(n, rank, world), what
    # batch_jacobian: the products of one row, fewer than ranks
    xb = torch.linspace(0.1, 0.9, 3, dtype=DT).reshape(3, 1)
    for strategy in STRATEGIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tv.batch_jacobian(f, xb, strategy=strategy, process_group=group)
        torch.testing.assert_close(got, tv.batch_jacobian(single, xb), rtol=1e-12, atol=0)


def _whole_and_shard(f, x, want, strategy, group, kwargs, what):
    """The sharded Jacobian of ``f`` at ``x``, whole and as this rank's shard, against
    ``want``; returns the shard."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(f, x, strategy=strategy, process_group=group, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0,
                                   msg=lambda m: f"{what}: {m}")
        sh = tv.jacobian(f, x, strategy=strategy, process_group=group, shard=True, **kwargs)
    cols = want if sh.mode == "rev" else want.T
    torch.testing.assert_close(sh.values, cols[sh.start:sh.stop], rtol=1e-12, atol=0,
                               msg=lambda m: f"{what} shard: {m}")
    return sh


def _chunk_checks(rank, world, group):
    """Ranks that plan chunks of their own (NOTE [the ranks agree on their chunks] in
    ``torch_vjp._sharded_work``): every rank runs as many chunks, so an f that runs a
    collective is called as many times on every rank; a rank whose f fails before its
    chunks are planned, or whose planning fails, makes every rank raise."""
    w = torch.tensor([2.0, 3.0, 0.5, -1.5, 0.25, 1.25], dtype=DT)

    def f(x):
        y = x.sin() * w[: x.numel()]
        dist.all_reduce(y, group=group)  # (equal values: no derivative, hence / world)
        return y / world

    def single(x):
        return x.sin() * w[: x.numel()] / world

    x = torch.linspace(0.1, 0.9, 6, dtype=DT)
    want = torch.func.jacfwd(single)(x)
    # chunks of each rank's own: 3 products in chunks of 1 on rank 0, all at once on
    # rank 1 (forward mode calls f once per chunk: 3 calls against 1 waited for ever)
    mine = [{"chunk_size": 1}, {}][rank]
    budget = [{"max_memory": 1100}, {}][rank]
    for strategy in ("fwd", "rev", "auto"):
        for kwargs in (mine, budget):
            what = f"rank {rank}, {strategy}, {kwargs}"
            _whole_and_shard(f, x, want, strategy, group, kwargs, what)

    # f fails on rank 1 before any chunk is planned, while rank 0 plans chunks of one:
    # every rank raises, rank 1 its own error, rank 0 one naming rank 1
    def fails_on_1(x):
        if rank == 1:
            raise _Mine("rank 1's own error")
        return x.sin()

    for strategy in ("fwd", "rev"):
        if rank == 1:
            with pytest.raises(_Mine, match="rank 1's own error"):
                tv.jacobian(fails_on_1, x, strategy=strategy, process_group=group)
        else:
            with pytest.raises(tv.JacobianCallError, match=(
                    r"(?s)rank 1 of the process_group failed while computing its share "
                    r"of the Jacobian.*Rank 1 said: .*rank 1's own error")):
                tv.jacobian(fails_on_1, x, strategy=strategy, process_group=group,
                            chunk_size=1)

    # planning fails on rank 1 alone (a budget too small there): every rank raises
    if rank == 1:
        with pytest.raises(tv.JacobianMemoryError):
            tv.jacobian(f, x, strategy="fwd", process_group=group, max_memory=10)
    else:
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)rank 1 of the process_group failed.*Rank 1 said: "
                r".*JacobianMemoryError")):
            tv.jacobian(f, x, strategy="fwd", process_group=group, chunk_size=1)

    # the group still works
    got = tv.jacobian(f, x, strategy="fwd", process_group=group)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def _outputs_checks(rank, world, group):
    """An f whose output differs between ranks though its arguments and weights agree (NOTE
    [outputs alike on every rank] in ``torch_vjp._sharded``): every rank raises, naming the
    output, and the group still works after."""
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


def _cancelling():
    """A float32 f whose Jacobian entries are differences of products near 1e6 (rounded at
    about 0.1), about 1 in size, in the output rows of rank 0's share only: its reverse
    products under vmap and one at a time differ by that rounding, far above sqrt(eps) of
    the Jacobian, and agree to the rounding of the numbers they combine."""
    g = torch.Generator().manual_seed(0)
    A = 1000 + torch.rand(4, 8, generator=g)
    C = torch.sqrt(A * A - 1 - torch.rand(4, 8, generator=g))
    A[2:], C[2:] = 1.0, 0.5  # (rank 1's rows: no cancellation, its own check agrees)
    x = torch.randn(4, generator=g)

    def f(x):
        y = x[:, None]
        return (y * A) * A - (y * C) * C

    return f, x


def _scale_checks(rank, world, group):
    """The check of "auto" (NOTE [sharded auto, checked] in ``torch_vjp._sharded_check``)
    compares its routes at the scale of the numbers the products are computed from, as one
    process does (NOTE [the scale of what is compared] in ``torch_vjp._engine.fwdnoise``),
    every rank measuring it, so that an f that runs collectives pairs its calls."""
    f, x = _cancelling()
    want = torch.func.jacrev(f)(x)
    calls = []

    def with_collective(x):
        # (a collective in every call of f: a call on some ranks only waits for ever)
        s = torch.ones(())
        dist.all_reduce(s, group=group)
        calls.append(1)
        return f(x) * (s / world)

    for fn in (f, with_collective):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)  # (refused: a warning)
            got = tv.jacobian(fn, x, process_group=group)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # every rank called f as many times
    counts = [None] * world
    dist.all_gather_object(counts, len(calls), group=group)
    assert len(set(counts)) == 1, counts
    # a scalar f: its one product is rank 1's, and rank 0, with nothing to compare,
    # still calls f in the check (it skipped that call, and rank 1's collective in f
    # waited for ever)
    def scalar(x):
        s = torch.ones((), dtype=x.dtype)
        dist.all_reduce(s, group=group)
        return (x.sin() * s).sum()

    xd = x.double()
    torch.testing.assert_close(tv.jacobian(scalar, xd, process_group=group),
                               world * xd.cos(), rtol=1e-12, atol=0)
    # a wrong formula still disagrees at that scale (rounding is not an excuse)
    bad = lambda x: torch.cdist(x.reshape(2, 2), x.reshape(2, 2) ** 2)  # noqa: E731
    with pytest.warns(tv.JacobianWarning, match=r"disagrees with a reverse product"):
        tv.jacobian(bad, x.double(), process_group=group)


def _scatter_f(n_out=None, collective=False):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, dtype=DT, generator=g)
    W = None if n_out is None else torch.randn(n_out, 4, dtype=DT, generator=g)

    def f(x):
        y = torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()
        if collective:  # (sums equal values: the mean is the rank's own, no derivative)
            z = y.detach().clone()
            dist.all_reduce(z)
            y = y + (z / dist.get_world_size() - y.detach())
        return y if W is None else W @ y.tanh()

    return f


def _reverse_wrong_checks(rank, world, group):
    """"auto" through a backward formula torch computes wrongly (torch 2.13:
    torch.as_strided_scatter's): every rank checks the reverse product against a forward
    product and returns forward mode's Jacobian (NOTE [a sharded reverse product checked
    forward] in ``torch_vjp._sharded_forward``), as one process does; float64, against
    torch.func.jvp columns and finite differences."""
    x = torch.randn(4, dtype=DT, generator=torch.Generator().manual_seed(1))

    # reverse mode chosen by size (4 by 4): the wrong backward agreed with itself
    f = _scatter_f()
    want = _jvp_columns(f, x)
    torch.testing.assert_close(want, _fd(f, x))
    J, said = _caught(lambda: tv.jacobian(f, x, process_group=group))
    torch.testing.assert_close(J, want, msg=lambda m: f"rank {rank}, square: {m}")
    told = [m for m in said if "disagrees with a forward product" in m]
    assert len(told) == 1, said
    assert "wrong backward formula" in told[0] and "as_strided_scatter" in told[0]
    assert "central difference" in told[0] and "Pass strategy='fwd-loop'" in told[0]
    # later calls take the route every rank remembers, silently, and stay right,
    # shard=True too (forward mode's columns)
    J2, said2 = _caught(lambda: tv.jacobian(f, x, process_group=group))
    torch.testing.assert_close(J2, want)
    assert not [m for m in said2 if "forward product" in m], said2
    sh = tv.jacobian(f, x, process_group=group, shard=True)
    assert sh.mode == "fwd" and (sh.start, sh.stop) == shard_range(4, rank, world)
    torch.testing.assert_close(sh.values, want.T[sh.start:sh.stop])

    # forward mode chosen by size (400 by 4): its right columns were replaced by the
    # wrong reverse mode, with a warning naming forward mode wrong
    f = _scatter_f(n_out=400)
    J, said = _caught(lambda: tv.jacobian(f, x, process_group=group))
    torch.testing.assert_close(J, _jvp_columns(f, x))
    torch.testing.assert_close(J, _fd(f, x))
    assert not [m for m in said if "wrong forward-mode derivative" in m], said
    sh = tv.jacobian(f, x, process_group=group, shard=True)
    assert sh.mode == "fwd"

    # batch_jacobian: one row's products for every row
    f1 = _scatter_f()
    xb = torch.randn(3, 4, dtype=DT, generator=torch.Generator().manual_seed(2))
    J, _ = _caught(lambda: tv.batch_jacobian(
        lambda xb: torch.stack([f1(r) for r in xb]), xb, process_group=group))
    torch.testing.assert_close(J, torch.stack([_jvp_columns(f1, r) for r in xb]))

    # an f that runs a collective: every rank calls it as many times in the check
    fc = _scatter_f(collective=True)
    J, _ = _caught(lambda: tv.jacobian(fc, x, process_group=group))
    torch.testing.assert_close(J, want)


def _two_ranks(rank, world, init_file):
    in_gloo_group(rank, world, init_file, (_collective_checks, _chunk_checks, _outputs_checks, _scale_checks, _reverse_wrong_checks))


def test_sharded_jacobians_whose_ranks_must_pair_their_calls(spawn_within):
    # (one group for every check: a process started costs more than the checks)
    spawn_within(_two_ranks, 2, 420, forkserver=True)


def test_padded_count_is_the_largest_share():
    from torch_vjp._sharded_work import padded_count

    for n in range(12):
        for world in (1, 2, 3, 5):
            sizes = [b - a for a, b in (shard_range(n, r, world) for r in range(world))]
            assert padded_count(n, world) == max(sizes)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_jacobian_of_an_f_that_raises_calls_it_once(one_rank_group, strategy):
    calls = []

    def f(x):
        calls.append(1)
        raise _Mine("f's own error")

    with pytest.raises(_Mine, match="f's own error") as caught:
        tv.jacobian(f, torch.ones(3, dtype=DT), strategy=strategy,
                    process_group=one_rank_group)
    assert len(calls) == 1
    # (untouched: not raised again while handling a first call's error)
    assert caught.value.__context__ is None and caught.value.__cause__ is None


def test_sharded_rev_loop_still_computes_what_torch_func_refuses(one_rank_group):
    class OldStyle(torch.autograd.Function):  # (forward takes ctx: torch.func refuses it)
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos()

    x = torch.linspace(0.1, 0.9, 4, dtype=DT)
    got = tv.jacobian(OldStyle.apply, x, strategy="rev-loop", process_group=one_rank_group)
    torch.testing.assert_close(got, torch.diag(x.cos()), rtol=1e-12, atol=0)


def _not_a_group_case(rank, world, init_file, case):
    import os
    import time

    # (a short timeout: the waiting rank raises at it)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    done = init_file + ".done"
    try:
        torch.set_num_threads(1)
        x = torch.linspace(0.1, 0.9, 3, dtype=DT)
        if rank == 1:
            if case == "none":  # (a call of its own: it computes alone)
                got = tv.jacobian(torch.sin, x, process_group=None)
                torch.testing.assert_close(got, torch.diag(x.cos()))
            else:
                with pytest.raises(tv.JacobianOptionError, match=(
                        r"(?s)process_group is 'WORLD', but it must be a torch.distributed "
                        r"ProcessGroup.*Fix: pass process_group=torch.distributed.group.WORLD"
                        r".*The other ranks cannot be told: if they passed a process group, "
                        r"they wait for this rank in that group's first exchange until the "
                        r"group's timeout.*Pass the same process_group on every rank")):
                    tv.jacobian(torch.sin, x, process_group="WORLD")
            # (kept alive until rank 0 has raised: a rank gone fails its exchange otherwise)
            deadline = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            try:
                with pytest.raises(tv.JacobianCallError, match=(
                        r"(?s)^torch_vjp\.jacobian: the exchange that opens a sharded Jacobian "
                        r"failed on this rank \(0\) of process_group: .*Some rank of the group "
                        r"did not join it in time: one that passed process_group=None.*an "
                        r"object that is no group.*Fix: pass the same process_group on every "
                        r"rank of the group")) as caught:
                    tv.jacobian(torch.sin, x, process_group=dist.group.WORLD)
                assert isinstance(caught.value.__cause__, RuntimeError)
            finally:
                open(done, "w").close()
    finally:
        dist.destroy_process_group()


def _not_a_group_worker(rank, world, init_file):
    # (both cases in one spawned run: a group of its own each, as the waiting rank's group
    # is unusable after its timeout)
    for case in ("none", "not-a-group"):
        _not_a_group_case(rank, world, f"{init_file}-{case}", case)


def test_a_rank_whose_process_group_is_none_or_no_group_leaves_the_others_a_clear_error(
        spawn_within):
    spawn_within(_not_a_group_worker, 2, 180, forkserver=True)


def test_a_group_not_initialised_says_the_other_ranks_cannot_be_told(one_rank_group):
    dist.destroy_process_group()
    with pytest.raises(tv.JacobianOptionError, match=(
            r"(?s)torch\.distributed is not initialised.*Fix: call "
            r"torch\.distributed\.init_process_group.*The other ranks cannot be told: if they "
            r"passed a process group, they wait for this rank.*Pass the same process_group "
            r"on every rank")):
        tv.jacobian(torch.sin, torch.ones(2, dtype=DT), process_group=one_rank_group)
