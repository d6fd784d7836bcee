"""compile=True for the per-sample functions (torch_vjp/_per_sample/compiled.py): float64
against a per-example loop, compiled once per model and batch signature, an optimizer's
in-place updates seen without recompiling, models held wrapped in torch.compile."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import torch_vjp as tv

D = torch.float64


pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3)).double()


def _loop(model, loss_fn, x, y):
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(x)):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]),
                                 list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), gs):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.usefixtures("inductor")
def test_grads_norms_and_clipped_step_against_the_loop_compiled_once():
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(8, 2, 6, 6, dtype=D), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # nothing falls back
        for _ in range(3):
            ref = _loop(model, loss_fn, x, y)
            torch.testing.assert_close(tv.per_sample_grads(model, loss_fn, x, y, compile=True),
                                       ref)
            norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
            torch.testing.assert_close(
                tv.per_sample_grad_norms(model, loss_fn, x, y, compile=True), norms)
            model.zero_grad(set_to_none=True)
            got = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=0.5, compile=True)
            torch.testing.assert_close(got, norms)
            factors = (0.5 / norms).clamp(max=1.0)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", factors, ref[n]))
            with torch.no_grad():  # an optimizer step, in place: seen without recompiling
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
    assert counters["stats"]["unique_graphs"] == 3  # one program per function, reused


def test_a_model_held_in_torch_compile():
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 2, 6, 6, dtype=D), torch.randint(0, 3, (5,))
    held = torch.compile(model)
    for _ in range(2):
        got = tv.per_sample_grads(held, loss_fn, x, y, compile=True)
        ref = _loop(model, loss_fn, x, y)
        torch.testing.assert_close(got, {"_orig_mod." + n: g for n, g in ref.items()})


def test_empty_batch_and_option_error():
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(0, 2, 6, 6, dtype=D), torch.randint(0, 3, (0,))
    assert tv.per_sample_grads(model, loss_fn, x, y, compile=True)["3.bias"].shape == (0, 3)
    assert tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=1.0,
                                       compile=True).shape == (0,)
    with pytest.raises(tv.PerSampleValueError, match=r"compile=1, but it must be True or "
                       r"False"):
        tv.per_sample_grad_norms(model, loss_fn, x, y, compile=1)


def test_spectral_norm_vectors_are_left_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 5)), nn.Tanh(),
                          nn.Linear(5, 2)).double().train()
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(6, 4, dtype=D), torch.randint(0, 2, (6,))
    before = {n: b.clone() for n, b in model.named_buffers()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)  # it may stay eager: that is said
        got = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
        got = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    torch.testing.assert_close(got, tv.per_sample_grads(model, loss_fn, x, y, strategy="loop"))


class _GrowsInForward(nn.Module):
    """Changes its own parameter in place on every forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.s = nn.Parameter(torch.ones(2))

    def forward(self, x):
        with torch.no_grad():
            self.s.mul_(1.5)
        return self.lin(x) * self.s


@pytest.mark.parametrize("strategy", ["auto", "vmap", "loop"])
def test_a_forward_changing_a_parameter_in_place_stays_eager_and_leaves_it(strategy):
    # the eager path puts such a parameter back on every call; a compiled program cannot,
    # so the signature stays eager (it changed the parameter for good, and later results
    # were computed from the changed one)
    torch.manual_seed(0)
    model = _GrowsInForward().to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    before = model.s.clone()
    ref = tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="loop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tv.JacobianWarning)
        for _ in range(3):
            got = tv.per_sample_grads(model, nn.MSELoss(), x, y, strategy=strategy,
                                      compile=True)
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], msg=n)
            assert torch.equal(model.s, before)
    assert sum("changes a parameter in place" in str(w.message) for w in caught) == 1


def test_a_gradient_hook_on_a_parameter_is_applied_to_each_example():
    # NOTE [gradient hooks on a parameter]: the compiled program differentiates stand-ins,
    # which never pass through the parameter's hook; the job runs eagerly, hook applied
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(0, 3, (6,))
    for _ in range(2):
        tv.per_sample_grads(model, loss_fn, x, y, compile=True)
    model[3].weight.register_hook(lambda g: g * 0)
    for _ in range(2):
        got = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
        assert got["3.weight"].abs().max() == 0
        torch.testing.assert_close(got, _loop(model, loss_fn, x, y))


def test_the_compiled_program_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    alive = weakref.ref(model)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss = nn.CrossEntropyLoss()
    ref = tv.per_sample_grads(model, loss, x, y)
    for _ in range(2):
        got = tv.per_sample_grads(model, loss, x, y, compile=True)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
    del model, got, ref
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("name", ["per_sample_grads", "per_sample_grad_norms",
                                  "accumulate_clipped_grads"])
def test_inside_users_torch_compile_against_the_loop(name):
    # (the plain vmap-of-grad program, traced by the user's compile; no eager call first)
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(0, 3, (6,))
    ref = _loop(model, loss_fn, x, y)
    ref_norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    if name == "per_sample_grads":
        got = torch.compile(lambda x, y: tv.per_sample_grads(model, loss_fn, x, y))(x, y)
        assert list(got) == list(ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
    elif name == "per_sample_grad_norms":
        got = torch.compile(lambda x, y: tv.per_sample_grad_norms(model, loss_fn, x, y))(x, y)
        torch.testing.assert_close(got, ref_norms)
    else:
        got = torch.compile(lambda x, y: tv.accumulate_clipped_grads(
            model, loss_fn, x, y, max_norm=0.5))(x, y)
        torch.testing.assert_close(got, ref_norms)
        c = (0.5 / ref_norms).clamp(max=1.0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, ref[n]))


@pytest.mark.parametrize("name", ["per_sample_grads", "per_sample_grad_norms",
                                  "accumulate_clipped_grads"])
def test_inside_users_torch_compile_fullgraph_no_graph_break(name):
    # (the inference-mode check of the arguments asked torch.is_inference_mode_enabled(),
    # which dynamo cannot trace: a graph break, and with fullgraph=True an Unsupported error)
    torch.manual_seed(0)
    model, loss_fn = nn.Linear(4, 3).double(), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 3, (5,))
    ref = _loop(model, loss_fn, x, y)
    ref_norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    if name == "accumulate_clipped_grads":
        run = lambda x, y: tv.accumulate_clipped_grads(model, loss_fn, x, y,  # noqa: E731
                                                       max_norm=1e9)
    else:
        run = lambda x, y: getattr(tv, name)(model, loss_fn, x, y)  # noqa: E731
    got = torch.compile(run, fullgraph=True, backend="eager")(x, y)
    assert sum(counters["graph_break"].values()) == 0
    if name == "per_sample_grads":
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
    else:
        torch.testing.assert_close(got, ref_norms)


class _OwnNet(nn.Module):  # (a model class of the user's own, with its own forward)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).tanh()


def test_inside_users_torch_compile_after_an_eager_call_of_an_own_model_class():
    # The eager call leaves caches keyed by the forward's code object; the traced call made
    # dynamo fail on a guard over them (InternalTorchDynamoError).
    model, loss_fn = _OwnNet().double(), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 3, (5,))
    eager = tv.per_sample_grads(model, loss_fn, x, y)
    got = torch.compile(lambda x, y: tv.per_sample_grads(model, loss_fn, x, y),
                        backend="eager")(x, y)
    ref = _loop(model, loss_fn, x, y)
    assert list(got) == list(ref) == list(eager)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n])


class _Trainer:  # (its loss a method: ``self.loss`` is a new bound method on each access)
    def __init__(self):
        self.smoothing = 0.1

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y, label_smoothing=self.smoothing)


@pytest.mark.parametrize("loss", ["module_per_step", "lambda_over_weights", "bound_method"])
def test_a_loss_made_for_each_batch_reuses_one_program(loss):
    import torch.nn.functional as F

    model, trainer = _model(), _Trainer()
    for _ in range(3):
        x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(0, 3, (6,))
        if loss == "module_per_step":
            loss_fn = nn.CrossEntropyLoss()
        else:  # (per-batch class weights, a new tensor of one signature each step)
            w = torch.bincount(y, minlength=3).to(D).clamp(min=1).reciprocal()
            loss_fn = lambda o, t: F.cross_entropy(o, t, weight=w)  # noqa: E731
        if loss == "bound_method":  # (by its own id: a new program on every call)
            loss_fn = trainer.loss
        got = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
        ref = _loop(model, loss_fn, x, y)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n])
    assert counters["stats"]["unique_graphs"] == 1


def test_a_loss_over_new_objects_each_batch_is_warned_once_with_the_fix():
    import types

    import torch.nn.functional as F

    from torch_vjp._engine.compiled import REBUILD_WARN_AT

    model = nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=D), torch.tensor([0, 1, 1, 0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(REBUILD_WARN_AT + 1):
            opts = types.SimpleNamespace(reduction="sum")  # a new object: by identity
            loss_fn = lambda o, t: F.cross_entropy(o, t, reduction=opts.reduction)  # noqa: E731
            got = tv.per_sample_grad_norms(model, loss_fn, x, y, compile=True)
            torch.testing.assert_close(got, tv.per_sample_grad_norms(model, loss_fn, x, y))
    msgs = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert len(msgs) == 1, msgs
    assert ("torch_vjp.per_sample_grad_norms: compile=True has compiled the loss function "
            "of Linear") in msgs[0]
    assert "each call passed a new function whose closure" in msgs[0]
    assert "Fix: define the loss function once, outside the loop" in msgs[0]


class _ScaledLoss(nn.Module):  # (a loss whose state is a private attribute)
    def __init__(self, s):
        super().__init__()
        self._s = s

    def forward(self, out, y):
        return nn.functional.cross_entropy(out * self._s, y)


def test_two_losses_that_differ_in_a_private_attribute_each_keep_their_program():
    # (a parameterless loss module was keyed by its public attributes only: two instances
    # that differ in self._s shared an entry, dynamo's guard on _s recompiled it on every
    # call that alternated them, and the eighth such call left it eager, blaming a global)
    from torch_vjp._engine.compiled import builds

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 3, (5,))
    losses = (_ScaledLoss(1.0), _ScaledLoss(3.0))
    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for k in range(4):
            loss_fn = losses[k % 2]
            got = tv.per_sample_grads(model, loss_fn, x, y, compile=True)
            for n, g in _loop(model, loss_fn, x, y).items():
                torch.testing.assert_close(got[n], g)
    assert builds() - before == 2


def test_a_clipping_bound_that_changes_each_step_reuses_the_compiled_program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(8, 4, dtype=D), torch.randint(0, 3, (8,))
    ref = _loop(model, loss_fn, x, y)
    norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # nothing falls back
        for max_norm in (0.3, 0.45, float(norms.median()), 10.0):
            model.zero_grad(set_to_none=True)
            got = tv.accumulate_clipped_grads(model, loss_fn, x, y, max_norm=max_norm,
                                              compile=True)
            torch.testing.assert_close(got, norms)
            factors = (max_norm / norms).clamp(max=1.0)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad,
                                           torch.einsum("b,b...->...", factors, ref[n]))
    assert counters["stats"]["unique_graphs"] == 1  # (not one program per bound)


def test_a_loss_that_reads_a_parameter_through_the_model_compiles():
    # (the program called the loss after functional_call had put the parameters back: an L2
    # term on model[0].weight read the parameter, not the tensor differentiated, the
    # first-call check found the compiled result off, and the signature ran eagerly with a
    # warning that it could not compile)
    from torch_vjp._engine.compiled import builds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=D), torch.randint(0, 3, (6,))
    ce = nn.CrossEntropyLoss()

    def loss_fn(o, t):
        return ce(o, t) + 0.5 * model[0].weight.pow(2).sum()

    ref = _loop(model, loss_fn, x, y)
    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            torch.testing.assert_close(tv.per_sample_grads(model, loss_fn, x, y, compile=True),
                                       ref)
    assert builds() - before == 1


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, mask=None):
        h = self.lin(x)
        return h if mask is None else h * mask


def test_an_input_none_compiles_and_is_passed_as_it_is():
    # (the compiled program unsqueezed every input: model(x, None) ran eagerly, with a
    # warning that it could not compile)
    from torch_vjp._engine.compiled import builds

    torch.manual_seed(0)
    model, ce = _Masked().double(), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=D), torch.randint(0, 3, (5,))
    ref = _loop(model, ce, x, y)
    before = builds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for _ in range(2):
            torch.testing.assert_close(
                tv.per_sample_grads(model, ce, (x, None), y, compile=True), ref)
    assert builds() - before == 1


def test_inside_users_torch_compile_dynamo_warns_of_nothing_of_ours(monkeypatch):
    # dynamo warned, once per process, of an lru_cache of the package's that it traced
    # through ("Silent incorrectness is only a *potential* risk"): the user's compile of a
    # training step showed it
    said = []
    monkeypatch.setattr(torch._dynamo.utils, "warn_once", lambda msg, *a, **k: said.append(msg))
    torch._dynamo.reset()
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    x, y = torch.randn(6, 2, 6, 6, dtype=D), torch.randint(0, 3, (6,))
    got = torch.compile(lambda x, y: tv.per_sample_grad_norms(model, loss_fn, x, y),
                        backend="eager")(x, y)
    ref = _loop(model, loss_fn, x, y)
    torch.testing.assert_close(got, torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1))
    assert [m for m in said if "torch_vjp" in m] == []
