"""A training loop of the script's own (MindSpore's functional style) written with TrainerdLoop, for the tests:
callback_job.py's MLP and data, trained with value_and_grad and an optimizer call per batch.

    python tests/trainer/loop_job.py --epochs 3 --steps-per-epoch 4 --output OUT

Runs by hand (one process) or as one rank of a cluster (MS_ROLE set: it joins with init(), data parallel, the
gradients averaged by DistributedGradReducer). Its updates go through the loop's bad-batch guard. Test hooks:
--samples-file writes, per step, the first value of every sample this rank trained on (which samples each
epoch read); --nan-step makes the samples of that step NaN (callback_job.py's hook); --own-dataset reads the
samples in order and batches them itself, without trainerd_dataset; --valid runs a validation pass after every
epoch, through loop.evaluating.
"""

import argparse
import os
from pathlib import Path

import mindspore as ms
import mindspore.dataset as ds
from callback_job import (  # the same directory: sys.path[0] when run as a script
    BATCH_SIZE,
    MLP,
    TrainData,
    join_cluster,
    nan_indices,
)
from mindspore import nn

from trainer.examples.final_weights import save_weights
from trainer.runtime.loop import TrainerdLoop, trainerd_dataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=4)
    parser.add_argument("--output", help="write the final weights to OUTPUT/final_rank<rank>.npz")
    parser.add_argument("--samples-file", help="test only: append each step's samples (first feature) here")
    parser.add_argument("--nan-step", type=int, help="test only: the samples of this step are NaN")
    parser.add_argument("--own-dataset", action="store_true",
                        help="batch the dataset itself (in order, no trainerd_dataset), as a MindDataset pipeline would")
    parser.add_argument("--valid", action="store_true", help="measure the accuracy on a validation set every epoch")
    return parser.parse_args()


def main():
    args = parse_args()
    rank, world_size = join_cluster()

    bad = nan_indices(args.nan_step, 0, world_size) if args.nan_step else ()
    dataset = ds.GeneratorDataset(TrainData(bad), ["x", "y"], shuffle=not args.own_dataset)
    if args.own_dataset:
        dataset = dataset.take(args.steps_per_epoch * BATCH_SIZE).batch(BATCH_SIZE, drop_remainder=True)
    else:
        dataset = trainerd_dataset(dataset, BATCH_SIZE, args.steps_per_epoch)
    net = MLP()
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)
    reducer = nn.DistributedGradReducer(optimizer.parameters) if "MS_ROLE" in os.environ else None

    with TrainerdLoop(dataset, net, optimizer) as loop:
        for epoch, batches in loop.epochs(args.epochs):
            for x, y in batches:
                loss, grads = grad_fn(x, y)
                grads = reducer(grads) if reducer is not None else grads
                if loop.accepts(grads):
                    optimizer(grads)
                loop.step_ended(loss)
                if args.samples_file:
                    with open(args.samples_file, "a") as samples:
                        samples.write(f"{epoch} {' '.join(f'{v:.6f}' for v in x.asnumpy()[:, 0])}\n")
                print(f"epoch: {epoch}, loss is {loss}", flush=True)
            if args.valid:
                valid = ds.GeneratorDataset(TrainData(()), ["x", "y"], shuffle=False).take(64).batch(BATCH_SIZE)
                right = sum(int((net(x).argmax(1) == y).sum().asnumpy())
                            for x, y in loop.evaluating(valid.create_tuple_iterator()))
                print(f"epoch {epoch}: validation accuracy {right / 64:.3f}", flush=True)

    if args.output:
        save_weights(net, Path(args.output) / f"final_rank{rank}.npz")
    print(f"rank {rank}: training finished after epoch {args.epochs}", flush=True)


if __name__ == "__main__":
    main()
