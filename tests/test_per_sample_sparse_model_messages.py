"""Refusal messages of per-sample strategies on layer configurations that are the whole
model: the message names the layer, never an empty module path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_vjp as tv

D = torch.float64


def _loss(out):
    return out.pow(2).sum()


@pytest.mark.parametrize("kind", ["bag", "embedding"])
def test_sparse_layer_as_the_whole_model_is_named(kind):
    """vmap refuses a sparse layer; when that layer is the model itself the message says so
    (it used to read "in module ''")."""
    torch.manual_seed(0)
    layer = (nn.EmbeddingBag(6, 3, mode="sum", sparse=True) if kind == "bag"
             else nn.Embedding(6, 3, sparse=True)).to(D)
    idx = torch.randint(0, 6, (3, 4))
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(layer, _loss, idx, strategy="vmap")
    msg = str(info.value)
    assert "module ''" not in msg, msg
    assert f"the model itself ({type(layer).__name__} with sparse=True" in msg, msg
    assert "strategy='loop'" in msg and "strategy='auto'" in msg, msg
    # the alternatives it names work and agree with each other
    got = tv.per_sample_grads(layer, _loss, idx, strategy="auto")["weight"]
    ref = torch.stack([torch.autograd.grad(_loss(layer(idx[i:i + 1])), layer.weight)[0]
                       .to_dense() for i in range(3)])
    torch.testing.assert_close(got, ref)


def test_sparse_layer_inside_a_model_keeps_its_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3, sparse=True), nn.Linear(3, 2)).to(D)
    with pytest.raises(tv.StrategyError) as info:
        tv.per_sample_grads(model, _loss, torch.randint(0, 6, (3, 4)), strategy="vmap")
    assert "module '0' (Embedding with sparse=True" in str(info.value), str(info.value)
