"""Per-layer rules, one module per family of layers; importing this package registers them.

Each module registers its rules with ``torch_vjp._per_sample.registry.register_rule``.
"""

from torch_vjp._per_sample.rules import (  # noqa: F401 - imported for their registrations
    attention,
    broadcast,
    conv,
    embedding,
    linear,
    norm,
    recurrent,
)
