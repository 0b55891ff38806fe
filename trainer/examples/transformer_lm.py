"""trainerd's Transformer example: a small causal language model trained with `Model.train` and one callback.

    python -m trainer.examples.transformer_lm --steps 300          # by hand: one standalone process

A character-level GPT-style model (token and position embeddings, 2 pre-LayerNorm blocks of causal
self-attention and an MLP, the output head tied to the token embedding; about 110k parameters) learns the
corpus `trainer.examples.tiny_corpus` makes: nothing is downloaded. AdamW, with the learning rate rising
linearly over --warmup-steps and then falling along a cosine to a tenth of its peak at --steps.

It is written as a MindSpore user writes a `Model.train` script, plus trainerd's recipe
(`trainer.runtime.callback`): `trainerd_dataset` in place of `.batch(...)`, `resume_epoch(dataset)` as the
initial epoch, `GuardedTrainOneStepCell` in place of `nn.TrainOneStepCell`, and `TrainerdCallback()` among
the callbacks. Under trainerd it then reports step, loss and gradient norm, saves sharded checkpoints and
resumes from them at any world size, reads exactly the samples an uninterrupted run would (a resume at the
same world size ends bit-identical to a run without the fault), and skips a bad batch's update on every
rank alike, reporting it for the skip ledger.

A sample is a window of --seq-len characters of the corpus, its targets the window shifted by one, and a
loss mask (1.0 per character). For tests and demos, --bad-samples and --spike-samples make the loss mask of
the samples at those stream positions NaN or 20 (a NaN loss, or a loss and gradients 20 times too large);
they must lie in the first pass over the corpus, where a position reads a window no other position reads.

Exit status 2 with one line for a usage error; a checkpoint that cannot be resumed ends the process as
`TrainerdCallback` documents.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import mindspore as ms
import mindspore.dataset as ds
import numpy as np
from mindspore import nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.train import Callback, Model, RunContext

from proto.exit_codes import EXIT_OK, EXIT_USAGE
from proto.launch_env import MICRO_BATCH_ENV
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.examples import tiny_corpus
from trainer.examples.faults import CorruptGradientAt, GradientCorruption, WithGradientFault
from trainer.examples.final_weights import save_weights
from trainer.examples.slow_start import slow_start
from trainer.runtime import communication
from trainer.runtime.callback import GuardedTrainOneStepCell, TrainerdCallback, resume_epoch, trainerd_dataset
from trainer.runtime.communication import CommunicationError
from trainer.runtime.rank_context import RankContext, RankContextError

log = logging.getLogger("trainer.examples.transformer_lm")

SEQ_LEN, D_MODEL, HEADS, LAYERS = 32, 64, 4, 2
CORPUS_CHARACTERS = 200_000
DEFAULT_GLOBAL_BATCH = 48


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.examples.transformer_lm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to run")
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="Model.train's epoch; divides --steps")
    parser.add_argument("--micro-batch", type=int, help="samples per forward pass on one rank (default: "
                        f"{MICRO_BATCH_ENV}, else {DEFAULT_GLOBAL_BATCH}, the whole batch)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the sample order")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100, help="steps of linear warm-up")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on matrices only")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps (rank 0)")
    parser.add_argument("--output", type=Path, help="directory where rank r writes final_rank{r}.npz")
    parser.add_argument("--bad-samples", type=sample_ranges, default=(), metavar="A:B[,C:D...]",
                        help="test data: the samples at these stream positions have a NaN loss mask")
    parser.add_argument("--spike-samples", type=sample_ranges, default=(), metavar="A:B[,C:D...]",
                        help="test data: the samples at these stream positions have their loss scaled by 20")
    parser.add_argument("--corrupt-grad", type=GradientCorruption.parse, metavar="RANK:STEP",
                        help="test fault: rank RANK's gradients of step STEP are multiplied by 1e4, once, in the "
                        "first generation (a flaky device)")
    parser.add_argument("--slow-start", type=slow_start, metavar="RANK:SECONDS",
                        help="test timing: this rank sleeps before its first step, in the first generation only")
    args = parser.parse_args(argv)
    for flag in ("steps", "steps_per_epoch", "log_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.steps % args.steps_per_epoch:
        parser.error(f"--steps {args.steps} is not a multiple of --steps-per-epoch {args.steps_per_epoch}")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error("--micro-batch must be at least 1")
    if args.warmup_steps < 0:
        parser.error("--warmup-steps must be at least 0")
    return args


def sample_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """`A:B,C:D` as half-open ranges of sample positions."""
    try:
        return SkipRanges.of(tuple(int(n) for n in part.split(":", 1)) for part in text.split(",")).ranges
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B[,C:D...] with 0 <= A < B ({exc})") from None


# ---------------------------------------------------------------- the data

class CorpusWindows:
    """Random access to the corpus's windows: sample i is (tokens[i:i+T], tokens[i+1:i+T+1], loss mask)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.mask_scale: dict[int, float] = {}  # test data: window -> its loss mask's value

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window = self.tokens[index:index + self.seq_len + 1]
        mask = np.full(self.seq_len, self.mask_scale.get(int(index), 1.0), dtype=np.float32)
        return window[:-1], window[1:], mask

    def __len__(self) -> int:
        return len(self.tokens) - self.seq_len

    def inject(self, stream: SampleStream, ranges: tuple[tuple[int, int], ...], scale: float) -> None:
        """Give the windows that these stream positions read a loss mask of `scale`."""
        for start, end in ranges:
            if end > len(self):
                raise ValueError(f"test samples {start}:{end} go past the first pass over the corpus ({len(self)})")
            for index in stream.indices(np.arange(start, end)):
                self.mask_scale[int(index)] = scale


# ---------------------------------------------------------------- the model

class CausalSelfAttention(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Dense(D_MODEL, 3 * D_MODEL)
        self.out = nn.Dense(D_MODEL, D_MODEL)
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.mix = ops.BatchMatMul()
        self.softmax = nn.Softmax(axis=-1)
        self.scale = 1.0 / math.sqrt(D_MODEL // HEADS)
        self.mask = ms.Tensor(np.triu(np.full((SEQ_LEN, SEQ_LEN), -1e9, np.float32), k=1))  # no look ahead

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        batch, length, width = x.shape
        # (batch, heads, length, head width) each; a split, not indexing: on CPU that is 3 times faster
        q, k, v = (part.reshape(batch, length, HEADS, width // HEADS).transpose(0, 2, 1, 3)
                   for part in ops.split(self.qkv(x), width, axis=-1))
        weights = self.softmax(self.scores(q, k) * self.scale + self.mask)
        return self.out(self.mix(weights, v).transpose(0, 2, 1, 3).reshape(batch, length, width))


class QuickGELU(nn.Cell):
    """x · sigmoid(1.702 x), GELU's sigmoid approximation: on CPU 7 times faster than nn.GELU."""

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return x * ops.sigmoid(1.702 * x)


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm((D_MODEL,))
        self.attention = CausalSelfAttention()
        self.norm2 = nn.LayerNorm((D_MODEL,))
        self.mlp = nn.SequentialCell(nn.Dense(D_MODEL, 4 * D_MODEL), QuickGELU(), nn.Dense(4 * D_MODEL, D_MODEL))

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Cell):
    """tokens (batch, SEQ_LEN) int32 -> next-token logits (batch × SEQ_LEN, vocab)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, D_MODEL, embedding_table=Normal(0.02))
        self.position = ms.Parameter(initializer(Normal(0.02), (SEQ_LEN, D_MODEL), ms.float32), name="position")
        self.blocks = nn.CellList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm((D_MODEL,))
        self.head = ops.MatMul(transpose_b=True)  # tied: logits = h · embeddingᵀ

    def construct(self, tokens: ms.Tensor) -> ms.Tensor:
        x = self.embedding(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).reshape(-1, D_MODEL), self.embedding.embedding_table)


class MaskedLMLoss(nn.Cell):
    """The network with its loss: the mean over tokens of cross-entropy × loss mask."""

    def __init__(self, network: nn.Cell) -> None:
        super().__init__(auto_prefix=False)
        self.network = network
        self.cross_entropy = nn.CrossEntropyLoss(reduction="none")

    def construct(self, tokens: ms.Tensor, targets: ms.Tensor, loss_mask: ms.Tensor) -> ms.Tensor:
        losses = self.cross_entropy(self.network(tokens), targets.reshape(-1))
        return ops.mean(losses * loss_mask.reshape(-1))


class WarmupCosine(nn.learning_rate_schedule.LearningRateSchedule):
    """Linear warm-up to `peak` over `warmup` steps, then a cosine down to peak / 10 at `total` steps."""

    def __init__(self, peak: float, warmup: int, total: int) -> None:
        super().__init__()
        self.peak = ms.Tensor(peak, ms.float32)
        self.warmup = ms.Tensor(max(warmup, 1), ms.float32)
        self.decay_steps = ms.Tensor(max(total - warmup, 1), ms.float32)
        self.floor = ms.Tensor(peak / 10, ms.float32)
        self.pi = ms.Tensor(math.pi, ms.float32)
        self.one = ms.Tensor(1.0, ms.float32)

    def construct(self, global_step: ms.Tensor) -> ms.Tensor:
        step = ops.cast(global_step, ms.float32)
        rising = self.peak * (step + 1) / self.warmup
        progress = ops.minimum((step - self.warmup) / self.decay_steps, self.one)
        falling = self.floor + (self.peak - self.floor) * 0.5 * (1 + ops.cos(self.pi * progress))
        return ops.select(step < self.warmup, rising, falling)


def adamw(network: nn.Cell, args: argparse.Namespace) -> nn.Optimizer:
    params = network.trainable_params()
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return nn.AdamWeightDecay(groups, learning_rate=WarmupCosine(args.lr, args.warmup_steps, args.steps))


class PrintLoss(Callback):
    """Rank 0 prints the step, loss and gradient norm every `every` steps, and whether the step was skipped."""

    def __init__(self, rank: int, every: int) -> None:
        super().__init__()
        self.rank, self.every = rank, every
        self.started = time.perf_counter()

    def on_train_step_end(self, run_context: RunContext) -> None:
        cb = run_context.original_args()
        loss, norm, accepted = (float(t.asnumpy()) for t in cb.net_outputs)
        if self.rank == 0 and (cb.cur_step_num % self.every == 0 or not accepted):
            per_step = (time.perf_counter() - self.started) / self.every * 1e3
            print(f"step {cb.cur_step_num}: loss {loss:.4f} grad norm {norm:.3f}"
                  f"{'' if accepted else ' SKIPPED'} ({per_step:.1f} ms/step)", flush=True)
            self.started = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx = RankContext.from_environ()
        communication.initialize(ctx, "CPU")  # the scheduler process never returns from here
    except (RankContextError, CommunicationError, ValueError) as exc:
        print(f"transformer_lm: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rank = ctx.rank or 0
    micro_batch = args.micro_batch or (ctx.batch.micro_batch if ctx.batch else DEFAULT_GLOBAL_BATCH)

    ms.set_seed(args.seed)  # the same seed on every rank: identical initial weights
    text = tiny_corpus.corpus_text(CORPUS_CHARACTERS)
    vocab = tiny_corpus.vocabulary(text)
    windows = CorpusWindows(tiny_corpus.encode(text, vocab), SEQ_LEN)
    try:
        stream = SampleStream(len(windows), args.seed)
        windows.inject(stream, args.bad_samples, math.nan)
        windows.inject(stream, args.spike_samples, 20.0)
        dataset = ds.GeneratorDataset(windows, ["tokens", "targets", "loss_mask"], shuffle=False)
        dataset = trainerd_dataset(dataset, micro_batch, args.steps_per_epoch, seed=args.seed)
    except ValueError as exc:
        print(f"transformer_lm: {exc}", file=sys.stderr)
        return EXIT_USAGE

    network = TransformerLM(len(vocab))
    callbacks = [TrainerdCallback(), PrintLoss(rank, args.log_every)]
    if args.corrupt_grad is None:
        train_network = GuardedTrainOneStepCell(MaskedLMLoss(network), adamw(network, args))
    else:
        faulty = WithGradientFault(network)
        train_network = GuardedTrainOneStepCell(MaskedLMLoss(faulty), adamw(network, args))
        callbacks.append(CorruptGradientAt(faulty.fault, args.corrupt_grad, ctx.rank, ctx.generation))
    model = Model(train_network)
    epochs = args.steps // args.steps_per_epoch
    initial_epoch = resume_epoch(dataset)
    log.info("rank %d of %d: %d parameters, vocabulary of %d characters, %d windows of %d; epochs %d to %d of %d "
             "steps", rank, ctx.world_size, sum(p.size for p in network.trainable_params()), len(vocab),
             len(windows), SEQ_LEN, initial_epoch + 1, epochs, args.steps_per_epoch)
    if args.slow_start is not None:
        args.slow_start.wait_before_first_step(ctx)
    if initial_epoch < epochs:
        model.train(epochs, dataset, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=initial_epoch)
    if args.output is not None:
        save_weights(network, args.output / f"final_rank{rank}.npz")
    log.info("rank %d: finished", rank)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
