"""End-to-end tests: the command line, the docs' commands, benchmark and training scripts in subprocesses
(docs/design.md, "Tests")."""
