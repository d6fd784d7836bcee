"""The shared engine of Jacobians, batched VJPs/JVPs and the memory budget.

Every public function of :mod:`torch_vjp.jacobians` and :mod:`torch_vjp.transforms` (and the
per-sample wing, for its chunk size and fallback) is a thin layer over the same few moves,
each written once, one module each, in the order they build on each other:

* ``memory``: the ``chunk_size`` and ``max_memory`` options, the memory free on a device, and
  the one planner (:func:`~torch_vjp._engine.memory.plan_chunk`) that turns them into a chunk
  size, raising :class:`~torch_vjp.JacobianMemoryError` before anything large is allocated;
* ``context``: torch.func's own ``vjp``/``jvp``, outer transforms, the graph mode of a call,
  and the module buffers a call puts back;
* ``problem``: ``f`` as a function of the flat tensor leaves of the differentiated primals
  (:class:`~torch_vjp._engine.problem.Problem`), its primals checked and copied;
* ``rows``: the standard basis, a product applied to rows of vectors under ``torch.vmap`` or
  in a loop, a chunk at a time, and the one vectorised-then-loop fallback policy
  (:func:`~torch_vjp._engine.rows.run_with_fallback`);
* ``shapes``: the per-call options, the sizes of ``f``'s outputs (probed or remembered), and
  the chunk size of a Jacobian's products;
* ``blocks``: the products cut into Jacobian blocks and arranged in torch.func's layout;
* ``plain``: the loop strategies with plain autograd, for functions torch.func cannot run;
* ``jacobian``: the strategy engine (reverse or forward mode, vectorised or in a loop, and
  ``"auto"`` with its fallbacks);
* ``disconnected``: the warning for a block of zeros that is not the derivative (checked
  mode only);
* ``symmetry``: the Hessian's symmetry, the check of forward-over-reverse.
"""
