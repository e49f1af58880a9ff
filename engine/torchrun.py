"""torchrun entry point: rank 0 runs the `engine` command (serve or generate) and drives the
replica; every other rank follows it. Ranks are laid out stage-major (rank = stage x tp +
tp_rank), so with --nproc-per-node equal to tensor_parallel_size each node holds whole stages
and the TP all-reduces stay inside a node.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        -m engine.torchrun serve --model /models/llama \\
        --tensor-parallel-size 2 --pipeline-parallel-size 2
"""

from __future__ import annotations

import logging
import os
import sys

from engine.distributed.layout import TORCHRUN_ENV, launched_by_torchrun


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not launched_by_torchrun():
        print(f"engine.torchrun runs under torchrun, which sets {', '.join(TORCHRUN_ENV)}; "
              "on one node, plain `engine serve --tensor-parallel-size N` starts its ranks itself", file=sys.stderr)
        return 2
    from engine.cli import build_parser, main as engine_main

    if int(os.environ["RANK"]) == 0:
        return engine_main(argv)
    from engine.arg_utils import engine_config_from_args
    from engine.distributed.layout import check_layout
    from engine.executor.worker import worker_main
    from engine.loading.loader import source_for

    args = build_parser().parse_args(argv)
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    config = engine_config_from_args(args)
    source = source_for(config)
    layout = check_layout(config, source.hf_config)
    worker_main(rank, layout, config, "env://", int(os.environ["LOCAL_RANK"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
