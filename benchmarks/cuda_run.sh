#!/usr/bin/env bash
# The GPU run, in one go on a machine with a CUDA GPU, from the repository root:
#   1. versions and the GPU, and a smoke check that torch_vjp computes on it;
#   2. the Jacobian suite on CUDA (torch_vjp, torch.func, torch.autograd and jax.jit on the
#      same GPU), what benchmarks/results/jacobian_suite_cuda.* hold;
#   3. the tests marked cuda (skipped on machines without a GPU, CI among them);
#   4. where a compiled Jacobian's time goes on the GPU (compiled_overhead.py).
# OUT: the folder for results and logs (default cuda-results); STEPS: which of bench,
# tests and profile to run (default all three). Each step has its own time limit
# (BENCH_LIMIT, TEST_LIMIT, PROFILE_LIMIT seconds), so one that hangs costs no other.
set -u -o pipefail
OUT=${OUT:-cuda-results}
STEPS=${STEPS:-bench tests profile}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax shares the GPU with torch

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY - <<'EOF'
import torch, torch_vjp as tv
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
try:
    import jax
    print("jax", jax.__version__, jax.devices())
except Exception as exc:  # jax is optional: the suite leaves it out
    print("jax unavailable:", exc)
x = torch.randn(5, dtype=torch.float64)
J = tv.jacobian(torch.sin, x.cuda())
print("smoke: jacobian on", J.device, "max error",
      float((J.cpu() - torch.diag(x.cos())).abs().max()))
EOF
} 2>&1 | tee "$OUT/env.txt" || exit 1

if [[ " $STEPS " == *" bench "* ]]; then
  timeout "${BENCH_LIMIT:-360}" $PY -m torch_vjp bench --device cuda --no-progress \
    --plot-columns 1 --json "$OUT/jacobian_suite_cuda.json" \
    --markdown "$OUT/jacobian_suite_cuda.md" --plot "$OUT/jacobian_suite_cuda.png" \
    2>&1 | tee "$OUT/bench.log"
  echo "bench exit: $?"
fi

if [[ " $STEPS " == *" tests "* ]]; then
  timeout "${TEST_LIMIT:-150}" $PY -m pytest -m cuda -q -rs -p no:cacheprovider \
    tests/test_devices.py tests/test_jacobians.py tests/test_sparse.py tests/test_autograd.py \
    tests/test_compare.py tests/test_jacobian_distributed.py 2>&1 | tee "$OUT/tests.log"
  echo "tests exit: $?"
fi

if [[ " $STEPS " == *" profile "* ]]; then
  timeout "${PROFILE_LIMIT:-150}" $PY benchmarks/compiled_overhead.py --device cuda \
    --out "$OUT/compiled_overhead_cuda.txt" > "$OUT/profile.log" 2>&1
  echo "profile exit: $?"
fi
