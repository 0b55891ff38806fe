"""Write the tiny LLaMA's corpus as a MindRecord file: `python make_dataset.py OUT.mindrecord [SAMPLES]`.

Each sample is 33 token ids (sequence 32 plus the shifted label) from a fixed-seed pattern that a model can
learn: a ramp with a random start, so the loss visibly falls.
"""

import sys

import numpy as np
from mindspore.mindrecord import FileWriter


def write(path: str, samples: int = 256, length: int = 33, vocab: int = 128) -> None:
    rng = np.random.default_rng(0)
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.set_page_size(1 << 16)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "tiny_llama")
    rows = [{"input_ids": ((rng.integers(3, vocab) + np.arange(length)) % (vocab - 3) + 3).astype(np.int32)}
            for _ in range(samples)]
    writer.write_raw_data(rows)
    writer.commit()


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256)
