"""The ZeRO core: flat shards, gradient reduction, sharded optimizers and stage 3, on torch alone (docs/design.md)."""
