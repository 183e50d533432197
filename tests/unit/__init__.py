"""Unit tests: one process, no process group (docs/design.md, "Tests")."""
