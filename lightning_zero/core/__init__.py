"""The ZeRO core: flat shards, gradient reduction, sharded optimizers and stage 3, on torch alone (docs/design.md).

Its folders, in their one order (each imports only the ones before it: ``tests/unit/test_import_graph.py``):
``common`` (the leaf everything shares: the enums, the flat buffer, byte counts), ``settings`` (the frozen
settings tree), ``mesh`` (the device mesh), ``reliability`` (progress record, heartbeat), ``comm`` (collectives,
setup agreement, 1-bit Adam), ``precision`` (fp16 / bf16), ``stage3`` (parameter sharding), ``offload`` (where
shards live) and ``zero`` (the engine, which composes them all). Each names its public pieces in its ``__init__``.
Nothing is imported here: any import below ``lightning_zero.core`` runs this file first, and naming the folders'
pieces here would load every mechanism for any one of them.
"""
