"""ZeRO partitioning (stages 0-2, and the engine every stage runs in): torch only.

Public pieces: ``ZeroConfig``, ``DtypePolicy``, ``ZeroStage``, ``NonFinitePolicy`` (``config``), ``ZeroEngine``
(``engine``), ``ModelStateBytes``, ``model_state_formula`` (``memory``). The flat sharded buffer is ``flat_param``;
the gradient hooks and buckets ``grad_reducer``; the optimizer re-pointed at shards ``optimizer`` / ``optimizer_state``.
"""
