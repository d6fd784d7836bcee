"""The per-sample wing: argument checks, per-example losses, the plan, the rules' pass, the
fallbacks, and the per-layer rules (``rules/``), behind the thin public functions of
``torch_vjp.per_sample``."""
