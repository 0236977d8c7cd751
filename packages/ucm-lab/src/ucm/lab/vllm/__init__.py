"""vLLM with UCM, run for a person or a benchmark: the demos (``python -m
ucm.lab.vllm.demo``, ``demo_cluster``), the engine benchmark (``bench``) and the serving
harness (``serve_process``, ``serve_client``, ``serve_report``, ``multiround``,
``bench_systems``, ``bench_serve``)."""
