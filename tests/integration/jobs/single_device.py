"""A script for one device, as a MindSpore user writes it before any distributed training: no
`mindspore.communication.init()`, `Model.train` with LossMonitor and ModelCheckpoint into ./ckpt. It knows
nothing of trainerd. Each process that runs it appends its pid and MS_ROLE to ./runs.txt (test only)."""

import argparse
import os
import time

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.train import Callback, CheckpointConfig, LossMonitor, Model, ModelCheckpoint


class Pause(Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_step_end(self, run_context):
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    with open("runs.txt", "a") as runs:
        runs.write(f"{os.getpid()} {os.environ.get('MS_ROLE', '-')}\n")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((320, 8)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(16)
    net = nn.Dense(8, 1)
    model = Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.01, 0.9))
    model.train(args.epochs, data, dataset_sink_mode=False,
                callbacks=[LossMonitor(), Pause(args.step_sleep),
                           ModelCheckpoint("net", "ckpt", CheckpointConfig(save_checkpoint_steps=20))])
    print("finished", flush=True)


if __name__ == "__main__":
    main()
