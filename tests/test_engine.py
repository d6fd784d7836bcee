"""The engine's own tests (torch_vjp/_engine/): the memory planner, the chunk-size check,
rows and the one fallback policy, the output-size cache, blocks and their layout, the
disconnection check; every number against an independent reference in float64."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_structure

import torch_vjp as tv
from torch_vjp._engine import memory, shapes
from torch_vjp._engine.blocks import assemble
from torch_vjp._engine.disconnected import warn_disconnected
from torch_vjp._engine.jacobian import jacobian_blocks
from torch_vjp._engine.memory import (
    GRAPH_FACTOR,
    SMALL_REQUEST,
    WORK_FACTOR,
    check_chunk_size,
    free_memory,
    new_buffer,
    plan_chunk,
    plan_products,
    sizes_text,
)
from torch_vjp._engine.problem import Problem, normalize_argnums
from torch_vjp._engine.rows import (
    Restart,
    basis_rows,
    eye_basis,
    map_rows,
    map_rows_with_fallback,
    run_with_fallback,
)
from torch_vjp._errors import (
    JacobianCallError,
    JacobianMemoryError,
    JacobianOptionError,
    PerSampleValueError,
    TorchVJPError,
)

D = torch.float64
CPU = torch.device("cpu")
CHUNKS = (None, 1, 2, 3, 4, 7, 10, 1000)


def assert_tree_close(got, want):
    assert tree_structure(got) == tree_structure(want)
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------
# The chunk-size check
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, 1, 7, 10**9], ids=str)
def test_chunk_size_accepted(value):
    assert check_chunk_size(value, call="c") == value


def test_chunk_size_of_a_numpy_integer_is_accepted_as_an_int():
    # (np.int64(2), a count read off an array, was refused as "must be None or an int")
    import numpy as np

    got = check_chunk_size(np.int64(2), call="c")
    assert got == 2 and type(got) is int
    x = torch.randn(4, dtype=torch.float64)
    f = lambda x: torch.outer(x, x.sin())  # noqa: E731
    for strategy in ("rev", "fwd"):
        torch.testing.assert_close(tv.jacobian(f, x, chunk_size=np.int64(3), strategy=strategy),
                                   torch.func.jacrev(f)(x))


@pytest.mark.parametrize("value", [0, -3, 1.5, 2.0, True, False, "4", (2,)], ids=repr)
def test_chunk_size_rejected_with_its_meaning(value):
    with pytest.raises(JacobianOptionError) as info:
        check_chunk_size(value, call="torch_vjp.jacobian")
    assert str(info.value) == (
        f"torch_vjp.jacobian: chunk_size={value!r}, but it must be None or an int >= 1: the "
        f"number of basis vectors (products) computed at once. None computes them all at "
        f"once when memory allows; 1 computes one at a time."
    )
    assert isinstance(info.value, ValueError)


def test_chunk_size_check_names_what_is_chunked_and_raises_the_callers_class():
    with pytest.raises(PerSampleValueError, match=r"^torch_vjp\.per_sample_grads: "
                       r"chunk_size=0, but it must be None or an int >= 1: the number of "
                       r"examples computed at once\."):
        check_chunk_size(0, call="torch_vjp.per_sample_grads", what="examples",
                         cls=PerSampleValueError)


# --------------------------------------------------------------------------------------
# The memory planner
# --------------------------------------------------------------------------------------


def _no_free_memory_read(monkeypatch):
    def refuse(device):
        raise AssertionError("the free memory was read")

    monkeypatch.setattr(memory, "free_memory", refuse)


def test_small_requests_never_read_the_free_memory(monkeypatch):
    _no_free_memory_read(monkeypatch)
    assert plan_chunk(100, 1000, 100, chunk_size=None, max_memory=None, device=CPU,
                      call="c", what="w", alternatives="a") is None
    assert plan_chunk(100, 1000, 100, chunk_size=7, max_memory=None, device=CPU,
                      call="c", what="w", alternatives="a") == 7
    assert plan_chunk(100, 1000, 100, chunk_size=100, max_memory=None, device=CPU,
                      call="c", what="w", alternatives="a") is None  # one chunk: all at once


@pytest.mark.parametrize("budget, chunk_size, expected", [
    (10_000 + 5 * 100, None, 5),     # room for five products
    (10_000 + 5 * 100, 3, 3),        # the caller's chunk is smaller
    (10_000 + 5 * 100, 9, 5),        # the budget's is smaller
    (10_000 + 150, None, 1),         # one product fits, not two
    (10_000 + 10**6, None, None),    # every product fits: all at once
])
def test_chunk_fits_the_budget(budget, chunk_size, expected):
    got = plan_chunk(50, 10_000, 100, chunk_size=chunk_size, max_memory=budget, device=CPU,
                     call="c", what="w", alternatives="a")
    assert got == expected


def test_over_budget_raises_with_size_source_and_alternatives():
    what_calls = []

    def what():
        what_calls.append(1)
        return "10 x 10 float64 elements"

    with pytest.raises(JacobianMemoryError) as info:
        plan_chunk(10, 3_000_000_000, 100, chunk_size=None, max_memory=2 * 10**9,
                   device=CPU, call="torch_vjp.jacobian", what=what,
                   alternatives="use a VJP.")
    assert str(info.value) == (
        "torch_vjp.jacobian: the result needs 3 GB: 10 x 10 float64 elements. That is more "
        "than max_memory=2 GB.\n"
        "  This is checked before the products are computed, so nothing large was "
        "allocated.\n"
        "  Alternatives: use a VJP."
    )
    assert isinstance(info.value, MemoryError) and what_calls == [1]


def test_result_that_fits_without_room_for_one_product():
    # (the total is what exceeds the budget: the result alone fits)
    with pytest.raises(JacobianMemoryError, match=r"^c: the result needs 800 B and at least "
                       r"640 B of working memory for one product, 1\.44 kB in all: w\. That "
                       r"is more than max_memory=1 kB\."):
        plan_chunk(10, 800, 640, chunk_size=None, max_memory=1000, device=CPU, call="c",
                   what="w", alternatives="a")


def test_default_budget_is_the_free_memory(monkeypatch):
    monkeypatch.setattr(memory, "free_memory", lambda device: (SMALL_REQUEST * 2, "free here"))
    per = SMALL_REQUEST // 8
    assert plan_chunk(100, SMALL_REQUEST, per, chunk_size=None, max_memory=None, device=CPU,
                      call="c", what="w", alternatives="a") == 8
    with pytest.raises(JacobianMemoryError, match=r"That is more than the 134 MB free here, "
                       r"the default budget\."):
        plan_chunk(100, SMALL_REQUEST * 3, per, chunk_size=None, max_memory=None, device=CPU,
                   call="c", what="w", alternatives="a")
    monkeypatch.setattr(memory, "free_memory", lambda device: None)  # unknown: no budget
    assert plan_chunk(100, SMALL_REQUEST * 3, per, chunk_size=None, max_memory=None,
                      device=CPU, call="c", what="w", alternatives="a") is None


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("records", [False, True])
def test_products_are_modelled_as_the_memory_note_says(batch, records):
    """plan_products is plan_chunk with NOTE [memory model]'s Jacobian and product sizes."""
    n_out, n_in, itemsize = 40, 30, 8
    b = batch or 1
    jac = itemsize * n_out * n_in * b
    per = WORK_FACTOR * itemsize * (n_out + n_in) * b * (GRAPH_FACTOR if records else 1)
    for budget in (jac + per, jac + 7 * per + 1, jac + 100 * per):
        want = plan_chunk(n_out, jac, per, chunk_size=None, max_memory=budget, device=CPU,
                          call="c", what="w", alternatives="a")
        got = plan_products(n_out, n_out, n_in, itemsize, chunk_size=None, max_memory=budget,
                            device=CPU, call="c", alternatives="a", batch=batch,
                            records=records)
        assert got == want


def test_product_sizes_in_words():
    assert sizes_text(1000, 20, None, torch.float32) == (
        "20,000 float32 elements, 1,000 output elements times 20 input elements")
    assert sizes_text(3, 4, 64, D) == (
        "768 float64 elements, B = 64 blocks of 3 output elements times 4 input elements")
    assert sizes_text(3, 4, None, None) == (
        "12 elements, 3 output elements times 4 input elements")


def test_free_memory_on_this_machine():
    free = free_memory(CPU)
    assert free is not None
    nbytes, source = free
    assert nbytes > 0 and source.startswith("free on cpu (")
    assert free_memory(torch.device("meta")) is None


class _Advice:
    """Stands in for libc's madvise: records the ranges advised."""

    def __init__(self):
        self.calls = []

    def __call__(self, start, length, advice):
        self.calls.append((start, length, advice))
        return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_buffers_ask_for_huge_pages_over_whole_pages_inside_them(monkeypatch, dtype):
    advice = _Advice()
    monkeypatch.setattr(memory, "_huge_page_advice", lambda: advice)
    monkeypatch.delenv("TORCH_VJP_HUGE_PAGES", raising=False)
    like = torch.zeros(1, dtype=dtype)
    rows = memory.HUGE_PAGE_MIN_BYTES // like.element_size() // 1000 + 3
    out = new_buffer(like, (rows, 1000))
    assert out.shape == (rows, 1000) and out.dtype == dtype and out.device.type == "cpu"
    assert len(advice.calls) == 1
    start, length, kind = advice.calls[0]
    huge = 2 * 2**20
    begin, end = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    assert kind == 14  # MADV_HUGEPAGE
    assert start % huge == 0 and length % huge == 0 and length > 0
    assert begin <= start and start + length <= end  # only the buffer's own memory
    assert start - begin < huge and end - (start + length) < huge  # every whole page of it
    out.fill_(1.5)  # the advice never changes what the buffer can hold
    assert out.sum().item() == 1.5 * out.numel()


def test_small_buffers_and_the_switch_off_ask_for_nothing(monkeypatch):
    advice = _Advice()
    monkeypatch.setattr(memory, "_huge_page_advice", lambda: advice)
    monkeypatch.delenv("TORCH_VJP_HUGE_PAGES", raising=False)
    like = torch.zeros(1)
    assert new_buffer(like, (1000, 1000)).shape == (1000, 1000)  # 4 MB: below the minimum
    monkeypatch.setenv("TORCH_VJP_HUGE_PAGES", "0")
    big = new_buffer(like, (memory.HUGE_PAGE_MIN_BYTES // 4 // 1000 + 1, 1000))
    assert big.numel() * 4 >= memory.HUGE_PAGE_MIN_BYTES
    assert advice.calls == []


def test_sparse_and_subclass_buffers_are_made_as_new_empty_makes_them(monkeypatch):
    advice = _Advice()
    monkeypatch.setattr(memory, "_huge_page_advice", lambda: advice)
    monkeypatch.delenv("TORCH_VJP_HUGE_PAGES", raising=False)
    rows = memory.HUGE_PAGE_MIN_BYTES // 4 // 1000 + 1
    sparse = new_buffer(torch.zeros(2, 2).to_sparse(), (rows, 1000))
    assert sparse.layout == torch.sparse_coo and sparse.shape == (rows, 1000)

    class Tagged(torch.Tensor):
        pass

    tagged = new_buffer(torch.zeros(2).as_subclass(Tagged), (rows, 1000))
    assert type(tagged) is Tagged and tagged.shape == (rows, 1000)
    assert advice.calls == []


def test_huge_page_advice_is_only_looked_up_where_the_kernel_takes_it(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", False)
    advise = memory._huge_page_advice()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            setting = fh.read()
    except OSError:
        setting = ""
    assert (advise is not None) == ("[madvise]" in setting)
    assert memory._huge_page_advice() is advise  # looked up once


def test_per_sample_gradients_in_a_huge_page_buffer_are_right(monkeypatch):
    # float64 Linear(512, 1024) with B = 8: a 33.6 MB result buffer for the weight
    monkeypatch.delenv("TORCH_VJP_HUGE_PAGES", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 1024).double()
    x, y = torch.randn(8, 512, dtype=torch.float64), torch.randn(8, 1024, dtype=torch.float64)
    loss = torch.nn.MSELoss()
    grads = tv.per_sample_grads(model, loss, x, y, strategy="hooks")
    assert grads["weight"].numel() * 8 >= memory.HUGE_PAGE_MIN_BYTES
    for i in (0, 7):
        model.zero_grad()
        loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        torch.testing.assert_close(grads["weight"][i], model.weight.grad, rtol=1e-12, atol=1e-12)


def test_jacobian_of_plans_through_the_shared_planner(monkeypatch):
    seen = []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return 2

    monkeypatch.setattr("torch_vjp._engine.computed.plan_products", spy)
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = torch.outer(x, x)
    J = tv.jacobian_of(y, x)
    torch.testing.assert_close(J, torch.func.jacrev(lambda x: torch.outer(x, x))(x.detach()))
    ((args, kwargs),) = seen  # (one plan: no zero row is put before the products)
    assert args == (9, 9, 3, 8) and kwargs["chunk_size"] is None


# --------------------------------------------------------------------------------------
# Rows: the basis, vmap or loop, and the one fallback policy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [None, 2])
def test_basis_rows_are_the_rows_of_the_identity(batch):
    shapes_ = [torch.Size([2, 3]), torch.Size([]), torch.Size([4])]
    n = sum(math.prod(s) for s in shapes_)
    rows = basis_rows(shapes_, [D] * 3, [CPU] * 3, batch)
    eye = torch.eye(n, dtype=D)
    for start, stop in [(0, n), (0, 1), (5, 9), (6, 7), (n - 1, n)]:
        parts = rows(start, stop)
        flat = torch.cat([p.reshape(stop - start, *([batch] if batch else []), -1)
                          for p in parts], dim=-1)
        want = eye[start:stop]
        if batch:
            want = want.unsqueeze(1).expand(-1, batch, -1)
        torch.testing.assert_close(flat, want)


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("shape", [torch.Size([5]), torch.Size([2, 3]), torch.Size([])])
def test_eye_basis_is_the_whole_basis_of_one_tensor(shape, batch):
    n = math.prod(shape)
    got = eye_basis(shape, n, D, CPU, batch)
    (want,) = basis_rows([shape], [D], [CPU], batch)(0, n)
    torch.testing.assert_close(got, want)
    assert batch is None or got.is_contiguous()


@pytest.mark.parametrize("chunk_size", CHUNKS, ids=str)
@pytest.mark.parametrize("vectorized", [True, False], ids=["vmap", "loop"])
def test_map_rows_stacks_every_product(vectorized, chunk_size):
    A = torch.randn(5, 4, dtype=D)
    B = torch.randn(3, dtype=D)
    vectors = torch.randn(11, 4, dtype=D)

    def fn(v):
        return (A @ v, (B * v.sum()).sin())

    stacked, _ = map_rows(fn, lambda s, e: (vectors[s:e],), 11, vectorized=vectorized,
                          chunk_size=chunk_size)
    torch.testing.assert_close(stacked[0], vectors @ A.T)
    torch.testing.assert_close(stacked[1], (B * vectors.sum(1, keepdim=True)).sin())


@pytest.mark.parametrize("vectorized", [True, False], ids=["vmap", "loop"])
def test_map_rows_returns_an_extra_once_and_detaches(vectorized):
    w = torch.randn(3, dtype=D, requires_grad=True)
    vectors = torch.randn(4, 3, dtype=D)

    def fn(v):
        return (w * v,), w.sum()

    stacked, extra = map_rows(fn, lambda s, e: (vectors[s:e],), 4, vectorized=vectorized,
                              chunk_size=3, extras=True, detach=True)
    torch.testing.assert_close(stacked[0], w.detach() * vectors)
    assert not stacked[0].requires_grad
    torch.testing.assert_close(extra, w.sum())


class _Calls:
    """Records the order in which the policy's callables run."""

    def __init__(self, vectorized=None, check=None, loop=None):
        self.order = []
        self.errors = {"vectorized": vectorized, "check": check, "loop": loop}
        self.said = []

    def step(self, name, value):
        def run():
            self.order.append(name)
            if self.errors[name] is not None:
                raise self.errors[name]
            return value

        return run

    def run(self, with_check=True):
        return run_with_fallback(
            self.step("vectorized", "vectorized"), self.step("loop", "looped"),
            on_fallback=self.said.append,
            check_one=self.step("check", None) if with_check else None,
        )


@pytest.mark.parametrize("with_check", [True, False], ids=["check-one", "loop-checks"])
def test_policy_keeps_a_vectorised_success(with_check):
    calls = _Calls()
    assert calls.run(with_check) == "vectorized"
    assert calls.order == ["vectorized"] and calls.said == []


def test_policy_checks_one_item_then_loops_and_says_why():
    failure = RuntimeError("Batching rule not implemented")
    calls = _Calls(vectorized=failure)
    assert calls.run() == "looped"
    assert calls.order == ["vectorized", "check", "loop"]
    assert calls.said == [failure]


def test_policy_passes_the_users_own_error_through_untouched():
    own = ValueError("f's own error")
    calls = _Calls(vectorized=RuntimeError("vmap"), check=own)
    with pytest.raises(ValueError) as info:
        calls.run()
    assert info.value is own
    assert calls.order == ["vectorized", "check"] and calls.said == []


def test_policy_without_a_check_lets_the_loop_decide():
    own = ValueError("f's own error")
    calls = _Calls(vectorized=RuntimeError("vmap"), loop=own)
    with pytest.raises(ValueError) as info:
        calls.run(with_check=False)
    assert info.value is own and calls.said == []
    calls = _Calls(vectorized=RuntimeError("vmap"))
    assert calls.run(with_check=False) == "looped"
    assert calls.order == ["vectorized", "loop"] and len(calls.said) == 1


@pytest.mark.parametrize("error", [
    MemoryError("out of memory"), torch.OutOfMemoryError("CUDA out of memory"),
    TorchVJPError("torch_vjp's own"), JacobianCallError("argnums"), Restart(),
], ids=lambda e: type(e).__name__)
def test_policy_never_catches_memory_own_errors_or_a_restart(error):
    calls = _Calls(vectorized=error)
    with pytest.raises(type(error)) as info:
        calls.run()
    assert info.value is error and calls.order == ["vectorized"]


def test_policy_lets_the_caller_refuse_the_fallback():
    class Refused(Exception):
        pass

    def refuse(err):
        raise Refused("strategy='vmap' cannot batch this") from err

    with pytest.raises(Refused) as info:
        run_with_fallback(lambda: 1 / 0, lambda: "looped", on_fallback=refuse,
                          check_one=lambda: None)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_rows_fall_back_to_the_loop_when_vmap_fails():
    vectors = torch.randn(6, 3, dtype=D)

    def fn(v):
        if isinstance(v, torch.Tensor) and torch._C._functorch.is_batchedtensor(v):
            raise RuntimeError("no batching rule for this")
        return (2 * v,)

    said = []
    stacked, _ = map_rows_with_fallback(fn, lambda s, e: (vectors[s:e],), 6, chunk_size=4,
                                        on_fallback=said.append)
    torch.testing.assert_close(stacked[0], 2 * vectors)
    assert [str(e) for e in said] == ["no batching rule for this"]
    said.clear()
    stacked, _ = map_rows_with_fallback(fn, lambda s, e: (vectors[s:e],), 6, chunk_size=1,
                                        on_fallback=said.append)  # no vmap: nothing to say
    torch.testing.assert_close(stacked[0], 2 * vectors)
    assert said == []


# --------------------------------------------------------------------------------------
# Problem: argnums, the leaves, the copies
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("argnums, n, expected", [
    (0, 1, (0,)), (-1, 3, (2,)), ((0, 2), 3, (0, 2)), ((-1, 0), 2, (1, 0)),
], ids=str)
def test_argnums_normalized(argnums, n, expected):
    assert normalize_argnums(argnums, n, call="c") == expected


@pytest.mark.parametrize("argnums, n, message", [
    (0, 0, r"c: no primals were given\. Pass the point at which to differentiate, e\.g\. "
           r"c\(f, x\)\."),
    (3, 2, r"c: argnums=3, but f was given 2 primals, so argnums must lie in -2\.\.1\."),
    ((0, 0), 2, r"c: argnums=\(0, 0\) names a primal twice; each may appear once\."),
    ([0, 1], 2, r"c: argnums=\[0, 1\], but it must be an int or a non-empty tuple of ints: "
                r"the positions of the primals to differentiate against\. Fix: "
                r"argnums=\(0, 1\)\."),
    ((0, 1.0), 2, r"c: argnums=\(0, 1\.0\) holds 1\.0, but its entries must be ints: the "
                  r"positions of the primals to differentiate against\.$"),
    (True, 2, r"c: argnums=True, but it must be an int or a non-empty tuple of ints"),
    # an integer of another type is named with the fix (it had none)
    (np.int64(1), 2, r"c: argnums=np\.int64\(1\), but it must be an int or a non-empty "
                     r"tuple of ints: .* Fix: argnums=1 \(a Python int\)\.$"),
    (torch.tensor(0), 2, r"c: argnums=tensor\(0\), .* Fix: argnums=0 \(a Python int\)\.$"),
    ((0, np.int32(1)), 2, r"c: argnums=\(0, np\.int32\(1\)\) holds np\.int32\(1\), but its "
                          r"entries must be ints: .* Fix: argnums=\(0, 1\) \(Python ints\)\.$"),
], ids=str)
def test_argnums_rejected(argnums, n, message):
    with pytest.raises(JacobianCallError, match="^" + message):
        normalize_argnums(argnums, n, call="c")


def test_problem_calls_f_itself_when_every_primal_is_differentiated():
    f = torch.mul
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    assert Problem(f, (x,), 0, has_aux=False, call="c")._call_f is f
    assert Problem(f, (x, y), (0, 1), has_aux=False, call="c")._call_f is f
    assert Problem(f, (x, y), None, has_aux=False, call="c")._call_f is f
    prob = Problem(f, (x, y), 1, has_aux=False, call="c")
    torch.testing.assert_close(prob.g(2 * y), x * 2 * y)


@pytest.mark.parametrize("argnums", [0, (0,), (1, 0)], ids=str)
def test_problem_leaves_and_their_names(argnums):
    params = {"w": torch.randn(2, 3, dtype=D), "b": torch.randn(2, dtype=D)}
    x = torch.randn(3, dtype=D)
    prob = Problem(lambda p, x: p["w"] @ x + p["b"], (params, x), argnums, has_aux=False,
                   call="c")
    names = [prob.leaf_name(k) for k in range(len(prob.leaves))]
    if argnums == 0:
        assert names == ["primals[0]['w']", "primals[0]['b']"]
    elif argnums == (0,):
        assert names == ["primals[0]['w'] (argnums[0])", "primals[0]['b'] (argnums[0])"]
    else:
        assert names == ["primals[1] (argnums[0])", "primals[0]['w'] (argnums[1])",
                         "primals[0]['b'] (argnums[1])"]
    torch.testing.assert_close(prob.g(*prob.leaves), params["w"] @ x + params["b"])


def test_problem_resets_a_primal_that_f_modifies_in_place():
    x = torch.ones(3, dtype=D)

    def f(x):
        y = x * 2
        x.add_(1)
        return y

    prob = Problem(f, (x,), 0, has_aux=False, call="c")
    for _ in range(3):
        torch.testing.assert_close(prob.g(prob.leaves[0]), torch.full((3,), 2.0, dtype=D))
    torch.testing.assert_close(x, torch.ones(3, dtype=D))  # the caller's tensor untouched


# --------------------------------------------------------------------------------------
# The output-size cache
# --------------------------------------------------------------------------------------


def _counting(f):
    calls = {"n": 0}

    def counted(*args):
        calls["n"] += 1
        return f(*args)

    return counted, calls


def test_output_sizes_are_probed_once_per_function_and_input_shapes():
    W = torch.randn(300, 2, dtype=D)
    plain = lambda x: torch.tanh(W @ x)  # noqa: E731
    f, calls = _counting(plain)
    for n_in, probes in ((2, 1), (2, 0), (2, 0)):
        calls["n"] = 0
        x = torch.randn(n_in, dtype=D)
        prob = Problem(f, (x,), 0, has_aux=False, call="c")
        res = jacobian_blocks(prob, "fwd", vectorized=True, fallback=False, chunk_size=None,
                              max_memory=None)
        torch.testing.assert_close(assemble(prob, res), torch.func.jacrev(plain)(x))
        assert calls["n"] == probes + 1  # the probe, then one vmapped call
    key = shapes.shapes_key(prob, None)
    assert key in shapes._SHAPES
    assert shapes.shapes_key(prob, 4) != key  # batch_jacobian's sizes are kept apart


def test_a_probe_given_by_the_caller_is_never_cached():
    x = torch.randn(3, dtype=D)
    prob = Problem(torch.sin, (x,), 0, has_aux=False, call="c")
    probed = []

    def probe():
        probed.append(1)
        return [torch.empty(3, dtype=D, device="meta")], tree_flatten(x)[1]

    for _ in range(2):
        res = jacobian_blocks(prob, "fwd", vectorized=True, fallback=False, chunk_size=None,
                              max_memory=None, probe=probe)
        torch.testing.assert_close(assemble(prob, res), torch.diag(x.cos()))
    assert probed == [1, 1]


def test_stale_output_sizes_start_the_computation_over():
    width = {"n": 5}
    W = torch.randn(9, 2, dtype=D)
    plain = lambda x: W[: width["n"]] @ x  # noqa: E731
    x = torch.randn(2, dtype=D)
    for n in (5, 7, 5):
        width["n"] = n
        prob = Problem(plain, (x,), 0, has_aux=False, call="c")
        res = jacobian_blocks(prob, "fwd", vectorized=True, fallback=False, chunk_size=None,
                              max_memory=None)
        torch.testing.assert_close(assemble(prob, res), W[:n])


# --------------------------------------------------------------------------------------
# Blocks and their layout
# --------------------------------------------------------------------------------------


def _pytree_f(x, y):
    return {"a": torch.tanh(x) * y[0], "b": (x.sum() * y, torch.outer(x, y[:2]))}


@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0)], ids=str)
def test_blocks_assemble_in_torch_func_layout(argnums, mode):
    x, y = torch.randn(3, dtype=D), torch.randn(4, dtype=D)
    prob = Problem(_pytree_f, (x, y), argnums, has_aux=False, call="c")
    for vectorized in (True, False):
        res = jacobian_blocks(prob, mode, vectorized=vectorized, fallback=False,
                              chunk_size=None, max_memory=None)
        assert res.mode == mode
        assert_tree_close(assemble(prob, res), torch.func.jacrev(_pytree_f, argnums)(x, y))


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_batch_blocks_are_the_per_example_jacobians(mode):
    W = torch.randn(3, 4, dtype=D)
    x = torch.randn(5, 4, dtype=D)
    prob = Problem(lambda x: (torch.tanh(x @ W.T), x.sin()), (x,), 0, has_aux=False,
                   call="c")
    res = jacobian_blocks(prob, mode, vectorized=True, fallback=False, chunk_size=2,
                          max_memory=None, batch=5)
    single = torch.func.jacrev(lambda xi: (torch.tanh(W @ xi), xi.sin()))
    assert_tree_close(assemble(prob, res), torch.vmap(single)(x))


# --------------------------------------------------------------------------------------
# The disconnection check
# --------------------------------------------------------------------------------------


def _blocks_of(f, *primals, argnums=0):
    prob = Problem(f, primals, argnums, has_aux=False, call="torch_vjp.jacobian")
    res = jacobian_blocks(prob, "rev", vectorized=False, fallback=False, chunk_size=None,
                          max_memory=None)
    return prob, res


def test_zero_block_through_item_is_warned():
    x = torch.tensor([1.0, 2.0], dtype=D)
    prob, res = _blocks_of(lambda x: torch.tensor([x.sum().item()] * 2, dtype=D), x)
    with tv.checked(), pytest.warns(
        tv.JacobianWarning, match=r"^torch_vjp\.jacobian: the output of f does not depend on "
        r"primals\[0\] through autograd, although its value changes when primals\[0\] "
        r"changes: its Jacobian block is all zeros"
    ):
        warn_disconnected(prob, res)


def test_second_output_names_its_path():
    x, y = torch.randn(2, dtype=D), torch.randn(2, dtype=D)
    prob, res = _blocks_of(lambda x, y: (x * y, torch.tensor(y.detach().numpy() * 2)), x, y,
                           argnums=(0, 1))
    with tv.checked(), pytest.warns(tv.JacobianWarning) as caught:
        warn_disconnected(prob, res)
    assert [str(w.message).split(" does")[0] for w in caught] == [
        "torch_vjp.jacobian: output[1]"]
    assert "on primals[1] (argnums[1])" in str(caught[0].message)


@pytest.mark.parametrize("f", [
    lambda x, y: x * 0 + y,            # connected, a true zero derivative for x
    lambda x, y: torch.zeros(2, dtype=D) + y.sum(),  # x unused: the value does not move
], ids=["true-zero", "constant-in-x"])
def test_zero_blocks_that_are_derivatives_are_not_warned(f):
    x, y = torch.randn(2, dtype=D), torch.randn(2, dtype=D)
    prob, res = _blocks_of(f, x, y, argnums=(0, 1))
    assert_tree_close(assemble(prob, res), torch.func.jacrev(f, (0, 1))(x, y))
    with warnings.catch_warnings(), tv.checked():
        warnings.simplefilter("error", tv.JacobianWarning)
        warn_disconnected(prob, res)


def test_a_builtin_function_keeps_its_checked_route():
    # a builtin callable cannot be weakly referenced: its route key had a new token on every
    # call, so "auto" checked torch.sin again on every call (one more call of f and a
    # reverse product) and each call added an entry to the table of checked routes
    from torch_vjp._engine import fwdcheck

    x = torch.randn(5, dtype=torch.float64)
    for f in (torch.sin, torch.Tensor.exp):
        assert fwdcheck.route_key(f) == fwdcheck.route_key(f)
        tv.jacobian(f, x)
        before = dict(fwdcheck.CHECKED)
        for _ in range(3):
            tv.jacobian(f, x)
        assert fwdcheck.CHECKED == before
    assert fwdcheck.route_key(torch.sin) != fwdcheck.route_key(torch.cos)


class _Proxy:
    # (a forwarding proxy, as config and tracking wrappers are: its __getattr__ is user code
    # that forwards what it finds and raises what it likes for the rest)
    __slots__ = ("_target", "_asked")

    def __init__(self, target):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_asked", [])

    def __getattr__(self, name):
        object.__getattribute__(self, "_asked").append(name)
        if name.startswith("__"):
            raise RuntimeError(f"the proxy has no {name}")
        return getattr(object.__getattribute__(self, "_target"), name)


def test_the_walk_of_what_f_reaches_runs_no_proxy_code():
    # the walk asked the proxy for __self__, __wrapped__, __func__ and __dict__ through its
    # __getattr__: the proxy's RuntimeError came out of tv.jacobian for a valid f
    cfg = _Proxy(torch.nn.Linear(3, 2).double())
    w = torch.randn(2, 3, dtype=torch.float64)

    def f(x):
        return torch.tanh(w @ x) * cfg.weight.sum()

    x = torch.randn(3, dtype=torch.float64)
    for strategy in ("auto", "rev", "fwd"):
        torch.testing.assert_close(tv.jacobian(f, x, strategy=strategy),
                                   torch.func.jacrev(f)(x))
    assert [n for n in object.__getattribute__(cfg, "_asked") if n.startswith("__")] == []
