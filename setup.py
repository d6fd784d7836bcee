"""Packaging for torch_vjp.

The runtime requirement on torch is a range that torch 2.13.0 satisfies; install with
``torch==2.13.0`` pinned (see the README) so that pip never resolves a newer build.
"""

from setuptools import setup

setup(
    name="torch_vjp",
    version="0.1.0",
    description="Explicit Jacobians, batched VJPs/JVPs, per-sample gradients and "
    "friendly grad_outputs errors for PyTorch.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # ``_torch_vjp_autoload`` is the target of torch's plugin entry point. It lives inside the
    # torch_vjp source folder but installs as its own top-level module, because loading an
    # entry point ``pkg.mod:fn`` imports ``pkg/__init__.py`` first, outside any guard: the
    # hook's own module must be one whose import cannot fail.
    packages=["torch_vjp", "torch_vjp.bench", "_torch_vjp_autoload"],
    package_dir={"_torch_vjp_autoload": "torch_vjp/_autoload"},
    package_data={"torch_vjp": ["py.typed"]},
    install_requires=["torch>=2.5,<3", "numpy>=1.24"],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6.80"],
        "bench": ["tqdm>=4.60", "matplotlib>=3.7"],
        "docs": ["mkdocs>=1.5", "mkdocs-material>=9", "mkdocstrings[python]>=0.24"],
        # The peers the benchmarks compare against, where installed (all optional).
        "peers": ["opacus>=1.4", "backpack-for-pytorch>=1.6", "jax>=0.4"],
    },
    entry_points={
        "torch.backends": ["torch_vjp = _torch_vjp_autoload:_autoload"],
        "console_scripts": ["torch-vjp = torch_vjp.__main__:main"],
    },
    zip_safe=False,
)
