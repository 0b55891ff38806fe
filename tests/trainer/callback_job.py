"""A Model.train job written with trainerd's callback recipe, for the tests: a small MLP on synthetic data.

    python tests/trainer/callback_job.py --epochs 3 --steps-per-epoch 4 --output OUT

Runs by hand (one process) or as one rank of a cluster (MS_ROLE set: it joins with init(), data parallel).
The flags after --output are test hooks: --nan-step makes the samples one rank reads at that step NaN
(computed from trainerd's sample stream, which the dataset reads in the same order), --trace writes
the weights after every step, --from-epoch-0 forgets to tell Model.train where a resume continues,
--fit-valid trains with Model.fit and a validation set evaluated after every epoch, --eval-callback evaluates
it with Model.eval in a callback of the script's own after every epoch (as ModelZoo's EvalCallBack does) and
once more after training, --own-dataset reads the
samples in order and batches them itself, without trainerd_dataset, and
--sharded-table adds a parameter cut over the ranks along dimension 0, with the layout tensor parallel would
give it in the train network's parameter_layout_dict (the CPU cannot run tensor parallel itself).
"""

import argparse
import os

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn
from mindspore.communication import get_rank, init
from mindspore.train import Accuracy, Callback, LossMonitor, Model

from trainer.data import SampleStream, rank_share
from trainer.runtime.callback import GuardedTrainOneStepCell, TrainerdCallback, resume_epoch, trainerd_dataset

SAMPLES, FEATURES, HIDDEN, CLASSES = 4096, 32, 64, 4
BATCH_SIZE = 16  # per rank and micro batch
TABLE_SHAPE = (8, 6)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument("--output", help="write the final weights to OUTPUT/final_rank<rank>.npz")
    parser.add_argument("--nan-step", type=int, help="test only: the samples of this step ...")
    parser.add_argument("--nan-rank", type=int, default=0, help="test only: ... that this rank reads are NaN")
    parser.add_argument("--trace", help="test only: write the weights after step s to TRACE/rank<rank>_step<s>.npz")
    parser.add_argument("--from-epoch-0", action="store_true", help="test only: start Model.train at epoch 0 always")
    parser.add_argument("--own-dataset", action="store_true",
                        help="batch the dataset itself (in order, no trainerd_dataset), as a MindDataset pipeline would")
    parser.add_argument("--fit-valid", action="store_true",
                        help="train with Model.fit, evaluating the accuracy on a validation set after every epoch")
    parser.add_argument("--eval-callback", action="store_true",
                        help="evaluate with model.eval in a callback of the script's own after every epoch")
    parser.add_argument("--sharded-table", choices=["arange", "zeros"],
                        help="test only: a parameter 'table', this rank's rows of arange(48).reshape(8, 6) or zeros")
    parser.add_argument("--table-field-size", type=int, default=0, help="test only: the field_size of its layout")
    return parser.parse_args()


class TrainData:
    def __init__(self, nan_indices=()):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
        self.y = (self.x @ rng.standard_normal((FEATURES, CLASSES))).argmax(axis=1).astype(np.int32)
        self.x[list(nan_indices)] = np.nan

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self):
        return SAMPLES


def nan_indices(step, rank, world_size):
    """The dataset indices rank `rank` reads at `step` (the run stays within one pass over the data)."""
    global_batch = int(os.environ.get("TRAINERD_GLOBAL_BATCH", BATCH_SIZE * world_size))
    positions, _ = SampleStream(SAMPLES, 0).step_positions((step - 1) * global_batch, global_batch)
    return SampleStream(SAMPLES, 0).indices(rank_share(positions, rank, world_size, BATCH_SIZE)).ravel()


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(FEATURES, HIDDEN)
        self.relu = nn.ReLU()
        self.fc2 = nn.Dense(HIDDEN, CLASSES)

    def construct(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class Trace(Callback):
    def __init__(self, directory, rank, net):
        super().__init__()
        self.directory, self.rank, self.net = directory, rank, net

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        np.savez(os.path.join(self.directory, f"rank{self.rank}_step{step}.npz"),
                 **{p.name: p.asnumpy() for p in self.net.trainable_params()})


class EvalCallBack(Callback):
    """ModelZoo's way to evaluate while training: model.eval in epoch_end, with no callbacks of its own."""

    def __init__(self, model, dataset):
        super().__init__()
        self.model, self.dataset = model, dataset

    def on_train_epoch_end(self, run_context):
        epoch = run_context.original_args().cur_epoch_num
        print(f"epoch {epoch}: eval {self.model.eval(self.dataset, dataset_sink_mode=False)}", flush=True)


def join_cluster():
    """Graph mode, data parallel in a cluster when launched as one of its ranks (MS_ROLE set), the seed;
    returns (rank, world size)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    rank, world_size = 0, int(os.environ.get("MS_WORKER_NUM", "1"))
    if "MS_ROLE" in os.environ:
        init()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        rank = get_rank()
    ms.set_seed(1)
    return rank, world_size


def main():
    args = parse_args()
    rank, world_size = join_cluster()

    bad = nan_indices(args.nan_step, args.nan_rank, world_size) if args.nan_step else ()
    dataset = ds.GeneratorDataset(TrainData(bad), ["x", "y"], shuffle=not args.own_dataset)
    if args.own_dataset:
        dataset = dataset.take(args.steps_per_epoch * BATCH_SIZE).batch(BATCH_SIZE, drop_remainder=True)
    else:
        dataset = trainerd_dataset(dataset, BATCH_SIZE, args.steps_per_epoch)

    net = MLP()
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    train_cell = GuardedTrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer)
    if args.sharded_table:
        rows = TABLE_SHAPE[0] // world_size
        table = np.arange(np.prod(TABLE_SHAPE), dtype=np.float32).reshape(TABLE_SHAPE)[rank * rows:(rank + 1) * rows]
        net.table = ms.Parameter(ms.Tensor(table if args.sharded_table == "arange" else np.zeros_like(table)),
                                 name="table", requires_grad=False)
        train_cell.parameter_layout_dict = {
            "table": ([world_size], [0, -1], [rows, TABLE_SHAPE[1]], args.table_field_size, True, "")}
    callbacks = [TrainerdCallback(), LossMonitor(1)]
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        callbacks.append(Trace(args.trace, rank, net))
    initial_epoch = 0 if args.from_epoch_0 else resume_epoch(dataset)
    if args.fit_valid or args.eval_callback:
        model = Model(train_cell, eval_network=nn.WithEvalCell(net, loss_fn), eval_indexes=[0, 1, 2],
                      metrics={"accuracy": Accuracy()})
        valid = ds.GeneratorDataset(TrainData(()), ["x", "y"], shuffle=False).take(64).batch(BATCH_SIZE)
        if initial_epoch < args.epochs and args.fit_valid:
            model.fit(args.epochs, dataset, valid, callbacks=callbacks, initial_epoch=initial_epoch)
        elif initial_epoch < args.epochs:
            model.train(args.epochs, dataset, callbacks=[*callbacks, EvalCallBack(model, valid)],
                        initial_epoch=initial_epoch)
        if args.eval_callback:
            print(f"after training: eval {model.eval(valid)}", flush=True)
    else:
        model = Model(train_cell)
        if initial_epoch < args.epochs:
            model.train(args.epochs, dataset, callbacks=callbacks, initial_epoch=initial_epoch)

    if args.output:
        os.makedirs(args.output, exist_ok=True)
        np.savez(os.path.join(args.output, f"final_rank{rank}.npz"),
                 **{p.name: p.asnumpy() for p in net.trainable_params()})
        if args.sharded_table:
            np.save(os.path.join(args.output, f"table_rank{rank}.npy"), net.table.asnumpy())
    print(f"rank {rank}: training finished after epoch {args.epochs}", flush=True)


if __name__ == "__main__":
    main()
