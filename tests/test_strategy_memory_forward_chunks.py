"""max_memory under strategy='fwd' where f closes over parameters that require grad: the
products record graphs that keep every intermediate tangent until their chunk is stored, so
the chunk size counts the intermediate results, not only the inputs and outputs."""

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _mlp_with_grad_parameters(n_in: int, hidden: int, n_out: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # parameters require grad, as in any module
        torch.nn.Linear(n_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(), torch.nn.Linear(hidden, n_out),
    ).double()


@pytest.mark.parametrize("n", [128, 64])
def test_max_memory_bounds_the_peak_with_hidden_layers_wider_than_the_ends(n):
    from torch_vjp._measure import measure_peak  # live tensor bytes, counted per operator

    model = _mlp_with_grad_parameters(n, 256, n)
    x = torch.randn(n, dtype=D)
    budget = n * n * 8 + 300_000  # several chunks of products
    peak = measure_peak(lambda: tv.jacobian(model, x, strategy="fwd", max_memory=budget),
                        torch.device("cpu"))
    assert peak <= budget
    # chunked, the Jacobian is still the one reverse mode gives
    got = tv.jacobian(model, x, strategy="fwd", max_memory=budget)
    want = torch.func.jacrev(model)(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # a later call (sizes remembered) keeps the budget too
    peak = measure_peak(lambda: tv.jacobian(model, x, strategy="fwd", max_memory=budget),
                        torch.device("cpu"))
    assert peak <= budget

