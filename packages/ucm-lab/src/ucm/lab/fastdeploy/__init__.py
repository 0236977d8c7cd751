"""Benchmarks of ucm-fastdeploy: ``python -m ucm.lab.fastdeploy.bench``."""
