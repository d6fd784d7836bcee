"""The machinery of sparse Jacobians behind :mod:`torch_vjp.sparse`, one module per step, in
the order they build on each other:

* ``sets``: the table of index sets (sets of input elements) and their vectorised union
  (NOTE [index sets]);
* ``tracer``: the dispatch mode that runs ``f`` once and keeps a shadow of set ids beside
  every tracked storage (NOTE [shadow storage], NOTE [what the pattern means]);
* ``rules``: the rule of each kind of aten op (elementwise, reductions, data movement,
  norms, factories, and the conservative rule for ops without one);
* ``scatters``: the rules of writes at positions, overwriting or accumulating;
* ``contract``: the rules of matrix products and convolutions (NOTE [contraction rule]);
* ``pattern``: patterns as sorted index arrays, and the checks of a user's pattern;
* ``detect``: one detection run, from ``f`` to its pattern;
* ``coloring``: greedy distance-2 colourings of columns or rows (NOTE [colouring]);
* ``probe``: the probe row that checks a cached plan on every call (NOTE [a cached plan,
  probed]);
* ``compute``: plans and their cache, the compressed products under vmap, and the
  decompressed result (NOTE [compression], NOTE [plan cache]).
"""
