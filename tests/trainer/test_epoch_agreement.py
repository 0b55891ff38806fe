"""What TrainerdCallback decides about Model.train's epochs and the dataset's, without MindSpore: a dataset no
resume could position is refused at the first start, Model.train behind a positioned dataset is renumbered,
and what cannot be mended is refused."""

from __future__ import annotations

from trainer.runtime.epoch_agreement import epoch_shift, model_checkpoint_warning, unpositioned_dataset_refusal


def test_several_epochs_of_a_dataset_no_resume_could_position_are_refused_at_the_start() -> None:
    refusal = unpositioned_dataset_refusal(3, positioned=False, epochs_known=True)
    assert refusal == ("Model.train runs 3 epochs of a dataset resume_epoch did not position, so a resume after its "
                       "first epoch could not go on where it stopped: pass initial_epoch=resume_epoch(dataset) "
                       "to Model.train")


def test_one_epoch_a_positioned_dataset_or_one_of_unknown_epochs_may_start() -> None:
    assert unpositioned_dataset_refusal(1, positioned=False, epochs_known=True) is None
    assert unpositioned_dataset_refusal(3, positioned=True, epochs_known=True) is None
    assert unpositioned_dataset_refusal(3, positioned=False, epochs_known=False) is None


def test_model_train_behind_a_positioned_dataset_is_renumbered() -> None:
    assert epoch_shift(3, 3, positioned=True) == 0
    assert epoch_shift(3, 3, positioned=False) == 0
    assert epoch_shift(1, 3, positioned=True) == 2  # the resume: initial_epoch 0, the dataset in epoch 3


def test_what_cannot_be_mended_is_refused() -> None:
    assert epoch_shift(1, 3, positioned=False) is None  # the dataset reads its epoch from the start
    assert epoch_shift(4, 2, positioned=True) is None   # Model.train would end two epochs early


def test_the_model_checkpoint_warning_says_what_to_do() -> None:
    assert model_checkpoint_warning().endswith("Drop ModelCheckpoint, or pass initial_epoch=resume_epoch(dataset) "
                                               "to Model.train whatever else the script loads")
