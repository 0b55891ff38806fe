"""Model.train's epochs and the dataset's, decided without MindSpore: what TrainerdCallback refuses at a job's
first start, warns of, and mends itself at a resume, so that no resume fails for what was knowable at the start.

Model.train counts its epochs from `initial_epoch` (its loop variable: no callback can change it), and runs
`epoch - initial_epoch` of them; the dataset, resumed from trainerd's checkpoint, is in the epoch that
checkpoint reached. They agree when the script passes `initial_epoch=resume_epoch(dataset)`. When they do not:

- Model.train behind the dataset (it starts at epoch 1, or at the epoch of a checkpoint of the script's own,
  older than trainerd's) is mended when the dataset was positioned for the resume (by `trainerd_dataset`, or by
  `resume_epoch`, whose result the script then replaced): the callback renumbers Model.train's epochs as the
  dataset's and stops it after its last epoch, which it would otherwise pass.
- Model.train ahead of the dataset (a checkpoint of the script's own newer than trainerd's) would end before the
  dataset's epochs do, which no callback can extend: refused. It can only happen to a script that resumes from
  checkpoints of its own, which a ModelCheckpoint beside TrainerdCallback is warned of at the first start.
- A dataset of the script's own that resume_epoch never saw is not positioned at a resume: it would read its
  epoch from the start while trainerd's checkpoint is inside it. Model.train running more than one epoch of it
  is refused at the first start, where the user watches, not at the first resume after its first epoch.
"""

from __future__ import annotations

# The attribute resume_epoch leaves on the dataset it was asked about: the epoch it returned.
RESUME_EPOCH_MARK = "_trainerd_resume_epoch"

RESUME_EPOCH_ADVICE = "pass initial_epoch=resume_epoch(dataset) to Model.train"


def unpositioned_dataset_refusal(epochs_in_call: int, positioned: bool, epochs_known: bool) -> str | None:
    """Why a Model.train call running `epochs_in_call` epochs must not start, None when it may: a dataset
    neither trainerd_dataset nor resume_epoch positioned cannot resume after the call's first epoch."""
    if positioned or not epochs_known or epochs_in_call <= 1:
        return None
    return (f"Model.train runs {epochs_in_call} epochs of a dataset resume_epoch did not position, so a resume "
            f"after its first epoch could not go on where it stopped: {RESUME_EPOCH_ADVICE}")


def epoch_shift(model_epoch: int, dataset_epoch: int, positioned: bool) -> int | None:
    """How many epochs the dataset is ahead of Model.train when Model.train begins `model_epoch` and the dataset
    is in `dataset_epoch`: 0 when they agree, more when the callback can renumber Model.train's epochs (the
    dataset is positioned, and Model.train has as many epochs left as the dataset or more); None when they
    cannot be made to agree."""
    if model_epoch == dataset_epoch:
        return 0
    if model_epoch < dataset_epoch and positioned:
        return dataset_epoch - model_epoch
    return None


def model_checkpoint_warning() -> str:
    """What a ModelCheckpoint beside TrainerdCallback risks: it may work, so it is told, not refused."""
    return ("Model.train's callbacks hold a ModelCheckpoint beside TrainerdCallback: trainerd resumes from its own "
            "checkpoints; a script that also resumes from ModelCheckpoint's files and starts Model.train at their "
            "epoch is refused at a resume when they are newer than trainerd's (Model.train would end early). "
            f"Drop ModelCheckpoint, or {RESUME_EPOCH_ADVICE} whatever else the script loads")
