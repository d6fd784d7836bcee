"""Sharded Jacobians (``tv.jacobian(..., process_group=...)``, NOTE [sharded Jacobian] in
``torch_vjp._sharded``) with real process groups: gloo on CPU, 2 and 3 ranks started with
torch.multiprocessing, one group per world size running the whole case table.

Every rank checks its own result against ``torch.func.jacrev`` computed on one process, in
float64: the gathered Jacobian equals it on every rank, and with ``shard=True`` each rank's
values are exactly the rows (reverse mode) or columns (forward mode) its range names, the
ranges of all ranks tiling ``[0, total)``. The cases cover uneven splits, fewer products
than ranks, several argnums, pytree primals and outputs, ``has_aux``, ``chunk_size`` and
``max_memory``. Errors that need several ranks (calls that differ between ranks, a rank
whose ``f`` fails) are checked in the same groups; the others in this process, with a
one-rank group.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._pytree import tree_flatten

import torch_vjp as tv
from torch_vjp._sharded import shard_range

DT = torch.float64
STRATEGIES = ("rev", "fwd", "auto", "rev-loop", "fwd-loop")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _data(device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, dtype=DT, generator=g)
    W = torch.randn(3, 4, dtype=DT, generator=g)
    v = torch.randn(4, dtype=DT, generator=g)
    p = {"w": torch.randn(2, 3, dtype=DT, generator=g), "b": torch.randn(2, dtype=DT,
                                                                         generator=g)}
    return tuple(t.to(device) for t in (x, W, v)) + ({k: t.to(device) for k, t in p.items()},)


def _cases(device="cpu"):
    """``(id, f, primals, kwargs)``: what the case table runs, with every strategy."""
    x, W, v, p = _data(device)
    return [
        # 25 outputs, 5 inputs: uneven over 2 and 3 ranks either way
        ("outer", lambda x: torch.outer(x, x.sin()), (x,), {}),
        # several argnums: 3 outputs (one per rank of 3), 4 + 12 inputs
        ("argnums", lambda v, W: torch.tanh(W @ v), (v, W), {"argnums": (0, 1)}),
        ("argnum-1", lambda v, W: torch.tanh(W @ v), (v, W), {"argnums": 1}),
        # a pytree output: a dict holding a scalar and a tuple
        ("dict-out", lambda x: {"s": (x ** 2).sum(), "t": (x.sin(), x[:2] * x[1:3])},
         (x,), {}),
        # one output element, fewer products than ranks in reverse mode
        ("scalar", lambda x: (x.exp() * x).sum(), (x,), {}),
        # two input elements, fewer than 3 ranks in forward mode
        ("two-in", lambda y: torch.stack([y[0] * y[1], y[0].sin(), y[1] ** 3]),
         (x[:2].clone(),), {}),
        # a pytree primal (a dict of parameters)
        ("dict-primal", lambda p, v: torch.tanh(p["w"] @ v[:3] + p["b"]), (p, v), {}),
        ("has-aux", lambda x: (x.sin() * x[0], {"norm": x.norm()}), (x,), {"has_aux": True}),
        ("chunk-1", lambda x: torch.outer(x, x.cos()), (x,), {"chunk_size": 1}),
        ("chunk-2", lambda x: torch.outer(x, x.cos()), (x,), {"chunk_size": 2}),
        ("chunk-7", lambda x: torch.outer(x, x.cos()), (x,), {"chunk_size": 7}),
        # a budget that allows a few products at a time
        ("max-memory", lambda x: torch.outer(x, x.cos()), (x,), {"max_memory": 3000}),
        # 200 outputs of 5 inputs: "auto" picks forward mode
        ("wide-out", lambda x: torch.outer(x.sin(), torch.arange(40.0, dtype=x.dtype,
                                                                 device=x.device)), (x,), {}),
        # no output element: nothing to compute on any rank
        ("empty-out", lambda x: x[:0] * 2, (x,), {}),
    ]


def _reference(f, primals, kwargs):
    kw = {k: v for k, v in kwargs.items() if k in ("argnums", "has_aux")}
    return torch.func.jacrev(f, **kw)(*primals)


def _flat_products(ref, out, primals, argnums, mode):
    """What the products of ``mode`` stack, from a reference Jacobian: per differentiated
    leaf ``(n_out, *leaf)`` in reverse mode, per output ``(n_in, *out)`` in forward mode."""
    outs = tree_flatten(out)[0]
    diff = primals[argnums] if isinstance(argnums, int) else tuple(primals[i] for i in argnums)
    leaves, _ = tree_flatten(diff)
    flat_ref, n_leaves = tree_flatten(ref)[0], len(leaves)
    per_out = [flat_ref[j * n_leaves:(j + 1) * n_leaves] for j in range(len(outs))]
    if mode == "rev":
        return [torch.cat([per_out[j][i].reshape(o.numel(), *leaf.shape)
                           for j, o in enumerate(outs)])
                for i, leaf in enumerate(leaves)]
    return [torch.cat([per_out[j][i].reshape(*o.shape, leaf.numel())
                       for i, leaf in enumerate(leaves)], dim=-1).movedim(-1, 0)
            for j, o in enumerate(outs)]


def _close(got, want, what):
    got_flat, got_spec = tree_flatten(got)
    want_flat, want_spec = tree_flatten(want)
    assert got_spec == want_spec, f"{what}: structure {got_spec} != {want_spec}"
    for a, b in zip(got_flat, want_flat):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _run_cases(rank, world, group, device="cpu"):
    """Runs the case table on this rank; returns the failures in words."""
    failures = []
    for name, f, primals, kwargs in _cases(device):
        ref = _reference(f, primals, kwargs)
        want = ref[0] if kwargs.get("has_aux") else ref
        for strategy in STRATEGIES:
            what = f"rank {rank}/{world}, {name}, {strategy}"
            try:
                got = tv.jacobian(f, *primals, strategy=strategy, process_group=group,
                                  **kwargs)
                if kwargs.get("has_aux"):
                    _close(got[1], ref[1], what + " (aux)")
                    got = got[0]
                _close(got, want, what)
                sh = tv.jacobian(f, *primals, strategy=strategy, process_group=group,
                                 shard=True, **kwargs)
                assert isinstance(sh, tv.JacobianShard)
                if strategy != "auto":
                    assert sh.mode == strategy[:3], what
                argnums = kwargs.get("argnums", 0)
                with torch.no_grad():
                    res = f(*primals)
                out = res[0] if kwargs.get("has_aux") else res
                n_out = sum(o.numel() for o in tree_flatten(out)[0])
                diff = (primals[argnums] if isinstance(argnums, int)
                        else tuple(primals[i] for i in argnums))
                n_in = sum(t.numel() for t in tree_flatten(diff)[0])
                assert sh.total == (n_out if sh.mode == "rev" else n_in), what
                ranges = [None] * world
                dist.all_gather_object(ranges, (sh.start, sh.stop), group=group)
                assert ranges[0][0] == 0 and ranges[-1][1] == sh.total, (what, ranges)
                assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (what, ranges)
                assert all(abs((b - a) - sh.total / world) < 1 for a, b in ranges), ranges
                flat = _flat_products(want, out, primals, argnums, sh.mode)
                got_flat = tree_flatten(sh.values)[0]
                assert len(got_flat) == len(flat), what
                for a, b in zip(got_flat, flat):
                    torch.testing.assert_close(a, b[sh.start:sh.stop], rtol=1e-10,
                                               atol=1e-12, msg=lambda m: f"{what} shard: {m}")
                if kwargs.get("has_aux"):
                    _close(sh.aux, ref[1], what + " (shard aux)")
            except Exception as err:  # noqa: BLE001 - every failure reported at the end
                failures.append(f"{what}: {type(err).__name__}: {err}")
    return failures


def _run_batch_cases(rank, world, group):
    """batch_jacobian: the products of one row split over the ranks; returns the failures."""
    x, W = _data()[1].T.contiguous(), _data()[1]  # a batch of 4 rows of 3
    cases = [
        ("mlp", lambda xb: torch.tanh(xb @ W), {}),               # 3 -> 4 per row
        ("dict-out", lambda xb: {"a": xb.sin(), "b": (xb ** 2).sum(1)}, {}),
        ("chunk-1", lambda xb: torch.tanh(xb @ W), {"chunk_size": 1}),
    ]
    failures = []
    for name, f, kwargs in cases:
        want = tv.batch_jacobian(f, x, **kwargs)
        for strategy in STRATEGIES:
            what = f"rank {rank}/{world}, batch_jacobian {name}, {strategy}"
            try:
                got = tv.batch_jacobian(f, x, strategy=strategy, process_group=group, **kwargs)
                _close(got, want, what)
                if name == "dict-out":
                    continue
                sh = tv.batch_jacobian(f, x, strategy=strategy, process_group=group,
                                       shard=True, **kwargs)
                B, n_out, n_in = want.shape
                assert sh.total == (n_out if sh.mode == "rev" else n_in), what
                flat = want.movedim(1, 0) if sh.mode == "rev" else want.movedim(2, 0)
                torch.testing.assert_close(sh.values, flat[sh.start:sh.stop], rtol=1e-10,
                                           atol=1e-12, msg=lambda m: f"{what} shard: {m}")
            except Exception as err:  # noqa: BLE001 - every failure reported at the end
                failures.append(f"{what}: {type(err).__name__}: {err}")
    return failures


def _errors_across_ranks(rank, world, group):
    """Errors that need several ranks; every rank raises."""
    x = _data()[0]
    f = lambda x: torch.outer(x, x.sin())  # noqa: E731
    with pytest.raises(tv.JacobianCallError, match=r"(?s)the differentiated primals\[0\] holds "
                       r"different values on rank 1 than on rank 0.*must be the same on every "
                       r"rank.*Fix: make them equal .*broadcast"):
        tv.jacobian(f, x + rank * 1e-3, process_group=group)
    # a change that cancels in the sum and in a position-weighted sum; values at a tiny scale
    cancels = x.clone()
    cancels[:3] += torch.tensor([1.0, -2.0, 1.0], dtype=DT) * 1e-3 * rank
    tiny = x * 1e-12 * (1 + rank)
    for y in (cancels, tiny):
        with pytest.raises(tv.JacobianCallError, match=r"holds different values on rank 1"):
            tv.jacobian(f, y, process_group=group)
    # NaN and inf alike on every rank are the same values; one inf or NaN masks no other
    # difference, and neither does a large value beside a small one
    same = x.clone()
    same[0], same[1] = float("nan"), float("inf")
    tv.jacobian(f, same, process_group=group)
    masked = same.clone()
    masked[2] += rank
    large = x.clone()
    large[0], large[1] = 1e12, 0.5 - rank
    for y in (masked, large):
        with pytest.raises(tv.JacobianCallError, match=r"holds different values on rank 1"):
            tv.jacobian(f, y, process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"(?s)the call differs between ranks: "
                       r"the differentiated primals have shapes \(6,\) on rank 1 but \(5,\) "
                       r"on rank 0.*Fix: call it with the same arguments on every rank"):
        tv.jacobian(f, torch.ones(5 + min(rank, 1), dtype=DT), process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"strategy='fwd' on rank 1 but "
                       r"strategy='rev' on rank 0"):
        tv.jacobian(f, x, strategy="rev" if rank == 0 else "fwd", process_group=group)

    def fails_on_rank_1(x):
        if rank == 1:
            raise ValueError("rank 1's f cannot run")
        return x.sin()

    if rank == 1:
        with pytest.raises(ValueError, match="rank 1's f cannot run"):
            tv.jacobian(fails_on_rank_1, x, strategy="rev", process_group=group)
    else:
        with pytest.raises(tv.JacobianCallError, match=r"(?s)rank 1 of the process_group "
                           rf"failed while computing its share of the Jacobian, so this rank "
                           rf"\({rank}\) has no whole Jacobian to return\. Rank 1 said: "
                           r"ValueError: rank 1's f cannot run"):
            tv.jacobian(fails_on_rank_1, x, strategy="rev", process_group=group)
    # a call that one rank rejects before any exchange (argnums out of range there): that
    # rank raises its own error, the others hear of it instead of waiting for ever
    two = (x, x.cos())
    if rank == 1:
        with pytest.raises(tv.JacobianCallError, match=r"argnums"):
            tv.jacobian(lambda a, b: a * b, *two, argnums=2, process_group=group)
    else:
        with pytest.raises(tv.JacobianCallError, match=r"(?s)rank 1 of the process_group "
                           rf"rejected its call before any product, so this rank \({rank}\) "
                           r"has no whole Jacobian to return\. Rank 1 said: "
                           r"JacobianCallError: .*argnums"):
            tv.jacobian(lambda a, b: a * b, *two, argnums=0, process_group=group)
    # an argument checked before the group (batch_jacobian's x and chunk_size, jacobian's
    # compile): the rank that rejected it raised, and the others waited in the first
    # exchange until gloo's timeout
    xb = torch.randn(3, 4, dtype=DT)
    for call, bad in (
        (lambda bad: tv.batch_jacobian(torch.sin, xb[0, 0] if bad else xb,
                                       process_group=group), r"x is a 0-d tensor"),
        (lambda bad: tv.batch_jacobian(torch.sin, xb, chunk_size=0 if bad else None,
                                       process_group=group), r"chunk_size=0"),
        (lambda bad: tv.jacobian(torch.sin, x, compile="yes" if bad else False,
                                 process_group=group), r"compile='yes'"),
    ):
        if rank == 1:
            with pytest.raises(tv.TorchVJPError, match=bad):
                call(True)
        else:
            with pytest.raises(tv.JacobianCallError, match=r"(?s)rank 1 of the process_group "
                               r"rejected its call before any product.*Rank 1 said: .*" + bad):
                call(False)
    # an option that one rank rejects once the group is known valid (create_graph=True
    # there): that rank raises its own error, the others hear of it
    if rank == 1:
        with pytest.raises(tv.JacobianOptionError, match=r"create_graph=True with a "
                           r"process_group is not supported"):
            tv.jacobian(f, x, create_graph=True, process_group=group)
    else:
        with pytest.raises(tv.JacobianCallError, match=r"(?s)rank 1 of the process_group "
                           r"rejected its call before any product.*Rank 1 said: "
                           r"JacobianOptionError: .*create_graph=True with a process_group"):
            tv.jacobian(f, x, process_group=group)
    # an argument of f that is not differentiated but differs between ranks: the Jacobian
    # depends on it, and each rank's share was computed for its own value, so the gathered
    # Jacobian mixed two functions without a word (its rows 0-1 from y = 1, 2-4 from y = 2)
    y = torch.full((5,), 1.0 + rank, dtype=DT)
    scaled = lambda x, y: x.sin() * y  # noqa: E731
    for strategy in ("rev", "fwd", "auto"):
        with pytest.raises(tv.JacobianCallError, match=(
            r"(?s)primals\[1\], an argument of f that is not differentiated, differs between "
            r"ranks: it holds different values on rank 1 than on rank 0 \(their checksums "
            r"differ\)\. With a process_group .*depends on every argument of f, not only on "
            r"the differentiated ones.*Fix: pass the same primals\[1\] on every rank "
            r"\(broadcast it.*bind it into f instead.*functools\.partial")):
            tv.jacobian(scaled, x, y, strategy=strategy, process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"primals\[1\], an argument of f that is "
                       r"not differentiated, differs between ranks: it is 2\.0 on rank 1 but "
                       r"1\.0 on rank 0"):
        tv.jacobian(scaled, x, 1.0 + min(rank, 1), process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"primals\[0\]\['s'\], an argument .* it "
                       r"has shape \(2,\) and dtype float64 on rank 1 but \(\) and float64 "
                       r"on rank 0"):
        tv.jacobian(lambda p, x: x * p["s"].sum(), {"s": torch.ones((2,) * min(rank, 1),
                                                                    dtype=DT)},
                    x, argnums=1, process_group=group)
    # an argument passed on one rank only (f's default on the other): the ranks' shares were
    # of two functions, gathered without a word
    scaled_default = lambda x, s=1.0: x.sin() * s  # noqa: E731
    extra = (2.0,) if rank == 1 else ()
    with pytest.raises(tv.JacobianCallError, match=r"primals\[1\], an argument of f that is "
                       r"not differentiated, differs between ranks: it is passed on rank 1 but "
                       r"not on rank 0"):
        tv.jacobian(scaled_default, x, *extra, process_group=group)
    # a dict built in another order on another rank is the same argument: the Jacobian
    ws = {"a": torch.full((5,), 2.0, dtype=DT), "b": torch.full((5,), 3.0, dtype=DT)}
    ordered = ws if rank == 0 else {"b": ws["b"], "a": ws["a"]}
    weighted = lambda x, w: x.sin() * w["a"] + x * w["b"]  # noqa: E731
    _close(tv.jacobian(weighted, x, ordered, process_group=group),
           torch.func.jacrev(weighted)(x, ws), "a dict in another order")
    # alike on every rank (objects other than numbers are not compared): the Jacobian
    tagged = lambda x, y, tag: x.sin() * y  # noqa: E731
    same = torch.full((5,), 2.0, dtype=DT)
    _close(tv.jacobian(tagged, x, same, f"rank {rank}", process_group=group),
           torch.func.jacrev(tagged)(x, same, ""), "same other arguments")
    # a function whose weights differ between ranks (a model built without a common seed,
    # a captured tensor drawn per rank): each rank's share was of its own function, and the
    # gathered Jacobian mixed them without a word
    torch.manual_seed(100 + rank)
    lin = torch.nn.Linear(5, 3).double()
    W = torch.randn(3, 5, dtype=DT)
    with pytest.raises(tv.JacobianCallError, match=(
        r"(?s)the function differs between ranks: the 'weight' of the Linear f uses holds "
        r"different values on rank 1 than on rank 0 \(their checksums differ\)\. With a "
        r"process_group every rank computes a share of the Jacobian of one function.*Fix: "
        r"make the weights equal on every rank: seed every rank's generator alike.*"
        r"broadcast them from rank 0")):
        tv.jacobian(lin, x, process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"the function differs between ranks: a "
                       r"tensor of shape \(3, 5\) that f captures holds different values on "
                       r"rank 1"):
        tv.jacobian(lambda x: torch.tanh(W @ x), x, process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"the '0\.weight' of the Sequential f uses"):
        tv.jacobian(lambda m, x: m(x), torch.nn.Sequential(lin), x, argnums=1,
                    process_group=group)
    # made equal: the Jacobian; buffers are compared too (a BatchNorm's running statistics,
    # in its output in eval mode)
    for t in (*lin.parameters(), W):
        dist.broadcast(t.data, 0, group=group)
    _close(tv.jacobian(lin, x, process_group=group), torch.func.jacrev(lin)(x), "same weights")
    # a module f reaches but never calls (a head of each rank's own, left out) differs
    # harmlessly: it was refused as "the function differs between ranks"
    parts = torch.nn.ModuleDict({"enc": lin, "head": torch.nn.Linear(3, 2).double()})
    _close(tv.jacobian(lambda x: parts["enc"](x), x, process_group=group),
           torch.func.jacrev(lin)(x), "a head f does not use")
    with pytest.raises(tv.JacobianCallError, match=r"the 'head\.weight' of the ModuleDict f "
                       r"uses holds different values on rank 1"):
        tv.jacobian(lambda x: parts["head"](parts["enc"](x)), x, process_group=group)
    bn = torch.nn.BatchNorm1d(5).double()
    bn.running_mean.fill_(float(rank))
    xb = torch.randn(3, 5, dtype=DT, generator=torch.Generator().manual_seed(1))
    bn.eval()
    with pytest.raises(tv.JacobianCallError, match=r"the 'running_mean' of the BatchNorm1d f "
                       r"uses holds different values on rank 1"):
        tv.jacobian(bn, xb, process_group=group)
    # complex values that differ in their imaginary parts only: the checksums cast them to
    # float64, which dropped the imaginary parts, and the gathered Jacobian mixed two
    # functions (an argument not differentiated, a captured tensor)
    z = torch.complex(x, x.cos() + 1e-3 * rank)
    with pytest.raises(tv.JacobianCallError, match=r"the function differs between ranks: a "
                       r"tensor of shape \(5,\) that f captures holds different values"):
        tv.jacobian(lambda x: x * z.imag, x, process_group=group)
    with pytest.raises(tv.JacobianCallError, match=r"primals\[1\], an argument of f that is "
                       r"not differentiated, differs between ranks: it holds different values"):
        tv.jacobian(lambda x, z: x * z.imag, x, z, process_group=group)
    # the group still works after every error
    _close(tv.jacobian(f, x, process_group=group), torch.func.jacrev(f)(x), "after errors")


class _NoJvp(torch.autograd.Function):
    """exp with a backward (and a vmap rule) but no forward-mode formula."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]


class _NoVmap(torch.autograd.Function):
    """exp with both AD formulas but no vmap rule."""

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0]

    @staticmethod
    def jvp(ctx, t):
        return t * ctx.saved_tensors[0]


def _auto_fallbacks(rank, world, group):
    """"auto" in forward mode on a function without forward-mode AD: every rank switches to
    reverse mode together, and the result is still whole."""
    x = _data()[0]
    cols = torch.arange(40.0, dtype=DT)
    f = lambda x: torch.outer(_NoJvp.apply(x), cols)  # noqa: E731  200 outputs: fwd
    want = torch.func.jacrev(f)(x)
    with pytest.warns(tv.JacobianWarning, match=r"(?s)forward-mode AD fails on f .*uses "
                      r"reverse mode instead, on every rank of the process_group"):
        got = tv.jacobian(f, x, process_group=group)
    _close(got, want, f"rank {rank}/{world}, auto fwd -> rev")
    sh = tv.jacobian(f, x, process_group=group, shard=True)
    assert sh.mode == "rev" and sh.total == 200
    # vmap cannot batch a Function without a vmap rule, a loop can: each rank loops
    g = lambda x: torch.outer(_NoVmap.apply(x), cols)  # noqa: E731
    start, stop = shard_range(x.numel(), rank, world)
    if stop - start > 1:  # one product is a plain call, with nothing to vectorise
        with pytest.warns(tv.JacobianWarning, match=r"(?s)could not vectorise the Jacobian "
                          r".* so this rank used strategy='fwd-loop'"):
            got = tv.jacobian(g, x, process_group=group)
    else:
        got = tv.jacobian(g, x, process_group=group)
    _close(got, torch.func.jacrev(g)(x), f"rank {rank}/{world}, auto vmap -> loop")
    # a module in training mode that updates its running statistics, which torch.func
    # cannot run at all: "auto" and "rev-loop" compute with plain autograd, as one process
    # does; "rev" explains torch.func's refusal. (Each raised torch.func's raw RuntimeError.)
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(DT).train()
    xb = torch.randn(5, 3, dtype=DT, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        want = tv.jacobian(bn, xb)
    stats = [b.clone() for b in bn.buffers()]
    with pytest.warns(tv.JacobianWarning, match=r"(?s)torch\.func cannot run f \(Sequential\).*"
                      r"computed this rank's share of the products with plain autograd"):
        _close(tv.jacobian(bn, xb, process_group=group), want, f"rank {rank}/{world}, bn auto")
    _close(tv.jacobian(bn, xb, process_group=group, strategy="rev-loop"), want,
           f"rank {rank}/{world}, bn rev-loop")
    sh = tv.jacobian(bn, xb, process_group=group, shard=True)
    torch.testing.assert_close(sh.values, want.reshape(20, 5, 3)[sh.start:sh.stop])
    assert all(torch.equal(a, b) for a, b in zip(stats, bn.buffers()))  # (put back)
    # a random f, one column at a time: every column of every rank from one draw, as on one
    # process (each column drew anew: a dropout Jacobian's diagonal was 0 where one process's
    # was not, silently)
    drop = lambda v: torch.nn.functional.dropout(v.sin(), 0.5, training=True)  # noqa: E731
    v = torch.randn(6, dtype=DT, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(5)
    one = tv.jacobian(drop, v, strategy="fwd-loop")
    torch.manual_seed(5)
    _close(tv.jacobian(drop, v, strategy="fwd-loop", process_group=group), one,
           f"rank {rank}/{world}, dropout fwd-loop")
    assert torch.equal(one, torch.diag(one.diagonal()))  # (one function: a diagonal)
    with pytest.raises(tv.StrategyError, match=r"(?s)the vectorised strategies compute with "
                       r"torch\.func, which cannot run f \(Sequential\).*changes a tensor it "
                       r"captured.*Fix: strategy='auto' or 'rev-loop' \(they"):
        tv.jacobian(bn, xb, process_group=group, strategy="rev")


def _solve_wide(A, cols=torch.linspace(-1.0, 1.0, 300, dtype=DT).reshape(3, 100)):
    """300 outputs of 9 inputs ("auto": forward mode), whose forward-mode formula for
    torch.triangular_solve's matrix is wrong in torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.triangular_solve is deprecated
        return torch.triangular_solve(cols.expand(*A.shape[:-2], 3, 100), A)[0]


def _auto_checked(rank, world, group):
    """"auto" checks each rank's products against one reverse product, and every rank takes
    the same next route where some rank's disagree (NOTE [sharded auto, checked])."""
    from torch_vjp._engine import fwdcheck

    g = torch.Generator().manual_seed(1)
    A = torch.triu(torch.randn(3, 3, dtype=DT, generator=g)) + 3 * torch.eye(3, dtype=DT)
    want = torch.autograd.functional.jacobian(_solve_wide, A)
    assert (torch.func.jacfwd(_solve_wide)(A) - want).abs().max() > 0.1  # forward mode is wrong
    fwdcheck.CHECKED.clear()
    what = f"rank {rank}/{world}"
    with pytest.warns(tv.JacobianWarning, match=r"forward mode .* disagrees with a reverse "
                      r"product on the Jacobian of .*_solve_wide.*returned the reverse-mode "
                      r"Jacobian"):
        _close(tv.jacobian(_solve_wide, A, process_group=group), want, what + ", solve")
    with warnings.catch_warnings():  # remembered: no warning, no check
        warnings.simplefilter("error", tv.JacobianWarning)
        _close(tv.jacobian(_solve_wide, A, process_group=group), want, what + ", solve again")
        sh = tv.jacobian(_solve_wide, A, process_group=group, shard=True)
    assert sh.mode == "rev" and sh.total == 300, what
    torch.testing.assert_close(sh.values, want.reshape(300, 3, 3)[sh.start:sh.stop])
    # shard=True, checked first (the warning was shown once); and a batch of matrices
    fwdcheck.CHECKED.clear()
    sh = tv.jacobian(_solve_wide, A, process_group=group, shard=True)
    assert sh.mode == "rev" and list(fwdcheck.CHECKED.values()) == ["rev"], what
    torch.testing.assert_close(sh.values, want.reshape(300, 3, 3)[sh.start:sh.stop])
    As = torch.stack([A, A.T.triu() + torch.eye(3, dtype=DT)])
    want_b = torch.stack([torch.autograd.functional.jacobian(_solve_wide, a) for a in As])
    with pytest.warns(tv.JacobianWarning, match=r"batch_jacobian: forward mode .* disagrees"):
        _close(tv.batch_jacobian(_solve_wide, As, process_group=group), want_b, what + " batch")
    # reverse mode under vmap is wrong for torch.cdist's backward (and it has no forward
    # mode): one reverse product at a time
    y = torch.randn(4, 2, dtype=DT, generator=g)
    x = torch.randn(3, 2, dtype=DT, generator=g)
    dist_y = lambda x: torch.cdist(x, y)  # noqa: E731
    want = torch.autograd.functional.jacobian(dist_y, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(tv.jacobian(dist_y, x, process_group=group), want, what + ", cdist")
    assert any("reverse mode under torch.vmap disagrees" in str(w.message) for w in caught)
    sh = tv.jacobian(dist_y, x, process_group=group, shard=True)
    torch.testing.assert_close(sh.values, want.reshape(12, 3, 2)[sh.start:sh.stop])
    # ranks that remember different routes (rank 0 alone ran the function first) check again
    # together, and still compute in one mode
    fwdcheck.CHECKED.clear()
    solve = lambda A: _solve_wide(A) * 1.0  # noqa: E731  a function of its own
    if rank == 0:
        with pytest.warns(tv.JacobianWarning, match=r"forward mode .* disagrees"):
            tv.jacobian(solve, A)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        _close(tv.jacobian(solve, A, process_group=group), want_b[0], what + ", rank 0 first")
    # a function whose forward mode is right is checked once and keeps forward mode
    fwdcheck.CHECKED.clear()
    tall = lambda v: torch.outer(v.sin(), torch.arange(40.0, dtype=DT))  # noqa: E731
    v = torch.randn(5, dtype=DT, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        assert tv.jacobian(tall, v, process_group=group, shard=True).mode == "fwd"
    assert list(fwdcheck.CHECKED.values()) == ["fwd"], what
    # batch_jacobian of an f that mixes the rows of its batch: every rank raises, as one
    # process does, in both modes "auto" may choose (NOTE [a batch that mixes rows]); it
    # returned a sum of cross-example blocks (0.8 off) with a warning only
    xb = torch.randn(6, 3, dtype=DT, generator=g)
    centred = lambda x: torch.tanh(x - x.mean(0))  # noqa: E731
    centred_tall = lambda x: torch.tanh(x - x.mean(0)).repeat(1, 4)  # noqa: E731
    for mixes, kind in ((centred, "rev"), (centred_tall, "fwd")):
        for shard in (False, True):
            with pytest.raises(tv.JacobianCallError, match=r"(?s)batch_jacobian: f \(\S*<lambda>\) "
                               r"mixes examples of the batch.*Fix: torch_vjp\.jacobian\(f, x\)"):
                tv.batch_jacobian(mixes, xb, process_group=group, shard=shard)
        assert tv.batch_jacobian(mixes, xb, process_group=group, strategy=kind,
                                 shard=True).mode == kind, what  # (explicit: not checked)
    if world == 1:
        return

    # a rank that cannot take the reverse product (its f fails where the output requires
    # grad) does not outvote a rank that found forward mode wrong
    fwdcheck.CHECKED.clear()

    def logs_on_rank_1(A):
        out = _solve_wide(A)
        if rank == 1 and out.requires_grad and not (
                torch._C._functorch.is_functorch_wrapped_tensor(out)):
            out.numpy()  # (raises in the check's call of f, which records a plain graph)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        _close(tv.jacobian(logs_on_rank_1, A, process_group=group), want_b[0],
               what + ", one rank unchecked")

    # where no route agrees (reverse mode fails on rank 1), forward mode's result stands,
    # with a warning on every rank that says so (it stood without a word)
    fwdcheck.CHECKED.clear()

    def no_reverse_on_rank_1(A):
        out = _solve_wide(A)
        if rank == 1 and out.requires_grad:
            out.numpy()
        return out

    with pytest.warns(tv.JacobianWarning, match=r"no other route agrees with it either"):
        tv.jacobian(no_reverse_on_rank_1, A, process_group=group)

    # out of memory on the route the check falls back to reaches every rank, as on one
    # process: no rank returns the forward-mode Jacobian the check found wrong
    fwdcheck.CHECKED.clear()

    def reverse_runs_out(A):
        if torch._C._functorch.is_functorch_wrapped_tensor(A) and A.requires_grad and (
                torch.autograd.forward_ad.unpack_dual(A).tangent is None):
            raise torch.OutOfMemoryError("reverse mode ran out of memory")
        return _solve_wide(A)

    with pytest.raises((torch.OutOfMemoryError, tv.JacobianCallError),
                       match="reverse mode ran out of memory"):
        tv.jacobian(reverse_runs_out, A, process_group=group)

    # an error no check may hide (out of memory), raised in one rank's reverse product for the
    # check, reaches every rank: none waits for the verdict
    def runs_out(v):
        if v.requires_grad and rank == 1:  # (only the check's call records a graph)
            raise MemoryError("rank 1 ran out of memory")
        return torch.outer(v.cos(), torch.arange(40.0, dtype=DT))

    if rank == 1:
        with pytest.raises(MemoryError, match="rank 1 ran out of memory"):
            tv.jacobian(runs_out, v, process_group=group)
    else:
        with pytest.raises(tv.JacobianCallError, match=r"rank 1 of the process_group failed "
                           r"while computing its share .*MemoryError: rank 1 ran out"):
            tv.jacobian(runs_out, v, process_group=group)


def _auto_checked_draws(rank, world, group):
    """"auto"'s check of a random f (a generator of f's own) runs its reverse products on the
    draw the products used, and leaves the generator where one call of f leaves it: the check
    warned that no route agrees (by up to 3.6) and left the generator advanced."""
    from torch_vjp._engine import fwdcheck

    gen = torch.Generator()
    scale = torch.arange(1.0, 4.0, dtype=DT)

    def f(x):
        mask = (torch.rand(x.shape, generator=gen, dtype=DT) > 0.5).to(DT)
        return torch.outer(x * mask, scale).reshape(-1)

    x = torch.randn(6, dtype=DT, generator=torch.Generator().manual_seed(0))
    fwdcheck.CHECKED.clear()
    gen.manual_seed(5)
    mask = (torch.rand(x.shape, generator=gen, dtype=DT) > 0.5).to(DT)
    after_one_call = gen.get_state()
    want = torch.func.jacrev(lambda x: torch.outer(x * mask, scale).reshape(-1))(x)
    gen.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        _close(tv.jacobian(f, x, process_group=group), want, f"rank {rank}/{world}, own draws")
    assert torch.equal(gen.get_state(), after_one_call), f"rank {rank}: generator moved on"
    # the route every rank remembers is taken without a check: three calls of f fewer (the
    # check's reverse product of the rank's share, and, reverse mode being the route, one
    # of the whole cotangent and one forward product: NOTE [a sharded reverse product
    # checked forward]; they ran on every call where "fwd" was remembered)
    calls = []

    def counted(x):
        calls.append(1)
        return torch.outer(x.sin(), scale)

    fwdcheck.CHECKED.clear()
    n = []
    for _ in range(3):
        calls.clear()
        tv.jacobian(counted, x, process_group=group)
        n.append(len(calls))
    assert n[1] == n[2] == n[0] - 3, f"rank {rank}: calls of f per call {n}"


class _OldNoJvp(torch.autograd.Function):
    """x ** 3 in the old style (no setup_context: torch.func cannot run it), no jvp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * g


def _runs_backward(x):
    w = torch.ones(3, dtype=DT, requires_grad=True)
    (w * 2).sum().backward()  # (plain autograd of f's own: torch.func refuses it)
    return torch.outer(x.sin(), torch.arange(4.0, dtype=DT))


def _fwd_loop_plain(rank, world, group):
    """"fwd-loop" computes with plain forward-mode AD as on one process: it raised
    torch.func's raw RuntimeError for an f that runs .backward() itself, and for a Function
    without a jvp formula, instead of the single-process StrategyNotImplementedError."""
    x = torch.randn(5, dtype=DT, generator=torch.Generator().manual_seed(4))
    want = torch.autograd.functional.jacobian(_runs_backward, x)
    _close(tv.jacobian(_runs_backward, x, strategy="fwd-loop", process_group=group), want,
           f"rank {rank}/{world}, fwd-loop of an f running backward")
    with pytest.raises(tv.StrategyNotImplementedError, match=r"(?s)^torch_vjp\.jacobian: "
                       r"strategy='fwd-loop' computes with forward-mode AD, and .*Fix: "
                       r"strategy='rev-loop' or 'auto'"):
        tv.jacobian(_OldNoJvp.apply, x, strategy="fwd-loop", process_group=group)


def _random_draws(rank, world, group):
    """f draws random numbers (dropout in training mode): every rank's generators must be in
    one state, else each rank's share is of its own mask."""
    x = torch.linspace(-1.0, 1.0, 8, dtype=DT)

    def f(x):
        return torch.nn.functional.dropout(x.sin(), 0.5, training=True) * x

    with torch.random.fork_rng():
        torch.manual_seed(100 + rank)  # each rank its own stream, as for its data
        for strategy in ("rev", "auto"):
            before = torch.get_rng_state()
            with pytest.raises(tv.JacobianCallError, match=(
                    r"(?s)^torch_vjp\.jacobian: f draws random numbers \(dropout in training "
                    r"mode, say\), and the random generators are in another state on rank 1 "
                    r"than on rank 0\..*the gathered Jacobian would mix them\..*Fix: seed the "
                    r"generators alike on every rank just before the call")):
                tv.jacobian(f, x, strategy=strategy, process_group=group)
            assert torch.equal(torch.get_rng_state(), before)
        # a function that draws nothing runs whatever state the generators hold
        g = lambda x: torch.outer(x, x.sin())  # noqa: E731
        _close(tv.jacobian(g, x, process_group=group), torch.func.jacrev(g)(x), "no draws")
        # seeded alike: the Jacobian of f with one mask, that of the mask one call draws
        torch.manual_seed(7)
        want = torch.func.jacrev(f)(x)
        torch.manual_seed(7)
        got = tv.jacobian(f, x, strategy="rev", process_group=group)
        _close(got, want, "seeded alike")


def _pytree_orders(rank, world, group):
    """A dict of primals, or f's dict output, built in another key order on rank 1: each
    rank numbers the products in its own order, so every rank raises (the values alike, the
    gathered Jacobian mixed d/dw with d/db silently)."""
    w, b = torch.zeros(3, dtype=DT), torch.zeros(3, dtype=DT)
    p = {"w": w, "b": b} if rank == 0 else {"b": b, "w": w}
    f = lambda p: torch.cat([p["w"] * 2 + 1, p["b"].sin() * 3 + p["w"][0]])  # noqa: E731
    for strategy in ("rev", "fwd"):
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)^torch_vjp\.jacobian: the differentiated primals are structured "
                r"differently on rank 1 than on rank 0: in the order torch's pytree flattens "
                r"them, leaf 0 is primals\[0\]\['b'\] on rank 1 but primals\[0\]\['w'\] on "
                r"rank 0 .*Fix: build the dicts in one key order on every rank")):
            tv.jacobian(f, p, strategy=strategy, process_group=group)
    # the same dict, built in one order: d/dw and d/db where they belong
    p = {"w": w, "b": b}
    _close(tv.jacobian(f, p, process_group=group), torch.func.jacrev(f)(p), "dict primal")
    x = torch.linspace(0.0, 1.0, 3, dtype=DT)

    def g(x):
        d = {"a": x.sin(), "b": x * 2}
        return d if rank == 0 else {"b": d["b"], "a": d["a"]}

    for strategy, shard in (("rev", False), ("fwd", False), ("auto", True)):
        with pytest.raises(tv.JacobianCallError, match=(
                r"(?s)^torch_vjp\.jacobian: the outputs of f are structured differently on "
                r"rank 1 than on rank 0: in the order torch's pytree flattens them, leaf 0 is "
                r"output\['b'\] on rank 1 but output\['a'\] on rank 0 .*Fix: build the dicts "
                r"in one key order")):
            tv.jacobian(g, x, strategy=strategy, process_group=group, shard=shard)


def _ddp_module(rank, world, group):
    """A module wrapped in DistributedDataParallel as f: its Jacobian is its module's. (The
    wrapper's forward broadcast the buffers at every call: forward mode refused the in-place
    copy, and a loop over each rank's own columns, or a call on one rank, waited for ever.)"""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                            torch.nn.Linear(4, 2)).to(DT).eval()
    ddp = torch.nn.parallel.DistributedDataParallel(m)  # broadcast_buffers=True
    xb = torch.linspace(-1.0, 1.0, 6, dtype=DT).reshape(2, 3)
    want = torch.func.jacrev(m)(xb)
    for strategy in ("fwd", "fwd-loop", "auto", "rev-loop"):
        _close(tv.jacobian(ddp, xb, strategy=strategy, process_group=group), want,
               f"rank {rank}/{world}, DDP module, {strategy}")
    _close(tv.batch_jacobian(ddp, xb, strategy="fwd-loop", process_group=group),
           torch.stack([want[i, :, i] for i in range(2)]), f"rank {rank}/{world}, DDP batch")
    if rank == 0:  # one rank alone, without a group
        _close(tv.jacobian(ddp, xb, strategy="fwd-loop"), want, "DDP module, rank 0 alone")
    dist.barrier()


def _worker(rank, world, init_file):
    # a failure that leaves one rank in a collective ends it in a minute, not never
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        failures = _run_cases(rank, world, dist.group.WORLD)
        failures += _run_batch_cases(rank, world, dist.group.WORLD)
        assert not failures, "\n".join(failures)
        _errors_across_ranks(rank, world, dist.group.WORLD)
        _auto_fallbacks(rank, world, dist.group.WORLD)
        _auto_checked(rank, world, dist.group.WORLD)
        _auto_checked_draws(rank, world, dist.group.WORLD)
        _fwd_loop_plain(rank, world, dist.group.WORLD)
        _random_draws(rank, world, dist.group.WORLD)
        _pytree_orders(rank, world, dist.group.WORLD)
        _ddp_module(rank, world, dist.group.WORLD)
        gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
        # a subgroup of ranks 0 and 1: the others stay out of it
        sub = dist.new_group([0, 1])
        if rank < 2:
            x = _data()[0]
            f = lambda x: torch.outer(x, x.sin())  # noqa: E731
            _close(tv.jacobian(f, x, process_group=sub), torch.func.jacrev(f)(x), "subgroup")
        else:
            with pytest.raises(tv.JacobianOptionError, match=r"(?s)this process \(global rank 2\) "
                               r"is not a member of process_group.*Fix: call it only on the "
                               r"group's ranks"):
                tv.jacobian(torch.sin, _data()[0], process_group=sub)
        # no rank leaves (closing its connections) while another still talks to it
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3])  # (shards of unequal sizes, a rank out of a subgroup)
def test_sharded_jacobian_equals_jacrev_on_every_rank(world, spawn_within):
    # (the ranks fork from one server that imported torch and torch_vjp: _worker reads no
    # environment variable the test sets)
    spawn_within(_worker, world, 420, forkserver=True)


def test_one_rank_group_equals_single_process(one_rank_group):
    failures = _run_cases(0, 1, one_rank_group) + _run_batch_cases(0, 1, one_rank_group)
    assert not failures, "\n".join(failures)
    _auto_checked(0, 1, one_rank_group)
    _auto_fallbacks(0, 1, one_rank_group)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sharded_batch_jacobian_of_a_mixing_f_at_a_nan_point_raises(one_rank_group, bad):
    # at a NaN or infinite point 'auto' compares no route, so the mixing test never ran:
    # x - x.mean(0) returned all-zero blocks (the true ones are 0.75 I) without a word
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    xb = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
    xb[0, 0] = bad
    with pytest.raises(tv.JacobianCallError, match=r"(?s)mixes examples of the batch.*\(no "
                       r"route was compared: a NaN or an infinity is in the products here\)"):
        tv.batch_jacobian(lambda x: x - x.mean(0), xb, process_group=one_rank_group)


def test_sharded_auto_with_an_infinity_in_a_captured_tensor_warns_and_remembers_nothing(
        one_rank_group):
    # 7d9b55d fixed this on one process only: sharded, x finite and w[1] = inf captured,
    # batch_jacobian warned 'reverse mode under torch.vmap disagrees ... (by up to inf)'
    # and jacobian remembered 'rev' for the function and shapes (no check at a later point)
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    x = torch.randn(3, dtype=DT, generator=torch.Generator().manual_seed(0))
    xb = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(1))
    w = torch.tensor([1.0, float("inf"), -2.0, 0.5], dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        tv.jacobian(lambda x: torch.outer(x, w) * x.sum(), x, process_group=one_rank_group)
        got = tv.batch_jacobian(lambda x: x.sin() * w[:3], xb, process_group=one_rank_group)
    assert not fwdcheck.CHECKED
    want = torch.func.vmap(torch.func.jacrev(lambda r: r.sin() * w[:3]))(xb)
    keep = torch.tensor([0, 2])  # (the finite block: jacrev gives 0 * inf = NaN beside it)
    torch.testing.assert_close(got[:, keep][:, :, keep], want[:, keep][:, :, keep])


def test_sharded_jacobian_err_check(one_rank_group):
    x = torch.randn(4, dtype=DT)
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)process_group is an object of type "
                       r"object, but it must be a torch\.distributed ProcessGroup.*Fix: pass "
                       r"process_group=torch\.distributed\.group\.WORLD for the default group"):
        tv.jacobian(torch.sin, x, process_group=object())
    with pytest.raises(tv.JacobianOptionError, match=r"process_group is True, but it must be "
                       r"a torch\.distributed ProcessGroup"):
        tv.jacobian(torch.sin, x, process_group=True)
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)shard=True, but process_group is "
                       r"None: a shard is one rank's share.*Fix: pass process_group="):
        tv.jacobian(torch.sin, x, shard=True)
    with pytest.raises(tv.JacobianOptionError, match=r"shard='yes', but it must be True or "
                       r"False"):
        tv.jacobian(torch.sin, x, process_group=one_rank_group, shard="yes")
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)create_graph=True with a "
                       r"process_group is not supported: the shards are gathered from other "
                       r"processes.*Fix: pass create_graph=False"):
        tv.jacobian(torch.sin, x, process_group=one_rank_group, create_graph=True)
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)compile=True with a process_group, "
                       r"but a sharded Jacobian runs eagerly: its ranks exchange shards "
                       r"between the products\. Fix: drop compile=True"):
        tv.jacobian(torch.sin, x, process_group=one_rank_group, compile=True)
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)a process_group inside a "
                       r"torch\.func transform .* is not supported.*Fix: pass "
                       r"process_group=None inside the transform"):
        torch.func.vmap(lambda r: tv.jacobian(torch.sin, r, process_group=one_rank_group))(
            x.view(2, 2))
    dist.destroy_process_group()
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)process_group was given, but "
                       r"torch\.distributed is not initialised.*Fix: call "
                       r"torch\.distributed\.init_process_group"):
        tv.jacobian(torch.sin, x, process_group=one_rank_group)


def test_shard_range_tiles_the_products():
    for n in (0, 1, 2, 5, 7, 25):
        for world in (1, 2, 3, 4):
            ranges = [shard_range(n, r, world) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) == math.ceil(n / world)


def _cuda_worker(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        failures = _run_cases(rank, world, dist.group.WORLD, device=f"cuda:{rank}")
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_sharded_jacobian_nccl():
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed was built without NCCL")
    world = min(2, torch.cuda.device_count())  # NCCL wants one device per rank
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_cuda_worker, args=(world, os.path.join(d, "init")), nprocs=world,
                 join=True)


def test_checksums_of_a_large_tensor_take_little_memory_more():
    # the checksums of a tensor (a primal, an argument, a module's weight) held a dozen
    # float64 temporaries of its size at once: 2 GB more for a 100 MB weight, on every call
    import subprocess
    import sys

    code = (
        "import resource, torch\n"
        "from torch_vjp._sharded_check import _checksums\n"
        "x = torch.ones(25_000_000)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "_checksums(x)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=os.environ, check=True)
    assert int(out.stdout.strip()) < 500, out.stdout  # (MB more than the 100 MB tensor)


def test_sharded_auto_check_allows_a_float32_step_inside_a_float64_function(one_rank_group,
                                                                           float32_step):
    # the sharded check judged at the dtype of the first input (float64), so a float32 step
    # inside f (as Llama's and T5's norms cast), which rounds every route at float32's,
    # read as a disagreement: a false warning, and the result of another route
    from torch_vjp._engine import fwdcheck

    fwdcheck.CHECKED.clear()
    f, x = float32_step
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = tv.jacobian(f, x, process_group=one_rank_group)
    torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=0, atol=1e-12)
    assert "rev-loop" not in fwdcheck.CHECKED.values()  # (the first route stood)


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop"])
def test_sharded_batch_jacobian_names_an_output_without_the_batch_by_its_place(
        one_rank_group, strategy):
    # (the sharded paths named it by its flat index, "output 1 of f", where the single
    # process names f['loss'])
    f = lambda x: {"logits": x.sin(), "loss": x.sum()}  # noqa: E731
    with pytest.raises(tv.JacobianCallError, match=r"batch_jacobian: the output of "
                       r"f\['loss'\] has shape \(\), but x has shape \(4, 3\)"):
        tv.batch_jacobian(f, torch.randn(4, 3, dtype=DT), strategy=strategy,
                          process_group=one_rank_group)


class _NoKeys:
    """A pytree node registered without ``flatten_with_keys_fn``: its leaves have no paths."""

    def __init__(self, a, b):
        self.a, self.b = a, b


torch.utils._pytree.register_pytree_node(_NoKeys, lambda n: ([n.a, n.b], None),
                                         lambda v, _: _NoKeys(*v))


def test_sharded_jacobian_takes_pytree_nodes_without_keys(one_rank_group):
    # the opening exchange named the leaves by their paths, which torch's pytree cannot
    # give for such a node: a raw ValueError for a call one process computes
    x = torch.linspace(0.0, 1.0, 3, dtype=DT)
    f = lambda x, n: x.sin() * n.a + n.b  # noqa: E731
    n = _NoKeys(torch.arange(3.0, dtype=DT), 2.0)
    for strategy in ("rev", "fwd"):
        _close(tv.jacobian(f, x, n, strategy=strategy, process_group=one_rank_group),
               torch.func.jacrev(f)(x, n), f"a node as an argument, {strategy}")
    g = lambda n: n.a.sin() * n.b  # noqa: E731
    got = tv.jacobian(g, _NoKeys(x, x * 2), process_group=one_rank_group)
    want = torch.func.jacrev(g)(_NoKeys(x, x * 2))
    assert isinstance(got, _NoKeys)
    _close((got.a, got.b), (want.a, want.b), "a node as the differentiated primal")


def test_sharded_auto_checks_vmap_apart_from_chunks_of_one_and_per_argnums(one_rank_group):
    # (torch.cdist's backward batches wrongly under vmap, which auto's check finds; a check
    # made in chunks of one, which run no vmap, or for another argnums, must not stand for
    # the vectorised products of a later call)
    y = torch.randn(3, 2, dtype=DT)
    x = torch.randn(4, 2, dtype=DT)
    f = lambda a: torch.cdist(a, y)  # noqa: E731
    want = torch.autograd.functional.jacobian(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(tv.jacobian(f, x, chunk_size=1, process_group=one_rank_group), want, "chunk 1")
        _close(tv.jacobian(f, x, process_group=one_rank_group), want, "after a chunk of one")
        g = lambda p, q: torch.cdist(p, y) * q.sum()  # noqa: E731
        a, b = torch.randn(4, 2, dtype=DT), torch.randn(4, 2, dtype=DT)
        for argnums in (1, 0):
            _close(tv.jacobian(g, a, b, argnums=argnums, process_group=one_rank_group),
                   torch.autograd.functional.jacobian(lambda t: g(*((a, t) if argnums
                                                                    else (t, b))),
                                                      b if argnums else a),
                   f"argnums={argnums}")


def test_vjp_and_jvp_of_a_ddp_wrapped_module_are_its_modules(one_rank_group):
    # (the wrapper's forward broadcasts its buffers on every call, an in-place copy that
    # torch.func refuses in forward mode, and a collective a call on one rank would wait in)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                            torch.nn.Linear(4, 2)).to(DT).eval()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    xb = torch.linspace(-1.0, 1.0, 6, dtype=DT).reshape(2, 3)
    J = torch.func.jacrev(m)(xb)
    c, t = torch.randn(2, 2, dtype=DT), torch.randn(2, 3, dtype=DT)
    out, vjp_fn = tv.vjp(ddp, xb)
    _close(out, m(xb), "vjp output")
    _close(vjp_fn(c)[0], torch.einsum("ij,ijkl->kl", c, J), "vjp")
    out, tangent = tv.jvp(ddp, (xb,), (t,))
    _close(tangent, torch.einsum("ijkl,kl->ij", J, t), "jvp")
    del ddp
    gc.collect()  # (the wrapper holds the group: gone before it is destroyed)
