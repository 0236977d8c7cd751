"""Benchmarks of ucm-kernels: ``python -m ucm.lab.kernels.bench``."""
