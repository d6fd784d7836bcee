"""Reference Jacobians for the tests, computed apart from torch_vjp (float64 inputs).

``jvp_columns`` builds a Jacobian one ``torch.func.jvp`` column at a time (no vmap, no
reverse mode: right where torch's backward formula of an op is wrong, or its batching rule);
``central_difference`` builds it from central differences. Both return the Jacobian shaped
``(*f(x).shape, *x.shape)``.
"""

from __future__ import annotations

import warnings

import torch

import torch_vjp as tv


def _basis(x):
    return torch.eye(x.numel(), dtype=x.dtype).reshape(x.numel(), *x.shape)


def jvp_columns(f, x):
    cols = [torch.func.jvp(f, (x,), (e,))[1].reshape(-1) for e in _basis(x)]
    return torch.stack(cols, 1).reshape(*f(x).shape, *x.shape)


def reverse_rows(f, x):
    """The Jacobian by one plain backward pass per output element, without vmap."""
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = []
    for i in range(out.numel()):
        g, = torch.autograd.grad(out[i], xx, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(x) if g is None else g)
    return torch.stack(rows).reshape(*f(x).shape, *x.shape)


def central_difference(f, x, h=1e-6):
    cols = [((f(x + h * e) - f(x - h * e)) / (2 * h)).reshape(-1) for e in _basis(x)]
    return torch.stack(cols, 1).reshape(*f(x).shape, *x.shape)


def caught(fn, category=tv.JacobianWarning):
    """``fn()``'s result and the messages of the warnings of ``category`` it gave."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", category)
        res = fn()
    return res, [str(w.message) for w in got if issubclass(w.category, category)]


def float64_per_example(model, loss_fn, x, t):
    """Each example's gradients alone, in float64 (``model.double()`` makes the model float64,
    in place), ``{name: (B, *shape)}``, and each example's norm over all parameters."""
    from torch.func import functional_call, grad

    model = model.double()
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(ps, xi, ti):
        return loss_fn(functional_call(model, ps, (xi.unsqueeze(0),)), ti.unsqueeze(0))

    rows = [grad(one)(params, x[i].double(), t[i].double()) for i in range(x.shape[0])]
    ref = {n: torch.stack([r[n] for r in rows]) for n in params}
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    return ref, norms


def per_example_grads(model, loss_fn, x, t):
    """Each example's gradients, one ``backward`` per example: ``{name: (B, *shape)}``.
    The model's ``.grad`` are left None."""
    ref = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x[i:i + 1]), t[i:i + 1]).backward()
        for n, p in model.named_parameters():
            ref[n].append(p.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in ref.items()}


def per_example_grads_of_two(model, x, g, t):
    """Each example's gradients of ``cross_entropy(model(x_i, g_i), t_i)`` (a model of two
    inputs), one ``torch.autograd.grad`` per example: ``{name: (B, *shape)}``."""
    named = list(model.named_parameters())
    rows = []
    for i in range(x.shape[0]):
        loss = torch.nn.functional.cross_entropy(model(x[i:i + 1], g[i:i + 1]), t[i:i + 1])
        rows.append(torch.autograd.grad(loss, [p for _, p in named]))
    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(named)}


class OldStyleSquare(torch.autograd.Function):
    """``x * x`` as an old-style custom Function (``forward(ctx, x)``, no
    ``setup_context``, no ``jvp``): torch.func refuses it, plain autograd runs it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


# A custom op whose batching rule is wrong by a factor, and two custom Functions that agree
# with the right derivative at zeros (or times x.sum() at a point summing to 0) only: for the
# route checks at a degenerate first point (dense, sparse and sharded "auto").
@torch.library.custom_op("tv_tests_references::twice_wrongly_batched", mutates_args=())
def twice_wrongly_batched(g: torch.Tensor) -> torch.Tensor:
    return g * 2


@twice_wrongly_batched.register_fake
def _(g):
    return torch.empty_like(g)


def _wrong_vmap(info, in_dims, g):
    return g * 3, in_dims[0]  # (wrong: twice is g * 2 unbatched)


twice_wrongly_batched.register_vmap(_wrong_vmap)


class WrongBatched(torch.autograd.Function):
    """2 x, whose backward calls an op with a wrong batching rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return twice_wrongly_batched(g)

    @staticmethod
    def jvp(ctx, t):
        return t * 2


class WrongBackward(torch.autograd.Function):
    """2 x, whose backward is wrong (3 g); its jvp is right."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 3

    @staticmethod
    def jvp(ctx, t):
        return t * 2


def in_gloo_group(rank, world, init_file, checks):
    """Runs ``checks`` (each called as ``check(rank, world, group)``) in a gloo group of
    ``world`` processes with a 30 s timeout and one thread each, then a barrier; the group
    is destroyed whatever happens."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        torch.set_num_threads(1)
        group = dist.group.WORLD
        for check in checks:
            check(rank, world, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def meet(group, world):
    """A collective of every call (of f, or of a backward): a rank calling more often than
    another waits for ever, or pairs with another collective."""
    import torch.distributed as dist

    met = torch.ones(1, dtype=torch.int64)
    dist.all_reduce(met, group=group)
    assert int(met) == world


def alike(value, group, world):
    """``value`` as every rank holds it (asserts they are equal; a tensor's NaN and
    infinities compared by place)."""
    import torch.distributed as dist

    if isinstance(value, torch.Tensor):
        value = value.nan_to_num(nan=7.0, posinf=8.0, neginf=9.0).tolist()
    said = [None] * world
    dist.all_gather_object(said, value, group=group)
    assert all(s == said[0] for s in said), said
    return said[0]


def twice_with(backward, save_input=False):
    """A custom Function computing 2 x, with the given ``backward(ctx, g)`` (a rank's own, in
    the distributed tests), forward-mode 2 t and vmap's generated rule; ``save_input``
    saves x for the backward."""

    class Twice(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            if save_input:
                ctx.save_for_backward(inputs[0])

        @staticmethod
        def jvp(ctx, t):
            return t * 2

    Twice.backward = staticmethod(backward)
    return Twice


def one_rank_failed(rank, call, message):
    """Runs ``call`` on two ranks where rank 1 raises ``MemoryError(message)`` inside it:
    rank 1 gets its own error, rank 0 a JacobianCallError naming rank 1 and quoting it, and
    neither waits for the other. Returns rank 0's message ('' on rank 1)."""
    import pytest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if rank == 1:
            with pytest.raises(MemoryError, match=message):
                call()
            return ""
        with pytest.raises(tv.JacobianCallError) as info:
            call()
    said = str(info.value)
    assert "rank 1 of the process_group failed" in said, said
    assert f"MemoryError: {message}" in said, said
    return said
