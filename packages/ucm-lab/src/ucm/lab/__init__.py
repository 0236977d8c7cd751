"""The project's harness, kept out of the library wheels and never published: benchmarks,
demos, the serving harness, the network lab, Mooncake's daemons, and the helpers and
pytest plugin every package's tests share.

- ``ucm.lab.core``, ``ucm.lab.kernels``, ``ucm.lab.fastdeploy``, ``ucm.lab.vllm``: the
  benchmarks and demos of each library distribution (``python -m ucm.lab.vllm.demo``);
- ``ucm.lab.daemon``, ``ucm.lab.mooncake``, ``ucm.lab.netlab``: processes of ours on a
  port, Mooncake's master and segment server, hosts as network namespaces;
- ``ucm.lab.testing``: the tests' helpers, one module per library distribution;
- ``ucm.lab.pytest_plugin``: markers and shared fixtures (loaded by pytest through the
  ``pytest11`` entry point);
- ``ucm.lab.cli``: ``ucm bench``.
"""
