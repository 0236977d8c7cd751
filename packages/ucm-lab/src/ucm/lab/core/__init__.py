"""Benchmarks and the demo of ucm-core: ``python -m ucm.lab.core.demo``, ``ucm bench store``."""
