"""The job's data order: one seeded sample stream, split over ranks, with a skip ledger (pure numpy).

`trainer.data.mindspore_sampler` (which imports MindSpore) feeds it to a MindSpore dataset.
"""

from trainer.data.sampler import SampleStream, rank_share
from trainer.data.skip_ranges import SkipRanges

__all__ = ["SampleStream", "SkipRanges", "rank_share"]
