"""MindFormers' runner for training, as run_mindformer.py does it (CPU/test-only; the wheel ships no runner).

`python train_runner.py --config YAML [--register_path DIR] [--run_mode train] [--use_parallel BOOL]`: the
arguments trainerd's launcher and its tests pass, handled as run_mindformer.py handles them (the register
path goes on sys.path and into REGISTER_PATH, which `auto_register` imports from), then MindFormers' own
`build_context` and `Trainer(config).train()`. Run it through run_mindformer_cpu.py.
"""

import argparse
import os
import sys

from mindformers.core.context import build_context
from mindformers.tools.register import MindFormerConfig
from mindformers.tools.utils import str2bool
from mindformers.trainer import Trainer
from mindformers.utils.file_utils import set_output_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--register_path")
    parser.add_argument("--run_mode", default="train")
    parser.add_argument("--use_parallel", type=str2bool)
    args = parser.parse_args()
    if args.register_path is not None:
        os.environ["REGISTER_PATH"] = args.register_path
        if args.register_path not in sys.path:
            sys.path.append(args.register_path)
    config = MindFormerConfig(args.config, run_mode=args.run_mode)
    if args.use_parallel is not None:
        config.use_parallel = args.use_parallel
    set_output_path(config.output_dir)
    build_context(config)
    Trainer(config).train()


if __name__ == "__main__":
    main()
