"""The sample stream fed to real MindSpore datasets (a missing MindSpore fails these tests): a
GeneratorDataset and a MindRecord file, batched by micro batch, yield exactly one rank's samples, also
over several epochs and from a resume point."""

from __future__ import annotations

import mindspore.dataset as ds
import numpy as np
import pytest
from mindspore.mindrecord import FileWriter

from trainer.data import SampleStream, rank_share
from trainer.data.mindspore_sampler import ElasticSampler, elastic_mind_dataset

DATASET_SIZE = 40
SEED = 11
LEDGER = [[3, 9], [47, 60], [100, 101]]
GLOBAL_BATCH, WORLD_SIZE, MICRO_BATCH = 12, 2, 3  # 2 micro batches per rank and step
STEPS = 9  # 9 × 6 samples per rank: more than one pass over the 40 records


class Source:
    """Random access, like a user's dataset: sample i is (i, a feature row that encodes i)."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array(index, dtype=np.int64), np.full(4, index, dtype=np.float32)

    def __len__(self) -> int:
        return DATASET_SIZE


@pytest.fixture(scope="module")
def mindrecord_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("mindrecord") / "samples.mindrecord")
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.add_schema({"index": {"type": "int64"}, "x": {"type": "float32", "shape": [4]}}, "samples")
    writer.write_raw_data([{"index": i, "x": np.full(4, i, dtype=np.float32)} for i in range(DATASET_SIZE)])
    writer.commit()
    return path


def expected_micro_batches(stream: SampleStream, consumed: int, rank: int, steps: int) -> list[list[int]]:
    """This rank's micro batches, computed from the stream one step at a time."""
    batches = []
    for _ in range(steps):
        positions, consumed = stream.step_positions(consumed, GLOBAL_BATCH)
        batches.extend(stream.indices(rank_share(positions, rank, WORLD_SIZE, MICRO_BATCH)).tolist())
    return batches


def read_micro_batches(dataset: ds.Dataset, index_column: str) -> list[list[int]]:
    batches = []
    for row in dataset.batch(MICRO_BATCH).create_dict_iterator(num_epochs=1, output_numpy=True):
        assert np.array_equal(row["x"], np.repeat(row[index_column][:, None], 4, axis=1).astype(np.float32))
        batches.append(row[index_column].tolist())
    return batches


@pytest.mark.parametrize("consumed", [0, 31])
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_generator_dataset_yields_the_ranks_micro_batches(rank: int, consumed: int) -> None:
    stream = SampleStream(DATASET_SIZE, SEED, LEDGER)
    sampler = ElasticSampler(stream, consumed, GLOBAL_BATCH, rank, WORLD_SIZE, STEPS)
    dataset = ds.GeneratorDataset(Source(), ["index", "x"], sampler=sampler)
    assert read_micro_batches(dataset, "index") == expected_micro_batches(stream, consumed, rank, STEPS)
    assert sampler.next_consumed == stream.rank_indices(consumed, GLOBAL_BATCH, rank, WORLD_SIZE, STEPS)[1]


@pytest.mark.parametrize("consumed", [0, 31])
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_mindrecord_dataset_yields_the_ranks_micro_batches(mindrecord_file: str, rank: int, consumed: int) -> None:
    stream = SampleStream(DATASET_SIZE, SEED, LEDGER)
    dataset = elastic_mind_dataset(mindrecord_file, stream, consumed, GLOBAL_BATCH, rank, WORLD_SIZE, STEPS)
    assert read_micro_batches(dataset, "index") == expected_micro_batches(stream, consumed, rank, STEPS)


def test_a_resumed_sampler_continues_where_the_checkpoint_stopped(mindrecord_file: str) -> None:
    stream = SampleStream(DATASET_SIZE, SEED, LEDGER)
    whole = ElasticSampler(stream, 0, GLOBAL_BATCH, 1, WORLD_SIZE, STEPS)
    first = ElasticSampler(stream, 0, GLOBAL_BATCH, 1, WORLD_SIZE, 4)
    rest = ElasticSampler(SampleStream(DATASET_SIZE, SEED, LEDGER), first.next_consumed, GLOBAL_BATCH, 1,
                          WORLD_SIZE, STEPS - 4)
    assert list(first) + list(rest) == list(whole)
    resumed = elastic_mind_dataset(mindrecord_file, stream, first.next_consumed, GLOBAL_BATCH, 1, WORLD_SIZE,
                                   STEPS - 4, columns_list=["index", "x"])
    assert sum(read_micro_batches(resumed, "index"), []) == list(rest)


def test_no_steps_is_refused_before_mindspore_sees_it(mindrecord_file: str) -> None:
    stream = SampleStream(DATASET_SIZE, SEED)
    with pytest.raises(ValueError, match="at least one step"):
        ElasticSampler(stream, 0, GLOBAL_BATCH, 0, WORLD_SIZE, 0)
    with pytest.raises(ValueError, match="at least one step"):  # an empty SubsetSampler crashes MindSpore 2.10
        elastic_mind_dataset(mindrecord_file, stream, 0, GLOBAL_BATCH, 0, WORLD_SIZE, 0)
