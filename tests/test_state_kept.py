"""Nothing of the user's changes (SPEC §0, NOTE [what a call puts back]): a BatchNorm held in
a plain list attribute of a module, and running statistics a function captures and updates
with F.batch_norm (a kernel that bumps no version counter), are as they were after a call."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64


class _ListNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.norms = [torch.nn.BatchNorm1d(3).double()]  # plain list, not a ModuleList

    def forward(self, x):
        return self.norms[0](self.lin(x))


def _reference(net, x):
    # (the Jacobian of one call by torch.func.jacrev, which refuses the running statistics'
    # update: the same function without them)
    bn = net.norms[0]
    return torch.func.jacrev(lambda t: F.batch_norm(
        net.lin(t), None, None, bn.weight, bn.bias, training=True, eps=bn.eps))(x)


@pytest.mark.parametrize("strategy", ["auto", "rev-loop", "fwd-loop"])
def test_a_batchnorm_in_a_plain_list_keeps_its_statistics(strategy):
    x = torch.randn(4, 3, dtype=D)
    net = _ListNet()
    bn = net.norms[0]
    want = _reference(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(net, x, strategy=strategy)
    torch.testing.assert_close(got, want)
    assert bn.num_batches_tracked.item() == 0
    torch.testing.assert_close(bn.running_mean, torch.zeros(3, dtype=D))
    torch.testing.assert_close(bn.running_var, torch.ones(3, dtype=D))


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop", "fwd-loop"])
def test_captured_running_statistics_are_put_back(strategy):
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def f(t):
        return F.batch_norm(t, rm, rv, training=True)

    want = torch.func.jacrev(lambda t: F.batch_norm(t, None, None, training=True))(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tv.jacobian(f, x, strategy=strategy)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(rm, torch.zeros(3, dtype=D))
    torch.testing.assert_close(rv, torch.ones(3, dtype=D))


def test_batch_jacobian_and_hessian_put_captured_statistics_back():
    x = torch.randn(4, 3, dtype=D)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def f(t):
        return torch.tanh(t) + 0 * F.batch_norm(t, rm, rv, training=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tv.batch_jacobian(f, x)
        tv.hessian(lambda t: f(t).sum(), x)
    torch.testing.assert_close(rm, torch.zeros(3, dtype=D))
    torch.testing.assert_close(rv, torch.ones(3, dtype=D))


def test_a_large_captured_tensor_is_not_copied():
    # (NOTE [what a call puts back]: over KEPT_ELEMENTS, a tensor is not copied per call)
    from torch_vjp._engine.context import KEPT_ELEMENTS, buffers_kept

    big = torch.zeros(KEPT_ELEMENTS + 1, dtype=D)
    small = torch.zeros(3, dtype=D)

    def f(t):
        return t * big[:3] + small

    ctx = buffers_kept(f)  # (the first call for f: NOTE [captured tensors, learned once])
    kept = [t for _, _, t, _, _ in ctx.watched.entries]  # (Walked holds the Watched)
    assert any(t is small for t in kept) and not any(t is big for t in kept)


def test_a_function_that_moved_no_captured_weight_does_not_copy_it_again():
    # (NOTE [captured tensors, learned once]: a copy and a comparison of every captured
    # weight on every call cost a compiled MLP Jacobian a quarter of its time)
    from torch_vjp._engine.context import LEARNED_FROM, buffers_kept

    n = int(LEARNED_FROM ** 0.5) + 1  # (a weight of at least LEARNED_FROM elements)
    w, b = torch.randn(n, n, dtype=D), torch.zeros(n, dtype=D)
    rm, rv = torch.zeros(n, dtype=D), torch.ones(n, dtype=D)

    def still(t):
        return t @ w + b

    def moving(t):
        return torch.nn.functional.batch_norm(t @ w, rm, rv, training=True)

    with buffers_kept(still):
        still(torch.randn(4, n, dtype=D))
    kept = [e[2] for e in buffers_kept(still).watched.entries]
    assert any(t is b for t in kept) and not any(t is w for t in kept)  # small: every call
    for _ in range(3):  # learned the other way: put back on every call
        with buffers_kept(moving):
            moving(torch.randn(4, n, dtype=D))
        assert torch.equal(rm, torch.zeros(n, dtype=D)) and torch.equal(rv, torch.ones(n, dtype=D))


def test_statistics_a_function_moves_only_on_a_later_call_are_put_back():
    # A flag the route key does not see (an object's attribute, the batch size) switches
    # the update on after the first call: small tensors are kept on every call.
    from types import SimpleNamespace

    cfg = SimpleNamespace(train=False)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)

    def f(t):
        return torch.nn.functional.batch_norm(t, rm, rv, training=cfg.train or t.shape[0] > 4)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tv.jacobian(f, torch.randn(4, 3, dtype=D))
        cfg.train = True
        tv.jacobian(f, torch.randn(4, 3, dtype=D))
        assert torch.equal(rm, torch.zeros(3, dtype=D)) and torch.equal(rv, torch.ones(3, dtype=D))
        cfg.train = False
        tv.jacobian(f, torch.randn(6, 3, dtype=D))
    assert torch.equal(rm, torch.zeros(3, dtype=D)) and torch.equal(rv, torch.ones(3, dtype=D))

def test_an_unchanged_tensor_holding_nan_is_not_written():
    # (NOTE [unchanged, bit for bit]: torch.equal says a NaN differs from itself; writing the
    # "changed" tensor back bumped its version and broke the user's graph that saved it)
    c = torch.tensor([1.0, float("nan"), 2.0, -0.0])
    w = torch.randn(4, requires_grad=True)
    y = (w * c).nansum()  # (saves c for backward)
    before = c._version
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        for strategy in ("auto", "rev-loop"):
            tv.jacobian(lambda t: torch.nan_to_num(t * c), torch.randn(4), strategy=strategy)
    assert c._version == before
    y.backward()  # (would raise: modified by an inplace operation)
    torch.testing.assert_close(w.grad, torch.tensor([1.0, float("nan"), 2.0, -0.0]),
                               equal_nan=True)


def test_a_captured_sign_of_zero_is_put_back():
    # (bit for bit: -0.0 written as 0.0 by f is a change, and the copy puts it back)
    c = torch.tensor([-0.0, 1.0])

    def f(t):
        c.abs_()
        return t * 2

    tv.jacobian(f, torch.randn(2), strategy="rev-loop")
    assert torch.signbit(c).tolist() == [True, False]


def test_same_bits():
    from torch_vjp._engine.kept import same_bits

    t = torch.tensor([1.0, float("nan"), -0.0])
    assert same_bits(t, t.clone())
    assert not same_bits(t, torch.tensor([1.0, float("nan"), 0.0]))
    z = torch.tensor([complex(1, float("nan"))])
    assert same_bits(z, z.clone()) and same_bits(z.conj(), z.conj().clone())
    assert same_bits(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert same_bits(t[::2], t.clone()[::2])  # (strided)


@pytest.mark.parametrize("strategy", ["rev-loop", "auto"])
def test_captured_tensors_past_the_total_are_warned_of(strategy, monkeypatch):
    # (NOTE [what a call puts back]: tensors in a global list past KEPT_TOTAL elements are not
    # put back; the warning reads the same collection as the put-back, so it says so)
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())
    bufs = [torch.zeros(60000) for _ in range(20)]  # (1.2M elements: past the total)

    def f(x):
        for b in bufs:
            b.add_(1.0)
        return x * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tv.jacobian(f, torch.randn(3), strategy=strategy)
    moved = [int(b[0]) for b in bufs]
    said = [str(w.message) for w in caught
            if "changes a tensor it captures in place" in str(w.message)]
    assert moved[0] == 0  # (the first ones are put back)
    assert any(moved), moved  # (the last ones are not)
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "1048576 elements of such tensors in all" in said[0]


class _Rebinds(torch.nn.Module):
    # (a forward that rebinds its buffer, as a running scale or a lazily grown cache does)
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.register_buffer("scale", torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        self.scale = self.scale * 1.1
        return self.lin(x) * self.scale


@pytest.mark.parametrize("strategy", ["rev", "fwd", "rev-loop"])
@pytest.mark.parametrize("training", [True, False])
def test_a_buffer_the_forward_rebinds_is_the_modules_own_again(strategy, training):
    # the module was left holding the tensor its last call of f made (2.2 or 2.42, where
    # it held 2.0), a torch.func wrapper where that call ran under a transform
    m = _Rebinds().train(training)
    scale, x = m.scale, torch.randn(3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        tv.jacobian(m, x, strategy=strategy)
        tv.batch_jacobian(lambda xs: m(xs), x.expand(2, 3), strategy=strategy)
    assert m.scale is scale and scale.item() == 2.0
    assert list(m._buffers) == ["scale"]


@pytest.mark.parametrize("call", ["jvp", "jvp batched", "vjp"])
def test_a_buffer_the_forward_rebinds_is_the_modules_own_again_after_jvp_and_vjp(call):
    # tv.jvp and tv.vjp left the module holding the GradTrackingTensor of value 2.2 their
    # call of f made under torch.func's transform
    m = _Rebinds()
    scale, x = m.scale, torch.randn(3, dtype=torch.float64)
    eye = torch.eye(3, dtype=torch.float64)
    if call == "jvp":
        out, jt = tv.jvp(m, (x,), (eye[0],))
        expected = 2.2 * m.lin.weight.detach()[:, 0]
    elif call == "jvp batched":
        out, jt = tv.jvp(m, (x,), (eye,), batched=True)
        expected = 2.2 * m.lin.weight.detach().T
    else:
        out, vjp_fn = tv.vjp(m, x)
        jt, = vjp_fn(eye[1])
        expected = 2.2 * m.lin.weight.detach()[1]
    assert m.scale is scale and scale.item() == 2.0
    assert type(m.scale) is torch.Tensor and list(m._buffers) == ["scale"]
    torch.testing.assert_close(out, m.lin(x) * 2.2)
    torch.testing.assert_close(jt, expected)


class _LazyCache(torch.nn.Module):
    # no buffer until its first call, which registers one from a tensor of the call (as a
    # rotary embedding's cache is made on first use)
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        if getattr(self, "cache", None) is None:
            self.register_buffer("cache", torch.ones_like(x) * 2, persistent=False)
        return self.lin(x) * self.cache


class _BufferToParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        if "w" in self._buffers:
            w = self._buffers.pop("w")
            self.w = torch.nn.Parameter(w.detach().clone())
        return x * self.w


@pytest.mark.parametrize("strategy", ["rev", "fwd", "rev-loop"])
def test_a_buffer_the_forward_registers_or_replaces_is_taken_back(strategy):
    # a module without buffers was not looked at on exit: the buffer its forward registered
    # lazily stayed, a GradTrackingTensor of a finished transform; and a buffer f replaced
    # by a Parameter came back beside it, the name both a buffer and a parameter
    x = torch.randn(3, dtype=torch.float64)
    lazy = _LazyCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(lazy, x, strategy=strategy)
    assert dict(lazy._buffers) == {}
    torch.testing.assert_close(J, 2.0 * lazy.lin.weight.detach())
    assert type(lazy(x)) is torch.Tensor and type(lazy.cache) is torch.Tensor
    m = _BufferToParameter()
    w = m.w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian(m, x, strategy=strategy)
    torch.testing.assert_close(J, 2.0 * torch.eye(3, dtype=torch.float64))
    assert m._buffers["w"] is w and dict(m._parameters) == {}
    assert [name for name, _ in m.named_buffers()] == ["w"]


class _Renormed(torch.nn.Module):
    """An Embedding with max_norm (whose forward renormalises the rows it looks up, in place,
    in eval mode too) feeding a layer of the differentiated input."""

    def __init__(self, bag=False):
        super().__init__()
        self.emb = (torch.nn.EmbeddingBag(10, 4, max_norm=1.0, mode="sum") if bag
                    else torch.nn.Embedding(10, 4, max_norm=1.0)).double()
        with torch.no_grad():
            self.emb.weight.mul_(5)  # (every row longer than max_norm)
        self.idx = torch.tensor([[1, 2, 3]]) if bag else torch.tensor([1, 2, 3])

    def forward(self, x):
        e = self.emb(self.idx).reshape(-1, 4)
        return torch.tanh(e * x).sum(-1)


def _renormed_reference(net, x):
    # (the Jacobian at the renormalised table, which is what every call of f but the first
    # one sees: the table renormalised once, on a copy)
    import copy

    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin(x)
    e = twin.emb(twin.idx).reshape(-1, 4).detach()
    return torch.func.jacrev(lambda t: torch.tanh(e * t).sum(-1))(x)


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("call", ["auto", "rev-loop", "fwd-loop", "compile", "hessian",
                                  "eval"])
def test_an_embedding_with_max_norm_keeps_its_table(bag, call):
    # (its forward renormalises the rows it looks up in place; a Jacobian call changed the
    # user's table as a training step would, and compile=True's warning said the eager call
    # puts it back, which it did not)
    net = _Renormed(bag)
    if call == "eval":
        net.eval()
    before = net.emb.weight.detach().clone()
    x = torch.randn(3, 4, dtype=D)
    ref = _renormed_reference(net, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (vmap's refusal of the in-place renorm; compile's)
        if call in ("auto", "rev-loop", "fwd-loop", "eval"):
            got = tv.jacobian(net, x, strategy="auto" if call == "eval" else call)
            torch.testing.assert_close(got, ref)
        elif call == "compile":
            for _ in range(2):
                torch.testing.assert_close(tv.jacobian(net, x, compile=True), ref)
        else:
            tv.hessian(lambda t: net(t).sum(), x)
    assert torch.equal(net.emb.weight, before), "the table was renormalised in place"


@pytest.mark.parametrize("call", ["fwd", "jvp", "vjp"])
def test_torch_funcs_refusal_of_max_norm_says_eval_mode_is_no_fix(call):
    # (torch.func refuses the in-place renormalisation; the message named a module's running
    # statistics and eval mode, which renormalises just the same)
    net = _Renormed().eval()
    before = net.emb.weight.detach().clone()
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(tv.TorchVJPError) as info:
        if call == "fwd":
            tv.jacobian(net, x, strategy="fwd")
        elif call == "jvp":
            tv.jvp(net, (x,), (torch.ones_like(x),))
        else:
            tv.vjp(net, x)
    text = str(info.value)
    assert "an Embedding with max_norm renormalises the rows it looks up, in eval mode too" \
        in text, text
    assert "set the Embedding's max_norm to None" in text and "eval mode (" not in text, text
    assert "running statistics" not in text, text
    assert torch.equal(net.emb.weight, before)
