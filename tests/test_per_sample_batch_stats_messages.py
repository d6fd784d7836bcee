"""Models that normalise with the statistics of the whole batch: a BatchNorm without running
statistics (``track_running_stats=False``, batch statistics in eval mode too), functional
``F.batch_norm(training=True)`` and ``h - h.mean(0)``. With more than one example each is
refused under 'auto' and 'hooks', naming where, and the message's fix never suggests eval
mode, which changes nothing for them; with one example there is nothing to mix, and a model
that computes its statistics within the example is computed, against autograd in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_vjp as tv

D = torch.float64


class _Functional(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.conv, self.fc, self.how = nn.Conv1d(2, 3, 3, padding=1), nn.Linear(15, 2), how

    def forward(self, x):
        return self.fc(torch.tanh(self.how(self.conv(x))).flatten(1))


def _batch_norm(h):
    return F.batch_norm(h, None, None, training=True)


def _centred(h):
    return h - h.mean(0)


def _no_stats():
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3, track_running_stats=False),
                         nn.Tanh(), nn.Flatten(), nn.Linear(15, 2))


def _data(b):
    torch.manual_seed(0)
    return torch.randn(b, 2, 5, dtype=D), torch.randint(0, 2, (b,))


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("how", [_batch_norm, _centred], ids=["batch_norm", "centred"])
def test_statistics_of_the_batch_in_the_forward(how, mode, strategy):
    torch.manual_seed(0)
    model = getattr(_Functional(how).to(D), mode)()
    x, t = _data(3)
    with pytest.raises(tv.PerSampleError) as info:
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    msg = str(info.value)
    assert "the model's own forward (_Functional) mixes examples" in msg
    assert "Fix: make the forward treat each example on its own" in msg
    assert "eval" not in msg
    # (one example: its statistics are its own, over the length)
    x, t = _data(1)
    got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    want = torch.autograd.grad(F.cross_entropy(model(x), t), list(model.parameters()))
    for (n, _), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(got[n][0], w, msg=n)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_batch_norm_without_running_statistics_in_eval_mode(strategy):
    model = _no_stats().to(D).eval()
    x, t = _data(3)
    with pytest.raises(tv.PerSampleError) as info:
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    msg = str(info.value)
    assert "module '1' (BatchNorm1d) has no running statistics (track_running_stats=False)" in msg
    assert "in training and in eval mode alike" in msg
    assert "Fix: replace it with nn.GroupNorm(num_groups, 3)" in msg
    assert "put it in eval mode" not in msg


def test_a_batch_norm_without_running_statistics_in_training_mode():
    model = _no_stats().to(D).train()
    x, t = _data(3)
    with pytest.raises(tv.PerSampleError) as info:
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t)
    msg = str(info.value)
    assert "module '1' (BatchNorm1d)" in msg
    assert "put it in eval mode" not in msg


def _with_stats():
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.BatchNorm1d(3), nn.Tanh(),
                         nn.Flatten(), nn.Linear(15, 2))


@pytest.mark.parametrize("strategy", ["auto", "hooks", "vmap", "loop"])
@pytest.mark.parametrize("build,mode", [(_no_stats, "eval"), (_no_stats, "train"),
                                        (_with_stats, "train")],
                         ids=["no_stats-eval", "no_stats-train", "running_stats-train"])
def test_a_batch_norm_of_the_batch_statistics_on_one_example(build, mode, strategy):
    """One example: the batch's statistics are the example's own, so its gradient is the
    batch's; computed under every strategy, the running statistics left as they were, and a
    later call on three examples still refused (the answer at B = 1 is not kept for it)."""
    torch.manual_seed(0)
    model = getattr(build().to(D), mode)()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, t = _data(1)
    if strategy == "vmap" and build is _with_stats:
        # (vmap cannot run the running statistics' in-place update: refused, naming it)
        with pytest.raises(tv.StrategyError, match=r"(?s)module '1' \(BatchNorm1d\).*"
                           r"in-place updates of buffers.*strategy='loop'"):
            tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
        return
    got = tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    norms = tv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    ref = getattr(build().to(D), mode)()
    ref.load_state_dict(state)
    want = torch.autograd.grad(F.cross_entropy(ref(x), t), list(ref.parameters()))
    for (n, _), w in zip(model.named_parameters(), want):
        torch.testing.assert_close(got[n][0], w, msg=n)
    torch.testing.assert_close(norms[0], torch.sqrt(sum(w.pow(2).sum() for w in want)))
    x, t = _data(3)
    with pytest.raises(tv.PerSampleError, match=r"module '1' \(BatchNorm1d\)"):
        tv.per_sample_grads(model, nn.CrossEntropyLoss(), x, t, strategy=strategy)
