"""Distributed tests: several ranks, in the shared 2-rank gloo pool or spawned (docs/design.md, "Tests")."""
