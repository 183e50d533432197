"""ZeRO stage 3: parameters as 1/N shards, gathered one unit at a time, torch only.

Public pieces: ``apply_stage3`` / ``Stage3Runtime`` (``runtime``), ``gathered_parameters`` (``gathered``). Units are
chosen in ``units``, held in ``sharded_unit``, their gathered memory reused by ``gather_pool``; meta-device
construction (``materialize``), streamed loading (``loading``), activation recomputation
(``activation_checkpointing``) and the end-of-fit gather (``teardown``) complete it.
"""
