"""The parts of ``benchmarks/bench_zero.py``: contenders, training, timing, probes, one run, reports."""
