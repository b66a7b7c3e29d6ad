"""The ways of stepping: each owns how the parameters are laid out and how one training step
runs on a mesh; the transformations below never know which step calls them.

* :mod:`compjax.steps.data_parallel`: replicated params, :func:`compjax.data_parallel`;
* :mod:`compjax.steps.fsdp`: params and optimizer state split over the data axis
  (:func:`compjax.fsdp`), with its layout (:mod:`~compjax.steps.fsdp_layout`), state
  (:mod:`~compjax.steps.fsdp_state`), parameter gathers (:mod:`~compjax.steps.param_gather`)
  and two-level variant (:mod:`~compjax.steps.hpz`);
* :mod:`compjax.steps.local_steps`: each worker trains its own copy
  (:func:`compjax.local_steps`);
* :mod:`compjax.steps.auto`: candidates timed on the first steps (:func:`compjax.auto`);
* :mod:`compjax.steps.nnx`: Flax NNX's ``nnx.Optimizer`` with per-worker state.

The package re-exports nothing: the step functions are ``compjax.data_parallel`` and so
on, and their classes live in the modules above.
"""
