"""Helpers of the tests, one module per library distribution: ``core`` (and ``procs``, the
children of its multi-process tests), ``kernels``, ``fastdeploy``, ``vllm``."""
