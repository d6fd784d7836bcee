"""Per-sample calls on parametrized models made inside torch.nn.utils.parametrize.cached()
(NOTE [parametrize.cached()] in torch_vjp._per_sample.plan), compared in float64 with the
definition, one example at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import torch_vjp as tv

DT = torch.float64
STRATEGIES = ("auto", "vmap", "loop")


def _model():
    torch.manual_seed(1)
    return nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(),
                         nn.Linear(5, 3)).to(DT)


def _data():
    torch.manual_seed(0)
    return torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))


def loop_reference(model, loss_fn, x, t):
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    per = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), t[i:i + 1]), params)
           for i in range(x.shape[0])]
    return {n: torch.stack([g[k] for g in per]) for k, n in enumerate(names)}


@pytest.mark.parametrize("first_call_outside", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_calls_inside_parametrize_cached_give_the_definition(strategy, first_call_outside):
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = _data()
    ref = loop_reference(model, loss_fn, x, y)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    clip = (1.0 / norms).clamp(max=1.0)
    if first_call_outside:  # a plan made on an earlier step, outside the block
        tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
    with parametrize.cached():
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        got_norms = tv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy)
        tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=1.0, strategy=strategy)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    torch.testing.assert_close(got_norms, norms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", clip, ref[n]), msg=n)


def test_the_callers_cache_is_kept_and_put_back_after_an_error():
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = _data()
    with parametrize.cached():
        w = model[0].weight
        tv.per_sample_grad_norms(model, loss_fn, x, y)
        assert model[0].weight is w  # the caller's block still caches, the same tensor
        with pytest.raises(tv.PerSampleValueError, match="targets has shape"):
            tv.per_sample_grad_norms(model, loss_fn, x, y[:2])
        assert parametrize._cache_enabled == 1 and model[0].weight is w
    assert parametrize._cache_enabled == 0 and not parametrize._cache


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (torch's, on the old weight_norm)
@pytest.mark.parametrize("wrap", ["parametrization", "weight_norm"])
def test_hooks_computes_the_plain_bias_of_a_layer_whose_weight_is_computed(wrap):
    # the bias was refused with a reason that fits only the weight
    from torch.nn.utils import weight_norm

    torch.manual_seed(1)
    first = nn.Linear(4, 5)
    first = parametrizations.weight_norm(first) if wrap == "parametrization" else (
        weight_norm(first))
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(5, 3)).to(DT)
    loss_fn = nn.CrossEntropyLoss()
    x, y = _data()
    ref = loop_reference(model, loss_fn, x, y)
    names = ["0.bias", "2.weight"]
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", params=names)
    for n in names:
        torch.testing.assert_close(got[n], ref[n], msg=n)
    plan = tv.per_sample_plan(model, loss_fn, x, y, strategy="hooks")
    assert plan["0.bias"].method == "rule"
    # what hooks cannot compute is listed as refused (it never falls back to vmap)
    computed = [r for r in plan if r.name not in ("0.bias", "2.weight", "2.bias")]
    assert computed and all(r.method == "refused" for r in computed)
    assert all("weight computed from its parameters" in r.reason for r in computed)
    assert "refused  module '0' is a " in str(plan)
    auto = tv.per_sample_plan(model, loss_fn, x, y)
    assert {auto[r.name].method for r in computed} == {"vmap"}


def test_a_cached_block_another_thread_leaves_during_a_call_stays_left():
    # the call saved the counter's value and wrote it back at the end: a block another
    # thread left meanwhile stayed open for good (the cache on everywhere, parametrized
    # weights stale after a change of their parameters)
    import threading

    leave, left = threading.Event(), threading.Event()

    def other_thread():
        with parametrize.cached():
            leave.wait(30)
        left.set()

    class _LeavesMeanwhile(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3).to(DT)

        def forward(self, x):
            if not leave.is_set():
                leave.set()
                left.wait(30)
            return self.lin(x)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        while not parametrize._cache_enabled and thread.is_alive():
            thread.join(0.01)
        x, _ = _data()
        tv.per_sample_grads(_LeavesMeanwhile(), lambda o: o.sum(), x, strategy="loop")
    finally:
        leave.set()
        thread.join()
    count, parametrize._cache_enabled = parametrize._cache_enabled, 0  # (for later tests)
    assert count == 0
    model, (x, _) = _model(), _data()
    before = model(x)
    with torch.no_grad():
        model[0].parametrizations.weight.original0.mul_(2)
    assert not torch.equal(model(x), before)


class _BiasCoupled(nn.Module):
    """A parametrization of a Linear's weight that reads the layer's own bias."""

    def __init__(self, lin):
        super().__init__()
        self.ref = [lin]
        self.c = nn.Parameter(torch.tensor(0.3, dtype=DT))

    def forward(self, w):
        return w + self.c * self.ref[0].bias[:, None]


@pytest.mark.parametrize("seq", [False, True])
def test_a_bias_the_weights_parametrization_reads_is_not_the_rules(seq):
    # the graph walk counted every use of the layer's bias inside the call as the rule's:
    # hooks gave the bias's gradient without the share through the weight, silently
    torch.manual_seed(0)
    lin = nn.Linear(4, 5).to(DT)
    parametrize.register_parametrization(lin, "weight", _BiasCoupled(lin))
    model = nn.Sequential(lin, nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x = torch.randn(6, 2, 4, dtype=DT) if seq else torch.randn(6, 4, dtype=DT)
    y = torch.randint(0, 3, (6,))
    loss_fn = (lambda o, t: nn.functional.cross_entropy(o.sum(1), t)) if seq else \
        nn.CrossEntropyLoss()
    plan = {r.name: r.method for r in tv.per_sample_plan(model, loss_fn, x, y)}
    assert plan["0.bias"] != "rule" and plan["2.weight"] == "rule", plan
    with pytest.raises(tv.StrategyError, match=r"'0\.bias': module '0' is a ParametrizedLinear"):
        tv.per_sample_grads(model, loss_fn, x, y, params=["0.bias", "2.weight"],
                            strategy="hooks")
    ref = loop_reference(model, loss_fn, x, y)
    got = tv.per_sample_grads(model, loss_fn, x, y)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


@pytest.mark.parametrize("seq", [False, True])
def test_the_plain_bias_of_a_weight_normed_layer_stays_the_rules(seq):
    torch.manual_seed(0)
    model = _model()
    x = torch.randn(6, 2, 4, dtype=DT) if seq else torch.randn(6, 4, dtype=DT)
    y = torch.randint(0, 3, (6,))
    loss_fn = (lambda o, t: nn.functional.cross_entropy(o.sum(1), t)) if seq else \
        nn.CrossEntropyLoss()
    plan = {r.name: r.method for r in tv.per_sample_plan(model, loss_fn, x, y)}
    assert plan["0.bias"] == "rule", plan


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


class _Seq(nn.Module):
    """A recurrent layer (or attention) over (B, T, 4), then a Linear."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.rnn = (nn.LSTM(4, 3, batch_first=True) if kind == "lstm" else
                    nn.MultiheadAttention(4, 2, batch_first=True))
        self.o = nn.Linear(3 if kind == "lstm" else 4, 2)

    def forward(self, x):
        h = self.rnn(x)[0] if self.kind == "lstm" else self.rnn(x, x, x)[0]
        return self.o(h[:, -1])


def _parametrized(case):
    torch.manual_seed(0)
    if case == "linear bias":
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
        parametrize.register_parametrization(model[0], "bias", _Double())
        return model, torch.randn(5, 4, dtype=DT)
    model = _Seq("mha" if case == "attention in_proj_weight" else "lstm").to(DT)
    x = torch.randn(5, 3, 4, dtype=DT)
    if case == "lstm orthogonal":
        parametrizations.orthogonal(model.rnn, "weight_hh_l0")
    elif case == "attention in_proj_weight":
        parametrize.register_parametrization(model.rnn, "in_proj_weight", _Double())
    else:  # the older weight_norm: a forward pre-hook sets the weight it computes
        with pytest.warns(FutureWarning):
            torch.nn.utils.weight_norm(model.rnn, "weight_hh_l0")
    return model, x


@pytest.mark.parametrize("case, name, reason", [
    ("linear bias", "0.parametrizations.bias.original", r"module '0' is a ParametrizedLinear, "
     r"which has a rule, but the layer is called with a bias computed from its parameters "
     r"\(a parametrization, torch.nn.utils.parametrize\), and the rule gives per-sample "
     r"gradients for the tensors a layer is called with"),
    # (said "it is used outside the layers that have rules (directly in a forward, or by a
    # layer without one)": the layer has a rule, and the parameter is used by it alone)
    ("lstm orthogonal", "rnn.weight_ih_l0", r"module 'rnn' is a ParametrizedLSTM, which has a "
     r"rule, but the layer is called with a weight_hh_l0 computed from its parameters"),
    # (said "its module 'rnn.parametrizations.in_proj_weight' is a ParametrizationList,
    # which has no per-layer rule")
    ("attention in_proj_weight", "rnn.parametrizations.in_proj_weight.original",
     r"module 'rnn' is a ParametrizedMultiheadAttention, which has a rule, but the layer is "
     r"called with an in_proj_weight computed from its parameters \(a parametrization"),
    # (hooks raised "the model's forward fails while the hooks record it (KeyError:
    # 'weight_hh_l0')": the LSTM rule read the weight from the layer's parameters)
    ("lstm old weight_norm", "rnn.weight_hh_l0_g", r"the LSTM rule reads the layer's weights "
     r"as its parameters, and weight_hh_l0 is computed by a forward pre-hook "
     r"\(torch.nn.utils.weight_norm or spectral_norm\)"),
])
@pytest.mark.filterwarnings("ignore:.*could not vectorise")  # (vmap and the LSTM's kernel)
def test_a_parametrized_layers_refusal_says_what_is_computed(case, name, reason):
    model, x = _parametrized(case)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    plan = tv.per_sample_plan(model, loss_fn, x)
    # (vmap cannot batch torch's LSTM: the loop, as the plan says)
    assert plan[name].method == ("loop" if case.startswith("lstm") else "vmap"), str(plan)
    assert "used outside" not in str(plan) and "ParametrizationList" not in str(plan)
    with pytest.raises(tv.StrategyError, match=rf"'{name}': {reason}(.|\n)*Or use "
                                                r"strategy='auto'"):
        tv.per_sample_grads(model, loss_fn, x, strategy="hooks")
    names = [n for n, _ in model.named_parameters()]
    per = [torch.autograd.grad(loss_fn(model(x[i:i + 1])), list(model.parameters()))
           for i in range(x.shape[0])]
    got = tv.per_sample_grads(model, loss_fn, x)
    for k, n in enumerate(names):
        torch.testing.assert_close(got[n], torch.stack([g[k] for g in per]), msg=n)


def test_the_plain_weight_of_a_layer_whose_bias_is_computed_stays_the_rules():
    # the weight reaches the layer's operator through weight.t(), a view, which was taken
    # for a use outside the rule: '0.weight' went to vmap, and hooks refused it ("it is
    # used outside the layers that have rules")
    model, x = _parametrized("linear bias")
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    plan = tv.per_sample_plan(model, loss_fn, x)
    assert plan["0.weight"].method == "rule", str(plan)
    names = ["0.weight", "2.weight", "2.bias"]
    got = tv.per_sample_grads(model, loss_fn, x, strategy="hooks", params=names)
    params = dict(model.named_parameters())
    for n in names:
        want = torch.stack([torch.autograd.grad(loss_fn(model(x[i:i + 1])), params[n])[0]
                            for i in range(x.shape[0])])
        torch.testing.assert_close(got[n], want, msg=n)


class _ViewOfBias(nn.Module):
    """A weight computed as a chain of views of the layer's own bias."""

    def __init__(self, layer):
        super().__init__()
        self.layer = [layer]  # (a list: not a submodule)

    def forward(self, w):
        return self.layer[0].bias.unsqueeze(1).expand_as(w)


def test_a_bias_the_weight_is_a_view_of_is_not_the_rules():
    # the rule's share of the bias is its direct use alone; through the weight, a chain of
    # views below weight.t(), the bias is used outside the rule
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    parametrize.register_parametrization(model[0], "weight", _ViewOfBias(model[0]),
                                         unsafe=True)
    x = torch.randn(5, 4, dtype=DT)
    loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
    assert tv.per_sample_plan(model, loss_fn, x)["0.bias"].method == "vmap"
    with pytest.raises(tv.StrategyError, match=r"'0.bias': module '0' is a ParametrizedLinear"):
        tv.per_sample_grads(model, loss_fn, x, strategy="hooks")
    bias = model[0].bias
    want = torch.stack([torch.autograd.grad(loss_fn(model(x[i:i + 1])), bias)[0]
                        for i in range(5)])
    torch.testing.assert_close(tv.per_sample_grads(model, loss_fn, x)["0.bias"], want)
