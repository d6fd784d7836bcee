"""Rules registered with tv.register_per_sample_rule: an error a rule raises is the user's
to see, as it is (SPEC §0), with a note naming the rule and the layer; never left silently
to the fallback, nor blamed on the model's forward. NotImplementedError declines a call."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import torch_vjp as tv
from torch_vjp._per_sample import probe, registry

DT = torch.float64


class _Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.full((n,), 1.5))

    def forward(self, x):
        return x * self.w


@pytest.fixture
def failing_rule():
    calls = []

    class Scale(_Scale):
        pass

    def scale_rule(module, inputs, grad_output):
        calls.append(1)
        raise ValueError("bug in my rule")

    tv.register_per_sample_rule(Scale, scale_rule)
    try:
        yield Scale, calls
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("fn", ["per_sample_grads", "per_sample_grad_norms",
                                "accumulate_clipped_grads"])
def test_an_error_in_a_registered_rule_propagates_chained(failing_rule, fn, strategy):
    Scale, calls = failing_rule
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    kw = {"max_norm": 1.0} if fn == "accumulate_clipped_grads" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning instead of the error either)
        with pytest.raises(ValueError) as info:
            getattr(tv, fn)(model, nn.CrossEntropyLoss(), x, y, strategy=strategy, **kw)
    # the rule's own exception, untouched but for a note (it came wrapped in a PerSampleError)
    assert type(info.value) is ValueError and str(info.value) == "bug in my rule"
    assert info.value.__cause__ is None
    (note,) = info.value.__notes__
    assert re.fullmatch(
        rf"\(raised in torch_vjp\.{fn} by the per-sample rule 'scale_rule' \(registered for "
        r"Scale\) on the layer '1' \(Scale\)\. .*a rule declines a call it cannot compute "
        r"by raising NotImplementedError\. Fix the rule, or pass strategy='vmap' or "
        r"strategy='loop', which do not use it\.\)", note), note
    assert calls
    assert all(p.grad is None for p in model.parameters())


def test_a_rule_that_works_is_still_used_after_one_that_failed(failing_rule):
    Scale, _ = failing_rule
    tv.register_per_sample_rule(Scale, lambda m, inputs, g: {"w": inputs[0] * g})
    probe.forget_plans()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    loss_fn = nn.CrossEntropyLoss()
    got = tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    for i in range(5):
        ref = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), model[1].w)[0]
        torch.testing.assert_close(got["1.w"][i], ref)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_not_implemented_error_from_a_rule_declines_the_call(strategy):
    # it reached the caller wrapped in a PerSampleError, as a bug of the rule
    class Scale(_Scale):
        pass

    def picky_rule(module, inputs, grad_output):
        raise NotImplementedError("only 3-d inputs")

    tv.register_per_sample_rule(Scale, picky_rule)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), Scale(4), nn.Linear(4, 3)).to(DT)
        x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
        loss_fn = nn.CrossEntropyLoss()
        if strategy == "hooks":
            with pytest.raises(tv.StrategyError, match=(
                    r"strategy='hooks' cannot compute '1\.w': the 'picky_rule' \(registered for "
                    r"Scale\) rule in '1' cannot compute this call of the layer \(the rule "
                    r"raised NotImplementedError: only 3-d inputs\)")):
                tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
            return
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        for i in range(5):
            ref = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), model[1].w)[0]
            torch.testing.assert_close(got["1.w"][i], ref)
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


class _Affine(nn.Module):  # y = x * w + b, the bias added in the layer's own forward
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.b = nn.Parameter(torch.linspace(-1.0, 1.0, n))

    def forward(self, x):
        return x * self.w + self.b


@pytest.fixture
def affine_rule():
    class Affine(_Affine):
        pass

    tv.register_per_sample_rule(Affine, lambda m, inputs, g: {"w": inputs[0] * g, "b": g})
    try:
        yield Affine
    finally:
        registry._RULES.pop(Affine, None)
        probe.forget_plans()


@pytest.mark.parametrize("fn", ["per_sample_grads", "per_sample_grad_norms",
                                "accumulate_clipped_grads"])
def test_a_rule_layer_that_adds_its_own_bias_counts_it_once(affine_rule, fn):
    # the add of self.b was recorded as a broadcast parameter as well as by the rule: the
    # bias's gradient came out twice (norm 1.01 against 0.51), and strategy='hooks' raised
    # "gives wrong per-sample gradients"
    torch.manual_seed(0)
    model = nn.Sequential(affine_rule(3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    loss_fn = nn.CrossEntropyLoss()
    ref = tv.per_sample_grads(model, loss_fn, x, y, strategy="loop")
    assert tv.per_sample_plan(model, loss_fn, x, y, strategy="hooks")["0.b"].method == "rule"
    norms = sum(g.flatten(1).pow(2).sum(1) for g in ref.values()).sqrt()
    if fn == "per_sample_grads":
        got = tv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g)
    elif fn == "per_sample_grad_norms":
        torch.testing.assert_close(
            tv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks"), norms)
    else:
        got = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.2, strategy="hooks")
        torch.testing.assert_close(got, norms)
        c = (0.2 / norms).clamp(max=1.0)
        torch.testing.assert_close(model[0].b.grad, torch.einsum("b,bi->i", c, ref["0.b"]))


@pytest.mark.parametrize("key, match", [
    (0, r"returned a gradient keyed by 0 \(an int\), which is neither the name of a parameter "
        r"of the layer '0' \(Scale\) nor one of its parameter tensors(.|\n)*Fix: key each "
        r"gradient by its attribute name \(\['w'\]\)"),
    ("other", r"keyed by a tensor of shape \(3,\), which is neither"),
])
def test_a_rule_keying_a_gradient_by_something_else_is_named(key, match):
    # the gradient was dropped silently: 'hooks' then blamed the model ("gives wrong
    # per-sample gradients", norm 0 against 0.97)
    class Scale(_Scale):
        pass

    other = nn.Linear(2, 3)
    k = other.bias if key == "other" else key
    tv.register_per_sample_rule(Scale, lambda m, inputs, g: {k: inputs[0] * g})
    try:
        model = nn.Sequential(Scale(3), nn.Linear(3, 2)).to(DT)
        with pytest.raises(tv.PerSampleTypeError, match=match):
            tv.per_sample_grads(model, lambda o: o.sum(), torch.randn(4, 3, dtype=DT),
                                strategy="hooks")
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


def test_a_rule_result_in_another_dtype_is_given_in_the_parameters():
    # a float32 result for a float64 parameter came back as float32 (error 2e-8)
    class Scale(_Scale):
        pass

    tv.register_per_sample_rule(Scale, lambda m, inputs, g: {"w": (inputs[0] * g).float()})
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Scale(3), nn.Linear(3, 2)).to(DT)
        x = torch.randn(4, 3, dtype=DT)
        got = tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="hooks")
        ref = tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="loop")
        assert got["0.w"].dtype == DT
        torch.testing.assert_close(got["0.w"], ref["0.w"], rtol=1e-6, atol=1e-7)
        tv.register_per_sample_rule(Scale, lambda m, inputs, g: {"w": (inputs[0] * g).long()})
        with pytest.raises(tv.PerSampleTypeError, match=(
                r"returned a tensor of dtype torch.int64 for '0.w', but gradients are floating "
                r"point, in the parameter's dtype \(torch.float64\)")):
            tv.per_sample_grads(model, lambda o: o.sum(), x, strategy="hooks")
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


def _scale_rule(module, inputs, grad_output):
    (x,) = inputs
    return {"w": (x * grad_output).sum(1)}


@pytest.mark.parametrize("batch_dims", [lambda x: 0, lambda x: [-3], lambda x: (0, 1),
                                        lambda x: np.int64(0), lambda x: [np.int32(-3)]],
                         ids=["an-int", "negative", "two", "numpy-int", "numpy-ints"])
def test_batch_dims_as_an_int_or_counted_from_the_end(batch_dims):
    # an int raised "TypeError: 'int' object is not iterable"; -3 (dimension 0 of a 3-D
    # input) was taken for no dimension, and 'hooks' refused the layer; numpy's integers
    # (which torch takes for dimensions) were refused as "must give a sequence of ints"
    class Scale(_Scale):
        pass

    tv.register_per_sample_rule(Scale, _scale_rule, batch_dims=batch_dims)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Scale(3), nn.Linear(3, 2)).to(DT)
        x = torch.randn(4, 5, 3, dtype=DT)
        loss_fn = lambda o: o.pow(2).sum()  # noqa: E731
        got = tv.per_sample_grads(model, loss_fn, x, strategy="hooks")
        ref = tv.per_sample_grads(model, loss_fn, x, strategy="loop")
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g)
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


@pytest.mark.parametrize("returned, shown", [(None, "None"), (["a"], r"\['a'\]"), ([5], r"\[5\]")])
def test_batch_dims_that_are_not_dimensions_of_the_input_are_named(returned, shown):
    # None and ['a'] raised TypeError from inside torch_vjp ("'NoneType' object is not
    # iterable", "'<' not supported"); [5] was refused as "a table shared by every example"
    class Scale(_Scale):
        pass

    tv.register_per_sample_rule(Scale, _scale_rule, batch_dims=lambda x: returned)
    try:
        model = nn.Sequential(Scale(3), nn.Linear(3, 2)).to(DT)
        with pytest.raises(tv.PerSampleTypeError, match=(
                rf"batch_dims of the per-sample rule '_scale_rule' \(registered for Scale\) "
                rf"returned {shown} for the layer's first input \(shape \(4, 5, 3\)\), but it "
                rf"must give a dimension of that input, or a sequence of them \(ints from -3 to "
                rf"2\), that may hold the examples")):
            tv.per_sample_grads(model, lambda o: o.sum(), torch.randn(4, 5, 3, dtype=DT),
                                strategy="auto")
    finally:
        registry._RULES.pop(Scale, None)
        probe.forget_plans()


def _frozen_selection_net(layer, frozen="a.w"):
    """A rule layer ``a``, a parameter added to its output, and a Linear; the parameter
    ``frozen`` is frozen (in params, the call then records a stand-in for it)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = layer
            self.pos = nn.Parameter(torch.linspace(-0.5, 0.5, 3))
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(torch.tanh(self.a(x) + self.pos))

    torch.manual_seed(0)
    model = Net().to(DT)
    model.get_parameter(frozen).requires_grad_(False)
    return model, torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))


def test_a_rule_layer_that_adds_its_own_bias_counts_it_once_beside_a_frozen_selection(
        affine_rule):
    # a frozen parameter in params makes the rules' pass track stand-ins, which the layer
    # does not hold before its forward, and a parameter added to the batch makes that pass
    # record direct uses: the layer's own add was recorded again there ('hooks' refused,
    # "the layers the model calls change from one call to the next")
    model, x, y = _frozen_selection_net(affine_rule(3), frozen="fc.weight")
    names = ["a.w", "a.b", "pos", "fc.weight"]
    ref = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, params=names, strategy="loop")
    got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, params=names,
                              strategy="hooks")
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g)


def test_a_rule_keyed_by_a_frozen_selected_parameter_itself_is_not_dropped():
    # keyed by the parameter tensor (module.w), for a frozen parameter in params: the call
    # holds a stand-in, so the key matched no recorded tensor and the gradient was dropped
    # ('hooks' blamed the model: norm 0 against 0.15)
    class Keyed(_Affine):
        pass

    tv.register_per_sample_rule(Keyed, lambda m, inputs, g: {m.w: inputs[0] * g, m.b: g})
    try:
        model, x, y = _frozen_selection_net(Keyed(3))
        names = ["a.w", "a.b", "pos", "fc.weight", "fc.bias"]
        loss_fn = nn.CrossEntropyLoss()
        ref = tv.per_sample_grads(model, loss_fn, x, y, params=names, strategy="loop")
        got = tv.per_sample_grads(model, loss_fn, x, y, params=iter(names), strategy="hooks")
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g)
    finally:
        registry._RULES.pop(Keyed, None)
        probe.forget_plans()


@pytest.mark.parametrize("frozen", [False, True])
def test_a_rule_giving_a_parameter_twice_is_refused(frozen):
    # {"w": g, module.w: g}: both were summed (norm 0.30 against 0.15) or, for a frozen
    # parameter in params, the second was dropped
    class Twice(_Affine):
        pass

    tv.register_per_sample_rule(
        Twice, lambda m, inputs, g: {"w": inputs[0] * g, m.w: inputs[0] * g, "b": g})
    try:
        model, x, y = _frozen_selection_net(Twice(3))
        model.a.w.requires_grad_(not frozen)
        names = ["a.w", "a.b", "pos", "fc.weight", "fc.bias"]
        with pytest.raises(tv.PerSampleValueError, match=re.escape(
                "returned two gradients for 'a.w' (keyed once by its name and once by the "
                "parameter itself), which would count its gradient twice. Fix: return one "
                "entry per parameter")):
            tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, params=names,
                                strategy="hooks")
    finally:
        registry._RULES.pop(Twice, None)
        probe.forget_plans()


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("use", ["add_after", "expand_after", "add_before", "tied"])
def test_a_rule_layers_parameter_added_outside_its_forward_is_recorded(affine_rule, use,
                                                                       frozen):
    # the layer's own add was left to its rule by refusing to record any use of its
    # parameters, so an add outside the layer (or through a tied name) was never recorded
    # and 'hooks' refused ('used outside the layers that have rules'; with a frozen
    # parameter in params and a tied one, 'the layers the model calls change')
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = affine_rule(3)
            self.fc = nn.Linear(3, 2)
            if use == "tied":
                self.pos = self.a.b

        def forward(self, x):
            if use == "add_before":
                return self.fc(torch.tanh(self.a(torch.tanh(x + self.a.b))))
            h = self.a(x)
            if use == "expand_after":
                return self.fc(torch.tanh(h + self.a.b.expand_as(h)))
            return self.fc(torch.tanh(h + (self.pos if use == "tied" else self.a.b)))

    torch.manual_seed(0)
    model = Net().to(DT)
    model.fc.weight.requires_grad_(not frozen)
    x, y = torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))
    names = [n for n, _ in model.named_parameters()]
    loss_fn = nn.CrossEntropyLoss()
    ref = tv.per_sample_grads(model, loss_fn, x, y, params=names, strategy="loop")
    got = tv.per_sample_grads(model, loss_fn, x, y, params=names, strategy="hooks")
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g)


def _registered_without_bias(cls):
    """``cls`` (an _Affine) registered with a rule that leaves b out of its dict, and a
    model and batch that use it."""
    tv.register_per_sample_rule(cls, lambda m, inputs, g: {"w": inputs[0] * g})
    torch.manual_seed(0)
    model = nn.Sequential(cls(3), nn.Tanh(), nn.Linear(3, 2)).to(DT)
    return model, torch.randn(4, 3, dtype=DT), torch.randint(0, 2, (4,))


def test_a_rule_that_leaves_out_a_parameter_is_named_by_the_hooks_refusal():
    # a rule returning {"w": ...} for a layer with w and b: 'hooks' blamed the model ("the
    # model reorders or mixes examples ... or the layer's call is one the rule cannot
    # replay"; '0.b' norm 0 against 0.28), not the rule
    class NoBias(_Affine):
        pass

    model, x, y = _registered_without_bias(NoBias)
    try:
        with pytest.raises(tv.PerSampleError, match=re.escape(
                "for '0.b', the rule result disagreed with the per-example loop") + "(.|\n)*"
                + re.escape("or the rule you registered, '<lambda>' (registered for NoBias), "
                            "gives a wrong gradient for it, or none (a parameter left out of "
                            "the dict it returns gets none, norm 0)")):
            tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    finally:
        registry._RULES.pop(NoBias, None)
        probe.forget_plans()


def test_auto_warns_where_a_users_rule_is_wrong_and_computes_it_another_way(monkeypatch):
    # 'auto' rerouted a parameter whose user rule disagreed with the loop without a word, so
    # the rule's bug (here b left out of its dict) went unseen, and every call ran slower
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())

    class NoBias2(_Affine):
        pass

    model, x, y = _registered_without_bias(NoBias2)
    try:
        with pytest.warns(tv.TorchVJPWarning, match=re.escape(
                "the per-sample rule you registered, '<lambda>' (registered for NoBias2), "
                "gives wrong per-sample gradients for '0.b': the rule result disagreed with "
                "the per-example loop") + "(.|\n)*" + re.escape(
                "Check the rule against strategy='loop': it must return every parameter")):
            got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="auto")
        ref = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="loop")
        for n, g in ref.items():
            torch.testing.assert_close(got[n], g)
    finally:
        registry._RULES.pop(NoBias2, None)
        probe.forget_plans()
