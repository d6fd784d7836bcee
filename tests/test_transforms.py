"""VJP and JVP, single and batched (SPEC §4): results against torch.func and against a loop
of single products, in float64; cotangents and tangents checked with grad's messages."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_vjp as tv
from torch_vjp._errors import JacobianCallError, JacobianOptionError
from torch_vjp.transforms import jvp, vjp

D = torch.float64


def assert_tree_close(got, want):
    got_flat, got_spec = tree_flatten(got)
    want_flat, want_spec = tree_flatten(want)
    assert got_spec == want_spec, f"structure {got_spec} != {want_spec}"
    for g, w in zip(got_flat, want_flat):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def _stack(trees):
    flat = [tree_flatten(t) for t in trees]
    spec = flat[0][1]
    leaves = [torch.stack([f[0][i] for f in flat]) for i in range(len(flat[0][0]))]
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, spec)


W = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))

CASES = {
    "matrix": lambda: (lambda x: torch.tanh(W @ x), (torch.randn(4, dtype=D),)),
    "scalar-output": lambda: (lambda x: (x.sin() * x).sum(), (torch.randn(4, dtype=D),)),
    "tuple-output": lambda: (lambda x: (x.sin(), torch.outer(x, x)), (torch.randn(3, dtype=D),)),
    "dict-output-two-primals": lambda: (
        lambda x, y: {"p": x * y, "s": (x.exp() @ y).reshape(1)},
        (torch.randn(3, dtype=D), torch.randn(3, dtype=D)),
    ),
    "matrix-primal": lambda: (lambda A: A @ A.T, (torch.randn(2, 3, dtype=D),)),
}


def _random_like(tree, k=None):
    lead = (k,) if k else ()
    return tree_map(lambda t: torch.randn(lead + tuple(t.shape), dtype=t.dtype), tree)


@pytest.mark.parametrize("case", CASES)
def test_vjp_matches_torch_func(case):
    f, primals = CASES[case]()
    out, vjp_fn = vjp(f, *primals)
    ref_out, ref_fn = torch.func.vjp(f, *primals)
    assert_tree_close(out, ref_out)
    cot = _random_like(out)
    assert_tree_close(vjp_fn(cot), ref_fn(cot))


@pytest.mark.parametrize("chunk_size", (None, 1, 2, 3, 7, 1000))
@pytest.mark.parametrize("case", CASES)
def test_batched_vjp_matches_a_loop(case, chunk_size):
    f, primals = CASES[case]()
    out, vjp_fn = vjp(f, *primals)
    cots = _random_like(out, k=5)
    got = vjp_fn(cots, batched=True, chunk_size=chunk_size)
    loop = [vjp_fn(tree_map(lambda c: c[k], cots)) for k in range(5)]
    assert_tree_close(got, _stack(loop))
    assert all(g.shape[0] == 5 for g in tree_flatten(got)[0])


@pytest.mark.parametrize("case", CASES)
def test_jvp_matches_torch_func(case):
    f, primals = CASES[case]()
    tangents = _random_like(primals)
    assert_tree_close(jvp(f, primals, tangents), torch.func.jvp(f, primals, tangents))


@pytest.mark.parametrize("chunk_size", (None, 1, 2, 3, 7, 1000))
@pytest.mark.parametrize("case", CASES)
def test_batched_jvp_matches_a_loop(case, chunk_size):
    f, primals = CASES[case]()
    tangents = _random_like(primals, k=4)
    out, got = jvp(f, primals, tangents, batched=True, chunk_size=chunk_size)
    assert_tree_close(out, f(*primals))
    loop = [jvp(f, primals, tree_map(lambda t: t[k], tangents))[1] for k in range(4)]
    assert_tree_close(got, _stack(loop))


def test_batched_products_give_the_jacobian():
    x = torch.randn(4, dtype=D)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    J = torch.func.jacrev(f)(x)
    _, vjp_fn = vjp(f, x)
    torch.testing.assert_close(vjp_fn(torch.eye(3, dtype=D), batched=True)[0], J)
    _, cols = jvp(f, (x,), (torch.eye(4, dtype=D),), batched=True)
    torch.testing.assert_close(cols, J.T)


def test_has_aux():
    x = torch.randn(3, dtype=D)
    f = lambda x: (x.sin(), {"c": x.cos()})  # noqa: E731
    out, vjp_fn, aux = vjp(f, x, has_aux=True)
    torch.testing.assert_close(aux["c"], x.cos())
    (g,) = vjp_fn(torch.eye(3, dtype=D), batched=True)
    torch.testing.assert_close(g, torch.diag(x.cos()))
    out, t, aux = jvp(f, (x,), (torch.eye(3, dtype=D),), batched=True, has_aux=True)
    torch.testing.assert_close(t, torch.diag(x.cos()))
    torch.testing.assert_close(aux["c"], x.cos())
    out, t, aux = jvp(f, (x,), (torch.ones(3, dtype=D),), has_aux=True)
    torch.testing.assert_close(t, x.cos())


def test_vjp_fn_can_be_called_many_times_and_nothing_is_mutated():
    x = torch.randn(3, dtype=D, requires_grad=True)
    out, vjp_fn = vjp(lambda x: x.exp(), x)
    for _ in range(3):
        torch.testing.assert_close(vjp_fn(torch.ones(3, dtype=D))[0], x.detach().exp())
    assert x.requires_grad and x.grad is None


@pytest.mark.parametrize("primal", [
    torch.randn(1, 3, dtype=D).expand(2, 3),
    torch.tensor(0.5, dtype=D).expand(4),
    torch.randn(4, dtype=D).as_strided((3, 2), (1, 1)),
], ids=["expanded", "expanded-0-dim", "overlapping-as-strided"])
def test_jvp_at_a_primal_whose_elements_share_memory(primal):
    # torch.func.jvp's make_dual raised "more than one element of the written-to tensor
    # refers to a single memory location" (NOTE [an expanded primal])
    before = primal.clone()
    t = torch.randn(primal.shape, dtype=D)
    out, jt = jvp(lambda x: x.sin() * x, (primal,), (t,))
    ref = torch.func.jvp(lambda x: x.sin() * x, (primal.contiguous(),), (t,))
    torch.testing.assert_close((out, jt), ref)
    assert torch.equal(primal, before)
    x = torch.randn(1, 3, dtype=D, requires_grad=True)
    out, _ = jvp(lambda y: y.sin(), (x.expand(2, 3),), (torch.ones(2, 3, dtype=D),))
    (g,) = torch.autograd.grad(out.sum(), x)  # the primal's history is kept
    torch.testing.assert_close(g, 2 * x.detach().cos())


def test_jvp_at_an_expanded_primal_leaves_the_callers_tangent():
    # NOTE [an expanded primal]: the dense copy of the primal was paired with the caller's
    # tangent itself (strides alike), so an f writing into its input doubled that tangent
    t = torch.ones(4, dtype=D)
    out, jt = jvp(lambda a: a.mul_(2).sin(), (torch.ones(1, dtype=D).expand(4),), (t,))
    assert torch.equal(t, torch.ones(4, dtype=D))
    torch.testing.assert_close(jt, 2 * torch.cos(torch.full((4,), 2.0, dtype=D)))


def test_jvp_at_a_strided_primal_is_torch_funcs():
    # NOTE [an expanded primal]: a strided primal whose elements do not share memory
    # (x[::2]; torch's overlap check answers "too hard") was copied as an overlapping one:
    # an f writing into its input then wrote into the caller's tangent, not its primal,
    # the reverse of torch.func.jvp (and a copy per call)
    def f(a):
        return a.mul_(2).sin()

    base, t = torch.randn(8, dtype=D), torch.randn(4, dtype=D)
    base2, t2 = base.clone(), t.clone()
    out, jt = jvp(f, (base[::2],), (t,))
    ref_out, ref_jt = torch.func.jvp(f, (base2[::2],), (t2,))
    torch.testing.assert_close((out, jt), (ref_out, ref_jt))
    torch.testing.assert_close((base, t), (base2, t2))


@pytest.mark.parametrize("call", [
    lambda f, x: vjp(f, x),
    lambda f, x: jvp(f, (x,), (x,)),
    lambda f, x: jvp(f, (x,), (x[None],), batched=True),
], ids=["vjp", "jvp", "jvp-batched"])
def test_plain_autograd_inside_f_is_explained(call):
    # torch.func's raw "backward() called inside a functorch transform" passed through
    def f(x):
        w = torch.ones(3, dtype=D, requires_grad=True)
        (w * 2).sum().backward()
        return x.sin()

    with pytest.raises(JacobianCallError, match=r"(?s)f runs plain autograd itself "
                       r"\(\.backward\(\).*torch.func said: RuntimeError: backward\(\) called "
                       r"inside a functorch transform.*Fix: differentiate with plain autograd"):
        call(f, torch.randn(3, dtype=D))


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("expanded", [False, True], ids=["tangents", "expanded-tangents"])
def test_batched_jvp_of_an_f_that_writes_into_its_input_leaves_the_tangents(expanded,
                                                                            chunk_size):
    # forward AD writes f's in-place x.mul_(2) into the tangent too: the caller's tangents
    # came back doubled, and an expanded one broke vmap (a warning and the loop) and had
    # the loop's writes compound in its shared memory: every product wrong
    def f(x):
        x.mul_(2)
        return x.sin()

    x = torch.randn(3, dtype=D)
    T = torch.randn(1, 3, dtype=D).expand(4, 3) if expanded else torch.randn(4, 3, dtype=D)
    x0, T0 = x.clone(), T.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        out, jt = jvp(f, (x,), (T,), batched=True, chunk_size=chunk_size)
    torch.testing.assert_close(jt, 2 * torch.cos(2 * x0) * T0)
    torch.testing.assert_close(out, torch.sin(2 * x0))
    assert torch.equal(T, T0) and torch.equal(x, x0)


def test_zero_products():
    x = torch.randn(3, dtype=D)
    _, vjp_fn = vjp(lambda x: x * 2, x)
    assert vjp_fn(torch.zeros(0, 3, dtype=D), batched=True)[0].shape == (0, 3)
    _, t = jvp(lambda x: x.sum(), (x,), (torch.zeros(0, 3, dtype=D),), batched=True)
    assert t.shape == (0,)


# --------------------------------------------------------------------------------------
# Cotangents and tangents: the one checker, its messages
# --------------------------------------------------------------------------------------


def _vjp_fn():
    x = torch.randn(4, dtype=D)
    return vjp(lambda x: torch.tanh(W @ x), x)[1]


def test_wrong_cotangent_shape():
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.vjp: vjp_fn: cotangents has shape (4,), but out has shape (3,).\n"
        "  cotangents is dL/d out: one number per element of out, so it must have shape (3,)."
    )):
        _vjp_fn()(torch.ones(4, dtype=D))


def test_cotangent_with_a_batch_dimension_but_batched_false():
    with pytest.raises(tv.GradOutputsError, match=r"cotangents has an extra leading dimension "
                       r"of size 5"):
        _vjp_fn()(torch.ones(5, 3, dtype=D))


def test_batched_cotangent_without_batch_dimension():
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.vjp: vjp_fn: cotangents has shape (3,), but out has shape (3,) and "
        "batched=True."
    )) as info:
        _vjp_fn()(torch.ones(3, dtype=D), batched=True)
    assert "cotangents has no batch dimension" in str(info.value)
    assert "is_grads_batched" not in str(info.value)


def test_batched_cotangents_with_different_k():
    x = torch.randn(3, dtype=D)
    _, vjp_fn = vjp(lambda x: (x.sin(), x.sum()), x)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.vjp: vjp_fn: with batched=True the cotangents have different "
        "batch sizes (cotangents[0]: 4, cotangents[1]: 5)."
    )):
        vjp_fn((torch.ones(4, 3, dtype=D), torch.ones(5, dtype=D)), batched=True)


def test_cotangent_structure():
    with pytest.raises(tv.GradOutputsError, match=r"torch_vjp.vjp: vjp_fn: cotangents must have "
                       r"the same structure as the function's output.*\n  expected: Tensor\(3,\)"
                       r"\n  got:      \(Tensor\(3,\),\)"):
        _vjp_fn()((torch.ones(3, dtype=D),))


def test_tangent_structure_names_the_primals():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=r"torch_vjp.jvp: tangents must have the same "
                       r"structure as the primals"):
        jvp(lambda x: W @ x, (x,), [torch.ones(4, dtype=D)])


@pytest.mark.parametrize("call, fix", [
    (lambda x: jvp(torch.sin, (x,), torch.ones(4, dtype=D)),
     "Fix: like the primals, tangents must be a tuple of one tensor: pass (tangents,)."),
    (lambda x: jvp(torch.sin, (x,), [torch.ones(4, dtype=D)]),
     "Fix: like the primals, tangents must be a tuple, not a list: pass tuple(tangents)."),
    (lambda x: vjp(torch.sin, x)[1]((torch.ones(4, dtype=D),)),
     "Fix: like the function's output, cotangents must be a single tensor, not a tuple: "
     "pass cotangents[0]."),
], ids=["bare-tangent", "list-of-tangents", "tuple-of-one-cotangent"])
def test_structure_mistakes_of_one_tensor_get_their_fix(call, fix):
    # a bare tangent for (x,), as torch.func.jvp's users write it, was told only to 'build it
    # from the primals itself, e.g. torch.utils._pytree.tree_map(torch.ones_like, ...)'
    with pytest.raises(tv.GradOutputsError) as info:
        call(torch.randn(4, dtype=D))
    assert str(info.value).endswith(fix)


def test_none_cotangent_stands_for_one_for_a_scalar_output():
    # as torch.func.vjp and torch.autograd.grad read it (vjp_fn(None) gave zeros, and a None
    # beside a vector dropped the scalar output's part)
    x = torch.randn(3, dtype=D)
    (g,) = vjp(lambda x: (x ** 2).sum(), x)[1](None)
    torch.testing.assert_close(g, 2 * x)
    f = lambda x: (2 * x, (x ** 2).sum())  # noqa: E731
    ones = torch.ones(3, dtype=D)
    (g,) = vjp(f, x)[1]((ones, None))
    torch.testing.assert_close(g, torch.func.vjp(f, x)[1]((ones, None))[0])
    torch.testing.assert_close(g, 2 + 2 * x)


def test_none_cotangent_is_refused_with_batched():
    # K stacked vectors have no None: it gave zeros for every product, silently
    x = torch.randn(3, dtype=D)
    vjp_fn = vjp(lambda x: (2 * x, (x ** 2).sum()), x)[1]
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.vjp: vjp_fn: cotangents[0] is None, but batched=True.\n  With batched=True "
        "every cotangents entry stacks K vectors dL/d output along a leading batch dimension; "
        "None stands for dL/d output = 1 only for a real scalar output, and outputs[0] has "
        "shape (3,). cotangents[0] must be a tensor of shape (2, 3). Fix: pass the 2 vectors, "
        "one per product, stacked: a tensor of shape (2, 3) (torch.ones_like(outputs[0])"
        ".expand(2, *outputs[0].shape) for the sum of outputs[0]'s elements in every "
        "product).")):
        vjp_fn((None, torch.ones(2, dtype=D)), batched=True)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "cotangents[1] is None, but batched=True.\n") + r".*for None torch would create a "
            r"single unbatched 1.* must be a tensor of shape \(2,\)\. Fix: pass "
            r"torch\.ones_like\(outputs\[1\]\)\.expand\(2, \*outputs\[1\]\.shape\)"):
        vjp_fn((torch.ones(2, 3, dtype=D), None), batched=True)


def test_none_tangent_is_refused():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=r"tangents\[1\] is None, but each entry of "
                       r"tangents must be a Tensor\.\n.*torch.zeros_like\(primals\[1\]\)"):
        jvp(lambda x, y: x * y, (x, x), (torch.ones(4, dtype=D), None))


def test_wrong_tangent_shape():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.jvp: tangents[0] has shape (3,), but primals[0] has shape (4,).\n"
        "  tangents[0] is a direction of change dx for primals[0]: one number per element of "
        "primals[0], so it must have shape (4,)."
    )):
        jvp(lambda x: W @ x, (x,), (torch.ones(3, dtype=D),))


def test_batched_tangents_of_different_k_name_jacobian_vector_products():
    # the message called the K tangents "vector-Jacobian products"
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.jvp: with batched=True the tangents have different batch sizes "
        "(tangents[0]: 2, tangents[1]: 3).\n"
        "  The leading dimension K is the number of Jacobian-vector products computed at "
        "once, so it must be the same for every entry of tangents."
    )):
        jvp(lambda x, y: x * y, (x, x), (torch.ones(2, 4, dtype=D), torch.ones(3, 4, dtype=D)),
            batched=True)


def test_a_structure_that_differs_only_in_its_container_type_shows_the_type():
    # a tuple for a namedtuple output was refused with "expected: (Tensor(3,), Tensor())"
    # and "got: (Tensor(3,), Tensor())", two lines that read the same
    import collections

    Pair = collections.namedtuple("Pair", "a b")
    x = torch.randn(3, dtype=D)
    _, vjp_fn = vjp(lambda x: Pair(x.sin(), x.sum()), x)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
            "  expected: Pair(a=Tensor(3,), b=Tensor())\n"
            "  got:      (Tensor(3,), Tensor())\n")) as info:
        vjp_fn((torch.ones(3, dtype=D), torch.ones((), dtype=D)))
    # (the fix rebuilds the namedtuple from the items: Pair(*tuple) — Pair(tuple) raised a
    # TypeError of its own while the message was being made)
    assert "pass Pair(*" in str(info.value)
    _, vjp_fn = vjp(lambda x: collections.OrderedDict(u=x.sin()), x)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
            "  expected: OrderedDict({'u': Tensor(3,)})\n  got:      {'u': Tensor(3,)}\n")):
        vjp_fn({"u": torch.ones(3, dtype=D)})
    # (the right containers are taken)
    torch.testing.assert_close(vjp_fn(collections.OrderedDict(u=torch.ones(3, dtype=D)))[0],
                               x.cos())


def test_a_tangent_shaped_like_the_output_is_named_so():
    # a vector for a vector-Jacobian product given to jvp (the confusion of the first user
    # thread): the message said only that the shape was wrong, or suggested batched=True
    # and jacobian_of (which needs a graph jvp does not leave)
    x = torch.randn(5, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.jvp: tangents[0] has shape (3,), but primals[0] has shape (5,).\n"
        "  tangents[0] is a direction of change dx for primals[0]: one number per element of "
        "primals[0], so it must have shape (5,).\n"
        "  If tangents[0] is shaped like f's output, it is a cotangent: a vector shaped like "
        "the output is for a vector-Jacobian product v^T J (torch_vjp.vjp(f, *primals)[1](v)); "
        "a tangent is a change of the input, shaped like primals[0], for J t. "
        "torch_vjp.jacobian(f, *primals) gives the whole Jacobian.")):
        jvp(lambda v: torch.ones(3, 5, dtype=D) @ v, (x,), (torch.ones(3, dtype=D),))
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "pass batched=True; torch_vjp.jacobian(f, *primals) computes the whole Jacobian.\n"
        "  If tangents[0] is shaped like f's output, it is a cotangent: ") + r".*for J t\.$"):
        jvp(lambda t: torch.outer(t, t), (torch.ones(4, dtype=D),), (torch.ones(4, 4, dtype=D),))


def test_a_refused_tangent_does_not_run_f():
    # the hint ran f once more on the error path (on copies, with the random state and the
    # buffers put back), but a tensor f captures and writes into still moved, and the
    # refused call had effects; the error also lost its explanation attribute once
    counter = torch.zeros((), dtype=D)

    def counts(x):
        counter.add_(1)
        x.mul_(2)
        return x[:2].clone()

    x = torch.ones(3, dtype=D)
    with pytest.raises(tv.GradOutputsError) as info:
        jvp(counts, (x,), (torch.ones(2, dtype=D),))
    assert torch.equal(x, torch.ones(3, dtype=D)) and counter.item() == 0
    assert "If tangents[0] is shaped like f's output" in info.value.explanation


def test_batched_jvp_of_a_random_function_calls_it_once():
    # it was refused ("f draws random numbers ... vmap refuses by default") after one product
    # without vmap; the K products are now of f's one draw, in one vectorised call
    drop = torch.nn.Dropout(0.5).train()
    calls = [0]

    def counted(v):
        calls[0] += 1
        return drop(v) * 2

    x = torch.randn(3, 4, dtype=D)
    out, tan = jvp(counted, (x,), (torch.ones(5, 3, 4, dtype=D),), batched=True)
    assert calls[0] == 1
    kept = (out != 0).to(D) * 4  # (that one draw's mask, times dropout's 2 and f's 2)
    torch.testing.assert_close(tan, kept.expand(5, 3, 4))


def test_wrong_batched_tangent_shape():
    x = torch.randn(4, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=re.escape(
        "torch_vjp.jvp: tangents[0] has shape (4,), but primals[0] has shape (4,) and "
        "batched=True.\n  With batched=True, tangents[0] stacks K vectors along a new leading "
        "batch dimension, one per Jacobian-vector product"
    )):
        jvp(lambda x: W @ x, (x,), (torch.ones(4, dtype=D),), batched=True)
    with pytest.raises(tv.GradOutputsError, match=r"tangents\[1\] has shape \(2, 4\), but "
                       r"primals\[1\] has shape \(3,\)"):
        jvp(torch.mul, (x[:3], x[1:]), (torch.ones(2, 3, dtype=D), torch.ones(2, 4, dtype=D)),
            batched=True)


def test_tangent_structure_and_primals_type():
    x = torch.randn(3, dtype=D)
    with pytest.raises(tv.GradOutputsError, match=r"torch_vjp.jvp: tangents must have the same "
                       r"structure"):
        jvp(torch.sin, (x,), [torch.ones(3, dtype=D)])
    with pytest.raises(JacobianCallError, match=r"torch_vjp.jvp: primals must be a tuple, the "
                       r"arguments of f, but it is a Tensor"):
        jvp(torch.sin, x, (torch.ones(3, dtype=D),))


def test_bad_chunk_size():
    with pytest.raises(JacobianOptionError, match=r"torch_vjp.vjp: vjp_fn: chunk_size=0"):
        _vjp_fn()(torch.ones(2, 3, dtype=D), batched=True, chunk_size=0)
    with pytest.raises(JacobianOptionError, match=r"torch_vjp.jvp: chunk_size=-1"):
        jvp(torch.sin, (torch.ones(3),), (torch.ones(2, 3),), batched=True, chunk_size=-1)


def test_output_errors():
    with pytest.raises(JacobianCallError, match=r"torch_vjp.vjp: the output of f has dtype "
                       r"torch.int64"):
        vjp(lambda x: x.argmax(), torch.randn(3))
    with pytest.raises(JacobianCallError, match=r"torch_vjp.jvp: primals\[1\] is a str, but "
                       r"every primal is differentiated"):
        jvp(lambda x, s: x, (torch.randn(3), "a"), (torch.randn(3), "a"))


def test_errors_of_f_pass_through_untouched():
    raised = []

    def f(x):
        raised.append(KeyError("from f"))
        raise raised[-1]

    with pytest.raises(KeyError) as info:
        vjp(f, torch.randn(3))
    assert info.value is raised[-1]
    with pytest.raises(KeyError) as info:
        jvp(f, (torch.randn(3),), (torch.randn(2, 3),), batched=True)
    assert info.value is raised[-1]


@pytest.mark.parametrize("which", ["vjp", "jvp", "jvp-batched"])
def test_a_module_updating_its_statistics_is_explained(which):
    # torch.func refuses it with "mutate a captured Tensor"; torch_vjp says why and what to do
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double().train()
    x = torch.randn(4, 3, dtype=torch.float64)
    mean = net[1].running_mean.clone()
    call = {
        "vjp": lambda: tv.vjp(net, x),
        "jvp": lambda: tv.jvp(net, (x,), (torch.ones_like(x),)),
        "jvp-batched": lambda: tv.jvp(net, (x,), (torch.ones(2, 4, 3, dtype=torch.float64),),
                                      batched=True),
    }[which]
    name = which.split("-")[0]
    with pytest.raises(tv.JacobianCallError, match=(
            rf"^torch_vjp\.{name}: f changes a tensor it captured in place \(a module in "
            rf"training mode updating its running statistics, say\), which torch\.func\.{name}, "
            rf"on which torch_vjp\.{name} computes, cannot differentiate\.\n  torch\.func said: "
            rf".*mutate a captured Tensor.*\n  Fix: put the module in eval mode")):
        call()
    assert isinstance(pytest.raises(RuntimeError, call).value, RuntimeError)
    net.eval()
    assert torch.equal(net[1].running_mean, mean)


def test_a_tangent_of_another_dtype_is_cast_to_its_primals():
    # the warning said torch casts the tangent, but torch.func.jvp does not: J t came back
    # in the tangent's dtype (sin), or an operator of f raised torch's dtype error (W @ x)
    x32 = torch.randn(3)
    t64 = torch.randn(3, dtype=D)
    with pytest.warns(tv.GradOutputsWarning, match=re.escape(
            "torch_vjp.jvp: tangents[0] has dtype torch.float64 but primals[0] has dtype "
            "torch.float32; torch_vjp.jvp casts the torch.float64 tangents to torch.float32")):
        out, tan = jvp(torch.sin, (x32,), (t64,))
    assert tan.dtype == torch.float32
    torch.testing.assert_close(tan, torch.func.jvp(torch.sin, (x32,), (t64.float(),))[1])
    x = torch.randn(4, dtype=D)
    with pytest.warns(tv.GradOutputsWarning, match="casts the torch.float32 tangents"):
        _, tan = jvp(lambda v: W @ v, (x,), (torch.ones(4),))
    torch.testing.assert_close(tan, W @ torch.ones(4, dtype=D))
    with pytest.warns(tv.GradOutputsWarning, match="casts the torch.float32 tangents"):
        _, tans = jvp(lambda v: W @ v, (x,), (torch.eye(4),), batched=True)
    torch.testing.assert_close(tans, W.T)


def test_a_real_tangent_of_a_complex_primal_is_taken():
    # torch.func.jvp takes it (the complex direction with zero imaginary part); the checker
    # refused it, saying torch never casts between real and complex
    z = torch.randn(3, dtype=torch.complex128)
    t = torch.randn(3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.GradOutputsWarning)
        out, tan = jvp(lambda z: z * z, (z,), (t,))
        _, tans = jvp(lambda z: z * z, (z,), (torch.stack([t, 2 * t]),), batched=True)
    want = torch.func.jvp(lambda z: z * z, (z,), (t.to(z.dtype),))[1]
    torch.testing.assert_close(tan, want)
    torch.testing.assert_close(tans, torch.stack([want, 2 * want]))
    with pytest.raises(tv.GradOutputsError, match="never between complex and real"):
        jvp(torch.sin, (t,), (z,))  # a complex tangent of a real primal stays refused


def test_vjp_fn_refuses_a_point_written_in_place_since():
    # the products mixed the values saved at the vjp point with the new ones, silently
    # (torch.func.vjp does; plain autograd raises "modified by an inplace operation")
    x = torch.tensor([0.5, -1.0, 2.0], dtype=D)
    out, vjp_fn = vjp(lambda x: x.exp() * x, x)
    want = vjp_fn(torch.ones(3, dtype=D))
    x.mul_(3)
    with pytest.raises(JacobianCallError, match=re.escape(
            "torch_vjp.vjp: vjp_fn: primals[0] was written in place after torch_vjp.vjp "
            "computed the output.") +
            r".*\n  Fix: call torch_vjp\.vjp again after the change"):
        vjp_fn(torch.ones(3, dtype=D))
    Wc = W.clone()
    y = torch.randn(4, dtype=D)
    _, vjp_fn = vjp(lambda v: Wc @ v, y)
    Wc.add_(1)
    with pytest.raises(JacobianCallError, match=r"a tensor f captures \(of shape \(3, 4\)"):
        vjp_fn(torch.ones(3, dtype=D))
    lin = torch.nn.Linear(4, 2).to(D)
    _, vjp_fn = vjp(lin, y)
    with torch.no_grad():
        lin.weight.sub_(0.1)  # an optimizer step
    with pytest.raises(JacobianCallError, match="a parameter or buffer of a module f uses"):
        vjp_fn(torch.ones(2, dtype=D))
    with pytest.raises(JacobianCallError, match="primals"):  # the compiled vjp_fn too
        x2 = torch.randn(3, dtype=D)
        _, fn = vjp(torch.sin, x2, compile=True)
        x2.add_(1)
        fn(torch.ones(3, dtype=D))
    assert len(want) == 1


def test_vjp_fn_refuses_every_write_into_the_point():
    # whether the graph reads a tensor written is not known: every write is refused, as
    # plain autograd refuses a write into a tensor it saved. A test by computing again with
    # other values passed abs after x.mul_(-1) (same products for any value of one sign),
    # and a verdict for one cotangent was reused for the next
    x = torch.tensor([1.0, -2.0, 3.0], dtype=D)
    _, vjp_fn = vjp(torch.abs, x)
    x.mul_(-1)
    with pytest.raises(JacobianCallError, match=r"primals\[0\] was written in place"):
        vjp_fn(torch.ones(3, dtype=D))
    torch.testing.assert_close(x, torch.tensor([-1.0, 2.0, -3.0], dtype=D))
    # the output itself (exp saves it), a dict of parameters for functional_call, a partial
    y = torch.randn(3, dtype=D)
    out, vjp_fn = vjp(torch.exp, y)
    out.mul_(0.5)
    with pytest.raises(JacobianCallError, match="the output was written in place"):
        vjp_fn(torch.ones(3, dtype=D))
    lin = torch.nn.Linear(3, 2).to(D)
    params = {k: v.detach().clone() for k, v in lin.named_parameters()}
    _, vjp_fn = vjp(lambda v: torch.func.functional_call(lin, params, (v,)), y)
    params["weight"].sub_(0.1)  # an optimizer step on the dict
    with pytest.raises(JacobianCallError, match="a tensor in a container f holds"):
        vjp_fn(torch.ones(2, dtype=D))
    S = torch.ones(3, dtype=D)
    _, vjp_fn = vjp(functools.partial(lambda s, v: v * s, S), y)
    S.add_(1)
    with pytest.raises(JacobianCallError, match="a tensor f captures"):
        vjp_fn(torch.ones(3, dtype=D))
    # a module in eval mode saves its running statistics
    bn = torch.nn.BatchNorm1d(4).to(D).eval()
    _, vjp_fn = vjp(bn, torch.randn(5, 4, dtype=D))
    bn.running_var.mul_(4)
    with pytest.raises(JacobianCallError, match="a parameter or buffer of a module f uses"):
        vjp_fn(torch.ones(5, 4, dtype=D))


def test_none_is_the_cotangent_of_an_output_that_does_not_depend_on_the_primals():
    # torch.func.vjp takes None there (the output is not differentiated); vjp_fn refused it
    x = torch.randn(3, dtype=D)
    f = lambda x: (x.detach() * 2, x.sum())  # noqa: E731
    want = torch.func.vjp(f, x)[1]((None, torch.tensor(1.0, dtype=D)))
    _, vjp_fn = vjp(f, x)
    got = vjp_fn((None, torch.tensor(1.0, dtype=D)))
    torch.testing.assert_close(got, want)
    (rows,) = vjp_fn((None, torch.tensor([1.0, 2.0], dtype=D)), batched=True)
    torch.testing.assert_close(rows, torch.stack([want[0], 2 * want[0]]))
    g = lambda x: (x * 2, x.sum())  # noqa: E731  (the first output depends on x: refused)
    with pytest.raises(tv.GradOutputsError, match=r"no cotangents\[0\] was given"):
        vjp(g, x)[1]((None, torch.tensor(1.0, dtype=D)))


def test_vjp_fn_warns_once_in_checked_mode():
    # the pullback's own torch.autograd.grad call was checked again, and warned a second
    # time of the same cast, naming torch.autograd.grad and grad_outputs[0]
    x = torch.randn(3)
    with tv.checked(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (g,) = vjp(lambda x: x * 2, x)[1](torch.ones(3, dtype=D))
    said = [str(w.message) for w in caught if issubclass(w.category, tv.GradOutputsWarning)]
    assert len(said) == 1 and said[0].startswith("torch_vjp.vjp: vjp_fn: cotangents has dtype")
    torch.testing.assert_close(g, torch.full((3,), 2.0))


def test_jvp_gives_an_integer_output_a_zero_tangent():
    # torch.func.jvp does (x.max(0)'s indices); jvp refused the call, quoting torch.func.vjp
    x = torch.randn(4, dtype=D)
    want = torch.func.jvp(lambda x: x.max(0), (x,), (torch.ones(4, dtype=D),))
    got = jvp(lambda x: x.max(0), (x,), (torch.ones(4, dtype=D),))
    for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    _, (zeros, tan) = jvp(lambda x: ((x * 2).long(), x.sin()), (x,), (torch.eye(4, dtype=D),),
                          batched=True)
    assert zeros.dtype == torch.int64 and torch.equal(zeros, torch.zeros(4, 4, dtype=torch.int64))
    torch.testing.assert_close(tan, torch.diag(x.cos()))


class _NoVmapRule(torch.autograd.Function):
    """2x with both AD formulas and no vmap support."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2

    @staticmethod
    def jvp(ctx, t):
        return t * 2


class _ItemBackward(_NoVmapRule):
    """2x, whose backward reads a value with .item() (vmap cannot batch it)."""

    @staticmethod
    def backward(ctx, g):
        return g * (0 * g.sum().item() + 2)


def test_batched_products_vmap_cannot_run_are_looped_with_a_warning():
    # they came through as torch's raw vmap errors, naming neither the call nor the fix
    x = torch.randn(3, dtype=D)
    eye = torch.eye(3, dtype=D)
    _, vjp_fn = vjp(_ItemBackward.apply, x)
    with pytest.warns(tv.JacobianWarning, match=(
            r"(?s)^torch_vjp\.vjp: vjp_fn: batched=True could not vectorise the products of "
            r"_ItemBackward\.apply .*one cotangent at a time.*\n  The vectorised attempt said: "
            r"RuntimeError: vmap: It looks like you're calling \.item\(\).*Pass chunk_size=1 to skip "
            r"the vectorised attempt")):
        (rows,) = vjp_fn(eye, batched=True)
    torch.testing.assert_close(rows, 2 * eye)
    with pytest.warns(tv.JacobianWarning, match=(
            r"(?s)^torch_vjp\.jvp: batched=True could not vectorise the products of "
            r"_NoVmapRule\.apply .*one tangent at a time.*does not have vmap support")):
        _, cols = jvp(_NoVmapRule.apply, (x,), (eye,), batched=True)
    torch.testing.assert_close(cols, 2 * eye)
    with warnings.catch_warnings():  # one at a time by request: no attempt, no warning
        warnings.simplefilter("error", tv.JacobianWarning)
        _, cols = jvp(_NoVmapRule.apply, (x,), (eye,), batched=True, chunk_size=1)
    torch.testing.assert_close(cols, 2 * eye)


class _GradForAnInt(torch.autograd.Function):
    """x * n + t whose backward returns a gradient for the int n (wrong)."""

    @staticmethod
    def forward(x, t, n):
        return x * n + t

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2, None, g.sum()


def test_checked_mode_still_checks_the_users_backward_inside_vjp_fn():
    # the pullback ran with checked mode suppressed (to keep it from warning of the
    # cotangents a second time): the user's wrong backward gave torch's raw engine error
    t = torch.ones(3, dtype=D)
    _, vjp_fn = vjp(lambda x: _GradForAnInt.apply(x, t, 2), torch.randn(3, dtype=D))
    with tv.checked(), pytest.raises(tv.FunctionCheckError) as info:
        vjp_fn(torch.ones(3, dtype=D))
    assert getattr(info.value, "explanation", None)


def test_none_for_an_output_of_parameters_only_is_taken_and_a_lossy_tangent_warns():
    # an output that depends only on a module's parameter looks connected inside the
    # transform: vjp_fn refused None for it, which torch.func.vjp takes
    x = torch.randn(3, dtype=D)
    lin = torch.nn.Linear(3, 3).to(D)
    f = lambda x: (x.sin(), lin.weight @ torch.ones(3, dtype=D))  # noqa: E731
    v = torch.ones(3, dtype=D)
    want = torch.func.vjp(f, x)[1]((v, None))
    torch.testing.assert_close(vjp(f, x)[1]((v, None)), want)
    # batched too (the checker saw the None itself, and refused it)
    V = torch.randn(2, 3, dtype=D)
    pull = torch.func.vjp(f, x)[1]
    torch.testing.assert_close(vjp(f, x)[1]((V, None), batched=True),
                               torch.vmap(lambda r: pull((r, None)))(V))
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.GradOutputsWarning)
        torch.testing.assert_close(torch.func.vjp(f, x)[1]((v, None)), want)
    # a float64 tangent of a complex64 primal is rounded by the cast: it warns
    z = torch.randn(3, dtype=torch.complex64)
    with pytest.warns(tv.GradOutputsWarning, match="casts the torch.float64 tangents"):
        jvp(torch.exp, (z,), (torch.randn(3, dtype=D),))


def test_structure_mistakes_against_a_namedtuple_output_get_a_fix_that_builds_it():
    # a list or plain tuple of cotangents for a namedtuple output made the message's own
    # fix-finder call P(cotangents), so the user got TypeError "P.__new__() missing 1
    # required positional argument" instead of the structure error; a bare cotangent for a
    # one-field namedtuple was told "pass [cotangents]", a list
    import collections

    P = collections.namedtuple("P", "a b")
    Q = collections.namedtuple("Q", "a")
    x = torch.randn(3, dtype=D)
    _, pull = vjp(lambda t: P(t.sin(), t.cos()), x)
    for cot in ([x, x], (x, x)):
        with pytest.raises(tv.GradOutputsError) as info:
            pull(cot)
        assert "expected: P(a=Tensor(3,), b=Tensor(3,))" in str(info.value)  # (not a tuple's)
        assert str(info.value).endswith(
            "Fix: like the function's output, cotangents must be a P, not a "
            f"{type(cot).__name__}: pass P(*cotangents).")
        (g,) = pull(P(*cot))
        torch.testing.assert_close(g, x * x.cos() - x * x.sin())
    _, pull = vjp(lambda t: Q(t.sin()), x)
    with pytest.raises(tv.GradOutputsError) as info:
        pull(x)
    assert str(info.value).endswith(
        "Fix: like the function's output, cotangents must be a Q of one tensor: pass "
        "Q(cotangents).")
    (g,) = pull(Q(x))
    torch.testing.assert_close(g, x * x.cos())


def test_checked_func_vjp_keeps_torchs_structure_error_for_a_namedtuple_output():
    # under tv.checked(), torch.func.vjp's pullback with a list for a namedtuple output
    # raised TypeError (P.__new__ ...) from the message's fix-finder, where torch raises its
    # RuntimeError 'Expected pytree structure of cotangents ...'
    import collections

    P = collections.namedtuple("P", "a b")
    x = torch.randn(3, dtype=D)
    _, pull = torch.func.vjp(lambda t: P(t.sin(), t.cos()), x)
    with pytest.raises(RuntimeError) as plain:
        pull([x, x])
    with tv.checked():
        _, pull = torch.func.vjp(lambda t: P(t.sin(), t.cos()), x)
        with pytest.raises(RuntimeError) as checked:
            pull([x, x])
    assert str(checked.value).startswith(str(plain.value))


@pytest.mark.parametrize("which", ["vjp_fn", "jvp"])
def test_chunk_size_without_batched_is_warned_about(which, monkeypatch):
    # chunk_size without batched=True was dropped without a word
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())  # (once per call otherwise)
    x = torch.randn(3, dtype=torch.float64)
    name = "torch_vjp.vjp: vjp_fn" if which == "vjp_fn" else "torch_vjp.jvp"
    with pytest.warns(tv.JacobianWarning, match=rf"^{name}: chunk_size=2 has no effect without "
                      r"batched=True: an unbatched call computes one product\. To compute K "
                      r"products chunk_size at a time, stack K vectors .* pass batched=True; "
                      r"otherwise drop chunk_size\."):
        if which == "vjp_fn":
            got = tv.vjp(torch.sin, x)[1](torch.ones(3, dtype=x.dtype), chunk_size=2)[0]
        else:
            got = tv.jvp(torch.sin, (x,), (torch.ones(3, dtype=x.dtype),), chunk_size=2)[1]
    torch.testing.assert_close(got, x.cos())
    with warnings.catch_warnings():  # (batched: chunk_size is used, nothing to say)
        warnings.simplefilter("error", tv.JacobianWarning)
        tv.jvp(torch.sin, (x,), (torch.eye(3, dtype=x.dtype),), batched=True, chunk_size=2)


def test_chunk_size_without_batched_compiles_in_one_graph(monkeypatch):
    # the warning's warnings.warn ran while dynamo traced the user's torch.compile: with
    # fullgraph=True, tv.jvp(..., chunk_size=2) raised torch._dynamo's Unsupported
    # ('sys._getframe'), where it compiled before the warning was added
    from torch_vjp import _errors

    monkeypatch.setattr(_errors, "_WARNED", set())
    torch._dynamo.reset()
    x, v = torch.randn(3, dtype=D), torch.randn(3, dtype=D)

    def g(x, v):
        return tv.jvp(torch.sin, (x,), (v,), chunk_size=2)[1]

    got = torch.compile(g, fullgraph=True, backend="eager")(x, v)
    torch.testing.assert_close(got, x.cos() * v)


def test_a_dict_primals_entries_are_named_by_key_in_vjp_and_jvp_messages():
    # vjp_fn named a dict primal's entry "primals[1]" (its rank among the leaves) and jvp
    # "tangents[0]" / "primals[0]" where the user wrote p["a"]
    p = {"a": torch.randn(3, dtype=torch.float64), "b": torch.randn(4, 2, dtype=torch.float64)}
    _, vjp_fn = tv.vjp(lambda p: (p["a"].sum() * p["b"]).sum(0), p)
    with pytest.raises(tv.GradOutputsError, match=r"\(4, 2\) is the shape of primals\[0\]\['b'\]"):
        vjp_fn(torch.randn(4, 2, dtype=torch.float64))
    wrong = {"a": torch.randn(4, dtype=torch.float64), "b": torch.randn(4, 2, dtype=torch.float64)}
    with pytest.raises(tv.GradOutputsError) as info:
        tv.jvp(lambda p: p["a"] * 2, (p,), (wrong,))
    message = str(info.value)
    assert "tangents[0]['a'] has shape (4,), but primals[0]['a'] has shape (3,)" in message
    assert "If tangents[0]['a'] is shaped like f's output" in message
    assert "shaped like primals[0]['a'], for J t" in message


@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_batched_jvp_of_a_function_that_draws_is_that_of_one_draw(chunk):
    # a function with dropout in training mode was refused under batched=True ("vmap
    # refuses by default"), where the unbatched jvp and jacobian compute it at one draw
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.float64)
    drop = torch.nn.Dropout(0.5)

    def f(x):
        return drop(x.sin()) * 2

    T = torch.randn(4, 5, dtype=torch.float64)
    torch.manual_seed(1)
    out, tan = tv.jvp(f, (x,), (T,), batched=True, chunk_size=chunk)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    J = torch.func.jacrev(f)(x)  # (one call of f: the same draw)
    torch.testing.assert_close(tan, T @ J.T)
    torch.manual_seed(1)
    torch.testing.assert_close(out, f(x))
    assert torch.equal(after, torch.get_rng_state())  # (as one call of f leaves it)
