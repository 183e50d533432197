"""The ZeRO core: flat shards, gradient reduction, sharded optimizers and stage 3, on torch alone (docs/design.md).

Its folders, each naming its public pieces in its ``__init__``: ``zero`` (ZeRO 0-2 partitioning and the engine),
``stage3`` (parameter sharding), ``offload`` (where shards live), ``precision`` (fp16 / bf16), ``comm``
(collectives, 1-bit Adam), ``reliability`` (agreement, heartbeat) and ``mesh`` (the device mesh).
Nothing is imported here: any import below ``lightning_zero.core`` runs this file first, and naming the folders'
pieces here would load every mechanism for any one of them.
"""
