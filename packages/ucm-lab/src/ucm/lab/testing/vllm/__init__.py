"""Helpers of ucm-vllm's tests: tiny models, engines in fresh processes, a scheduler driven
by hand, servers."""
