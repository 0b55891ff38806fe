"""msrun_style.py converted to trainerd's callback recipe (trainer.runtime.callback): the same Model.train
data-parallel MLP, changed in five lines only (tests/integration/test_callback_style.py holds it to that):

    + from trainer.runtime.callback import GuardedTrainOneStepCell, TrainerdCallback, resume_epoch, trainerd_dataset
    ~ dataset = trainerd_dataset(dataset, BATCH_SIZE, args.steps_per_epoch)   # was .batch(...).take(...)
    ~ initial_epoch = resume_epoch(dataset)                                     # was 0
    ~ model = Model(GuardedTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer))
    ~ callbacks = [LossMonitor(1), TimeMonitor(), TrainerdCallback(),           # was ModelCheckpoint(...)

Under trainerd it reports progress, saves trainerd's sharded checkpoints, resumes from the one the coordinator
picks at any world size and inside an epoch, reads the seeded sample stream from the checkpoint's position, and
skips and reports bad batches. Its own resume code stays but finds nothing: TrainerdCallback took
ModelCheckpoint's place, and trainerd's checkpoints are the ones resumed from. Run by hand or by msrun it
trains as before, on the sample stream's order, and starts afresh every time.

--output and the flags after it are for the tests only; without them the script does the same.
"""

import argparse
import glob
import os
import time

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init
from mindspore.train import Callback, CheckpointConfig, LossMonitor, Model, ModelCheckpoint, TimeMonitor
from trainer.runtime.callback import GuardedTrainOneStepCell, TrainerdCallback, resume_epoch, trainerd_dataset

DATA_FILE = "data/train.npz"
SAMPLES, FEATURES, HIDDEN, CLASSES = 4096, 32, 64, 4
BATCH_SIZE = 16  # per rank


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--output", help="test only: write the final weights to OUTPUT/final_rank<rank>.npz")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="test only: seconds to sleep after each step")
    parser.add_argument("--raise-at-startup", action="store_true", help="test only: open a missing file first")
    parser.add_argument("--raise-at-step", type=int, help="test only: raise ValueError at this global step ...")
    parser.add_argument("--raise-rank", type=int, default=0, help="test only: ... on this rank (-1: on every rank)")
    return parser.parse_args()


def make_data_file(path=DATA_FILE, seed=0):
    """Seeded synthetic data. Every rank that finds no file writes the same bytes and renames them into
    place, so ranks sharing a working directory and ranks on other hosts read the same data."""
    if os.path.exists(path):
        return
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES))).argmax(axis=1).astype(np.int32)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        np.savez(f, x=x, y=y)
    os.replace(partial, path)


class TrainData:
    """Random access (__getitem__, __len__): GeneratorDataset needs it to shard."""

    def __init__(self, path):
        with np.load(path) as data:
            self.x, self.y = data["x"], data["y"]

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self):
        return len(self.x)


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(FEATURES, HIDDEN)
        self.relu = nn.ReLU()
        self.fc2 = nn.Dense(HIDDEN, CLASSES)

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class TestHooks(Callback):
    """Test only: slow every step down, or fail on one rank (or every rank) at one global step."""

    def __init__(self, rank, step_sleep, raise_at_step, raise_rank):
        super().__init__()
        self.rank, self.step_sleep, self.raise_at_step, self.raise_rank = rank, step_sleep, raise_at_step, raise_rank

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        step = (cb.cur_epoch_num - 1) * cb.batch_num + (cb.cur_step_num - 1) % cb.batch_num + 1
        if self.raise_rank in (self.rank, -1) and step == self.raise_at_step:
            raise ValueError(f"bad value at step {step}")
        time.sleep(self.step_sleep)


def newest_checkpoint(directory):
    files = glob.glob(os.path.join(directory, "*.ckpt"))
    return max(files, key=os.path.getmtime) if files else None


def main():
    args = parse_args()
    if args.raise_at_startup:
        open("config/train.json").close()  # a relative file the job forgot to bring
    ms.set_context(mode=ms.GRAPH_MODE)
    init()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(1)
    rank, world_size = get_rank(), get_group_size()
    if args.steps_per_epoch * BATCH_SIZE * world_size > SAMPLES:
        raise SystemExit(f"--steps-per-epoch {args.steps_per_epoch} needs more than {SAMPLES} samples")

    make_data_file()
    dataset = ds.GeneratorDataset(TrainData(DATA_FILE), ["x", "y"], shuffle=False,
                                  num_shards=world_size, shard_id=rank)
    dataset = trainerd_dataset(dataset, BATCH_SIZE, args.steps_per_epoch)

    net = MLP()
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    ckpt_dir = f"ckpt/rank_{rank}"
    initial_epoch = resume_epoch(dataset)
    latest = newest_checkpoint(ckpt_dir)
    if latest:
        params = ms.load_checkpoint(latest)
        initial_epoch = int(params.pop("epoch_num").asnumpy())
        ms.load_param_into_net(net, params)
        ms.load_param_into_net(optimizer, params)
        print(f"rank {rank}: resuming from {latest} after epoch {initial_epoch}", flush=True)

    model = Model(GuardedTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer))
    config = CheckpointConfig(save_checkpoint_steps=args.steps_per_epoch, keep_checkpoint_max=3,
                              append_info=["epoch_num"])
    callbacks = [LossMonitor(1), TimeMonitor(), TrainerdCallback(),
                 TestHooks(rank, args.step_sleep, args.raise_at_step, args.raise_rank)]
    if initial_epoch < args.epochs:
        model.train(args.epochs, dataset, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=initial_epoch)

    if args.output:
        os.makedirs(args.output, exist_ok=True)
        np.savez(os.path.join(args.output, f"final_rank{rank}.npz"),
                 **{p.name: p.asnumpy() for p in net.trainable_params()})
    print(f"rank {rank}: training finished after epoch {args.epochs}", flush=True)


if __name__ == "__main__":
    main()
