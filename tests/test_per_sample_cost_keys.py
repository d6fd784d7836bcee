"""The per-call keys a plan and a selection are reused under, where their reading was made
cheaper: what changes the result must still change the key (a reuse is exactly as right
as a new plan). Every result is compared with the per-example loop in float64."""

from __future__ import annotations

import torch
from torch import nn

import torch_vjp as tv


def _loop_norms(model, loss_fn, x, y, names=None):
    out = []
    for i in range(x.shape[0]):
        ps = [(n, p) for n, p in model.named_parameters()
              if (names is None and p.requires_grad) or (names is not None and n in names)]
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
        gs = torch.autograd.grad(loss, [p for _, p in ps], allow_unused=True)
        out.append(sum(float((g ** 2).sum()) for g in gs if g is not None) ** 0.5)
    return torch.tensor(out, dtype=torch.float64)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def _data(B=6):
    torch.manual_seed(1)
    return torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 3, (B,))


class _L2Loss(nn.Module):
    """A loss module that holds the parameter its L2 term reads (a plain attribute, not a
    submodule's), and plain settings beside it."""

    def __init__(self, w, c=0.5):
        super().__init__()
        self.__dict__["w"] = w  # (not registered: the model's own parameter)
        self.c = c
        self.reduction = "mean"

    def forward(self, out, y):
        return nn.functional.cross_entropy(out, y) + self.c * (self.w ** 2).sum()


def test_a_loss_module_that_holds_another_parameter_makes_a_new_plan():
    model, (x, y) = _mlp(), _data()
    loss = _L2Loss(model[0].weight)
    for _ in range(2):
        got = tv.per_sample_grad_norms(model, loss, x, y)
        torch.testing.assert_close(got, _loop_norms(model, loss, x, y))
    loss.__dict__["w"] = model[2].weight  # the term now reads the other layer's weight
    for _ in range(2):
        got = tv.per_sample_grad_norms(model, loss, x, y)
        torch.testing.assert_close(got, _loop_norms(model, loss, x, y))


def test_a_loss_module_with_a_function_in_its_dict_is_keyed_by_what_that_holds():
    # (``__func__`` in a loss module's own dict is read as a bound function's: the tensors
    # of its closure are part of the key)
    model, (x, y) = _mlp(), _data()

    def make(w):
        def term(out, t):
            return nn.functional.cross_entropy(out, t) + (w ** 2).sum()
        return term

    class Holder(nn.Module):
        def forward(self, out, t):
            return self.__dict__["__func__"](out, t)

    loss = Holder()
    loss.__dict__["__func__"] = make(model[0].weight)
    for _ in range(2):
        torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y),
                                   _loop_norms(model, loss, x, y))
    loss.__dict__["__func__"] = make(model[2].weight)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y),
                               _loop_norms(model, loss, x, y))


def test_a_parameter_frozen_then_thawed_changes_the_selection_each_time():
    model, (x, y) = _mlp(), _data()
    loss = nn.CrossEntropyLoss()
    tv.per_sample_grad_norms(model, loss, x, y)
    model[0].bias.requires_grad_(False)
    got = tv.per_sample_grad_norms(model, loss, x, y)
    torch.testing.assert_close(got, _loop_norms(model, loss, x, y))
    assert "0.bias" not in tv.per_sample_grads(model, loss, x, y)
    model[0].bias.requires_grad_(True)
    got = tv.per_sample_grad_norms(model, loss, x, y)
    torch.testing.assert_close(got, _loop_norms(model, loss, x, y))
    assert "0.bias" in tv.per_sample_grads(model, loss, x, y)


def test_a_parameter_replaced_by_a_new_one_is_the_one_computed():
    model, (x, y) = _mlp(), _data()
    loss = nn.CrossEntropyLoss()
    tv.per_sample_grad_norms(model, loss, x, y)
    torch.manual_seed(5)
    model[2].weight = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    got = tv.per_sample_grad_norms(model, loss, x, y)
    torch.testing.assert_close(got, _loop_norms(model, loss, x, y))
    before = model[2].weight.grad
    tv.accumulate_clipped_grads(model, loss, x, y, max_norm=1e9)
    ref = torch.autograd.grad(loss(model(x), y) * x.shape[0], model[2].weight)[0]
    assert before is None
    torch.testing.assert_close(model[2].weight.grad, ref)


def test_a_tied_parameter_is_selected_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model[2].weight = model[0].weight
    torch.manual_seed(1)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    loss = nn.CrossEntropyLoss()
    for _ in range(2):
        got = tv.per_sample_grad_norms(model, loss, x, y)
        torch.testing.assert_close(got, _loop_norms(model, loss, x, y))


def test_a_convolution_whose_taps_change_after_planning_stays_right():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(21, 2)).double()
    x = torch.randn(4, 2, 9, dtype=torch.float64)
    y = torch.randint(0, 2, (4,))
    loss = nn.CrossEntropyLoss()
    for _ in range(2):
        torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y),
                                   _loop_norms(model, loss, x, y))
    # (the same output length, 9 + 2 - 2 * 2 = 7, from other taps)
    model[0].padding, model[0].dilation = (1,), (2,)
    for _ in range(2):
        torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y),
                                   _loop_norms(model, loss, x, y))
    model[0].padding, model[0].dilation = (0,), (1,)
    torch.testing.assert_close(tv.per_sample_grad_norms(model, loss, x, y),
                               _loop_norms(model, loss, x, y))


def test_settings_changed_sees_every_plain_setting_and_a_layer_gone():
    from torch_vjp._per_sample.registry import settings_changed, settings_of

    layers = [nn.Embedding(10, 3, padding_idx=2), nn.Linear(3, 3)]
    settings = settings_of(layers)
    assert not settings_changed(settings)
    layers[0].padding_idx = 3  # (an int whose truth is unchanged)
    assert settings_changed(settings)
    layers[0].padding_idx = 2
    layers[1].note = "x"  # (a new plain attribute)
    assert settings_changed(settings)
    del layers[1].note
    layers[1].training = False  # (the training flag is the structure's, not a setting)
    layers[1]._private = 1
    assert not settings_changed(settings)
    del layers[1]
    import gc
    gc.collect()
    assert settings_changed(settings)


def test_the_structures_inlined_flags_agree_with_flag_of():
    # (structure_of reads torch modules' settings with flag_of's rule written out)
    from torch_vjp._engine.context import flag_of
    from torch_vjp._per_sample import structure

    for v in (True, False, 0, 3, 0.0, 2.5, "x", "", None, (1,), [1], 1j, object()):
        f = flag_of(v)
        inlined = (v if type(v) in structure._FLAGS else bool(v)) if (
            type(v) in structure._FLAGS or type(v) in structure._NUMBERS_FLAGGED
        ) else NotImplemented
        assert (f is NotImplemented) == (inlined is NotImplemented), v
        if f is not NotImplemented:
            assert f == inlined and type(f) is type(inlined), v


def test_a_torch_layers_setting_and_a_frozen_parameter_are_in_the_structure():
    from torch_vjp._per_sample.structure import structure_of

    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0), nn.Linear(3, 2))
    flags: list = []
    before = structure_of(model, flags)
    assert flags == [(id(p), p.requires_grad) for p in model.parameters()]
    model[1].p = 0.5  # (a dropout raised from zero)
    assert structure_of(model) != before
    model[1].p = 0.0
    assert structure_of(model) == before
    model[2].bias.requires_grad_(False)
    frozen: list = []
    after = structure_of(model, frozen)
    assert after != before
    assert frozen == [(id(p), p.requires_grad) for p in model.parameters()]
    model[0].forward = lambda x: x  # (a replaced forward takes the rule away)
    assert structure_of(model) != after
