"""trainerd_dataset over the datasets msrun scripts bring: MindSpore's own sources (MnistDataset as in
MindSpore's data-parallel tutorial, ImageFolderDataset, NumpySlicesDataset) with their `.map` transforms,
read in trainerd's sample stream, and what cannot be read that way refused in one line.

Real MindSpore dataset pipelines in this process (world size 1: no communication is initialised here; the
split by rank is EpochSampler's, covered with two ranks by test_callback.py)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import mindspore.dataset as ds
import mindspore.dataset.vision as vision
import numpy as np
import pytest
from PIL import Image

from trainer.checkpoint import CheckpointMeta, CheckpointWriter
from trainer.checkpoint.manifest import EpochPosition
from trainer.data.sampler import SampleStream
from trainer.data.skip_ranges import SkipRanges
from trainer.runtime.elastic_dataset import resume_epoch, trainerd_dataset

SAMPLES = 48
BATCH = 4
STEPS_PER_EPOCH = 6  # of the 12 a pass holds: the epochs are the stream's, not the source's passes


def write_mnist(directory: Path, count: int = SAMPLES) -> Path:
    """MNIST's idx files, image i with i in its first pixel."""
    directory.mkdir(parents=True, exist_ok=True)
    images = np.zeros((count, 28, 28), np.uint8)
    images[:, 0, 0] = np.arange(count)
    (directory / "train-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
    labels = (np.arange(count) % 10).astype(np.uint8)
    (directory / "train-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.tobytes())
    return directory


def write_image_folder(directory: Path) -> Path:
    """Two classes of PNGs; ImageFolderDataset indexes class by class, file by file, so image i (in that
    order) has i in its first pixel."""
    for index in range(SAMPLES):
        kind, position = divmod(index, SAMPLES // 2)
        (directory / f"class_{kind}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 4, 3), index, np.uint8)).save(directory / f"class_{kind}" / f"{position:03d}.png")
    return directory


def mnist(tmp_path: Path) -> ds.Dataset:
    # As MindSpore's data-parallel tutorial shards it for msrun: trainerd_dataset replaces that sharding.
    data = ds.MnistDataset(str(write_mnist(tmp_path / "mnist")), usage="train", shuffle=True, num_shards=2, shard_id=1)
    return data.map(vision.Rescale(1.0, 0.0), "image").map(lambda label: label.astype(np.int32), "label")


def image_folder(tmp_path: Path) -> ds.Dataset:
    data = ds.ImageFolderDataset(str(write_image_folder(tmp_path / "images")), decode=True, shuffle=True)
    return data.map(vision.HWC2CHW(), "image").rename("image", "pixels")


def numpy_slices(tmp_path: Path) -> ds.Dataset:
    images = np.zeros((SAMPLES, 1, 1), np.float32)
    images[:, 0, 0] = np.arange(SAMPLES)
    return ds.NumpySlicesDataset({"image": images, "label": np.arange(SAMPLES)}, shuffle=True).project(["image"])


def first_pixels(dataset: ds.Dataset, epochs: int) -> list[list[int]]:
    """Each epoch's samples, as the number each image carries in its first value."""
    iterator = dataset.create_tuple_iterator(num_epochs=epochs, output_numpy=True)
    return [[int(value) for row in iterator for value in row[0].reshape(row[0].shape[0], -1)[:, 0]]
            for _ in range(epochs)]


def stream_order(steps: int, consumed: int = 0) -> list[int]:
    """The sample stream's indices for `steps` steps of one rank from `consumed` on: what trainerd trains."""
    schedule, _ = SampleStream(SAMPLES, 0, SkipRanges()).rank_indices(consumed, BATCH, 0, 1, steps)
    return [int(index) for index in schedule.ravel()]


@pytest.mark.parametrize("make", [mnist, image_folder, numpy_slices])
def test_a_mindspore_source_with_its_transforms_is_read_in_the_stream_order_epoch_after_epoch(
        make: Callable[[Path], ds.Dataset], tmp_path: Path) -> None:
    original = make(tmp_path)
    before = original.get_dataset_size()

    dataset = trainerd_dataset(original, BATCH, STEPS_PER_EPOCH, environ={})

    assert dataset.get_dataset_size() == STEPS_PER_EPOCH
    assert resume_epoch(dataset) == 0
    order = stream_order(2 * STEPS_PER_EPOCH)
    assert first_pixels(dataset, 2) == [order[:STEPS_PER_EPOCH * BATCH], order[STEPS_PER_EPOCH * BATCH:]]
    # The script's own dataset (its sharding, its shuffle) is left as it was.
    assert original.get_dataset_size() == before


def test_a_resume_inside_an_epoch_continues_the_stream_where_the_checkpoint_stands(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    position = EpochPosition(completed=1, steps_done=2, steps_per_epoch=STEPS_PER_EPOCH)
    step = STEPS_PER_EPOCH + 2
    meta = CheckpointMeta(step, step * BATCH, 0, epoch_position=position)
    step_dir = CheckpointWriter(root, 0, 1).save(meta, {"w": np.zeros(2, np.float32)})
    environ = {"TRAINERD_JOB": "job", "TRAINERD_CHECKPOINT_DIR": str(root), "TRAINERD_RESUME_FROM": str(step_dir)}

    dataset = trainerd_dataset(mnist(tmp_path), BATCH, STEPS_PER_EPOCH, environ=environ)

    assert resume_epoch(dataset) == 1  # Model.train goes on in its second epoch, 2 of its 6 steps done
    rest_of_epoch, next_epoch = first_pixels(dataset, 2)
    assert rest_of_epoch == stream_order(STEPS_PER_EPOCH - 2, consumed=step * BATCH)
    assert next_epoch == stream_order(STEPS_PER_EPOCH, consumed=2 * STEPS_PER_EPOCH * BATCH)


def test_a_sources_num_samples_bounds_the_stream(tmp_path: Path) -> None:
    data = ds.MnistDataset(str(write_mnist(tmp_path / "mnist")), num_samples=20, shuffle=False)
    dataset = trainerd_dataset(data, BATCH, environ={})  # one pass: 20 // 4 steps
    assert dataset.get_dataset_size() == 5
    (epoch,) = first_pixels(dataset, 1)
    assert sorted(epoch) == list(range(20))


def test_the_launchs_batch_split_and_the_sample_count_agree_with_the_source(tmp_path: Path) -> None:
    environ = {"TRAINERD_JOB": "job", "TRAINERD_GLOBAL_BATCH": "8", "TRAINERD_MICRO_BATCH": "4",
               "TRAINERD_GRAD_ACCUM": "2"}
    dataset = trainerd_dataset(mnist(tmp_path), 4, environ=environ)
    assert dataset.get_dataset_size() == SAMPLES // 8  # a row per step: 2 micro batches of 4
    assert [row[0].shape[0] for row in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True)] == [8] * 6


def write_csv(path: Path) -> str:
    path.write_text("x,y\n" + "".join(f"{i},{i % 2}\n" for i in range(SAMPLES)))
    return str(path)


def mind_records(path: Path) -> str:
    from mindspore.mindrecord import FileWriter

    writer = FileWriter(str(path), 1)
    writer.add_schema({"x": {"type": "int64"}}, "records")
    writer.write_raw_data([{"x": i} for i in range(SAMPLES)])
    writer.commit()
    return str(path)


def chained_sampler() -> ds.Sampler:
    sampler = ds.SequentialSampler()
    sampler.add_child(ds.RandomSampler())
    return sampler


def numbers() -> ds.GeneratorDataset:
    return ds.GeneratorDataset([(np.array(i),) for i in range(SAMPLES)], ["x"])


@pytest.mark.parametrize(("make", "says"), [
    (lambda tmp: numbers().batch(BATCH), "got a BatchDataset: call trainerd_dataset before .batch(...)"),
    (lambda tmp: numbers().shuffle(8).map(lambda x: x, "x"), "got a ShuffleDataset: drop .shuffle(...)"),
    (lambda tmp: numbers().repeat(2), "got a RepeatDataset: drop .repeat(...)"),
    (lambda tmp: numbers().take(8), "which a TakeDataset cannot do: give it a GeneratorDataset over a random-access"),
    (lambda tmp: ds.CSVDataset(write_csv(tmp / "data.csv")), "which a CSVDataset cannot do"),
    (lambda tmp: ds.MindDataset(mind_records(tmp / "data.mindrecord")),
     "cannot read a MindDataset: it takes only MindSpore's built-in samplers, which cannot follow trainerd's "
     "sample stream from epoch to epoch; give it a GeneratorDataset whose source reads the records by index, or "
     "batch the dataset yourself and leave trainerd_dataset out: resume_epoch(dataset) then resumes it by step"),
    (lambda tmp: ds.GeneratorDataset(lambda: iter([(np.array(1),)]), ["x"]),
     "needs a GeneratorDataset over a random-access source (__getitem__ and __len__), not over a function"),
    (lambda tmp: ds.GeneratorDataset([(np.array(1),)] * SAMPLES, ["x"], sampler=chained_sampler()),
     "it has a chain of them"),
], ids=["batched", "shuffled", "repeated", "taken", "csv", "mindrecord", "generator_function", "sampler_chain"])
def test_a_dataset_that_cannot_follow_the_stream_is_refused_saying_what_to_change(
        make: Callable[[Path], ds.Dataset], says: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        trainerd_dataset(make(tmp_path), BATCH, environ={})
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)
