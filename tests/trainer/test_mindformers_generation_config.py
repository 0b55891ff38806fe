"""The MindFormers YAML of each generation (pure logic: no MindFormers, no MindSpore)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from trainer.integrations.mindformers.generation_config import (
    CALLBACK_AUTO_REGISTER,
    CALLBACK_TYPE,
    GenerationConfigError,
    GenerationSettings,
    ResumeCheckpoint,
    absolute_base_configs,
    generation_config,
    global_batch,
)


def user_config(**parallel: Any) -> dict[str, Any]:
    """A data-parallel job written for 4 ranks: global batch 2 × 4 × 2 = 16."""
    return {
        "runner_config": {"batch_size": 2, "gradient_accumulation_steps": 2, "epochs": 1},
        "parallel_config": {"data_parallel": 4, "model_parallel": 1, "pipeline_stage": 1, "micro_batch_num": 1,
                            **parallel},
        "parallel": {"parallel_mode": 0},
        "callbacks": [{"type": "MFLossMonitor"}],
    }


def trainerd_callback(config: dict[str, Any]) -> dict[str, Any]:
    [entry] = [c for c in config["callbacks"] if c.get("type") == CALLBACK_TYPE]
    return entry


def test_the_global_batch_is_kept_at_every_world_size_by_the_accumulation() -> None:
    user = user_config()
    assert global_batch(user) == 16
    for world, accumulation in ((4, 2), (2, 4), (1, 8), (8, 1)):
        config = generation_config(user, GenerationSettings(world_size=world))
        assert config["parallel_config"]["data_parallel"] == world
        assert config["runner_config"]["gradient_accumulation_steps"] == accumulation
        assert global_batch(config) == 16
    assert user == user_config(), "the user's config is left as it was"


def test_model_and_pipeline_parallel_divide_the_world_and_pipelines_accumulate_micro_batches() -> None:
    user = user_config(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=4)
    assert global_batch(user) == 2 * 2 * 4
    config = generation_config(user, GenerationSettings(world_size=4))
    assert config["parallel_config"]["data_parallel"] == 1
    assert config["parallel_config"]["micro_batch_num"] == 8
    assert global_batch(config) == 16


def test_a_list_dataset_strategy_follows_data_parallel() -> None:
    user = user_config()
    user["parallel"]["dataset_strategy"] = [[4, 1], [4, 1, 1]]
    config = generation_config(user, GenerationSettings(world_size=2))
    assert config["parallel"]["dataset_strategy"] == [[2, 1], [2, 1, 1]]


def test_trainerd_batch_variables_override_the_yaml() -> None:
    config = generation_config(user_config(), GenerationSettings(world_size=2, global_batch=32, micro_batch=4))
    assert config["runner_config"]["batch_size"] == 4
    assert config["runner_config"]["gradient_accumulation_steps"] == 4
    assert trainerd_callback(config)["global_batch_size"] == 32


@pytest.mark.parametrize("settings, message", [
    (GenerationSettings(world_size=3), "global batch 16 is not a multiple of batch_size 2 × data_parallel 3"),
    (GenerationSettings(world_size=32), "global batch 16 is not a multiple of batch_size 2 × data_parallel 32"),
    (GenerationSettings(world_size=0), "world size 0 must be positive"),
])
def test_world_sizes_that_cannot_keep_the_global_batch_are_refused(settings: GenerationSettings,
                                                                   message: str) -> None:
    with pytest.raises(GenerationConfigError, match=message.replace("×", ".")):
        generation_config(user_config(), settings)


def test_a_world_size_that_model_parallel_does_not_divide_is_refused() -> None:
    with pytest.raises(GenerationConfigError, match="world size 3 is not a multiple of .* = 2"):
        generation_config(user_config(model_parallel=2), GenerationSettings(world_size=3))


def test_bad_values_in_the_yaml_are_named() -> None:
    user = user_config()
    user["runner_config"]["batch_size"] = "two"
    with pytest.raises(GenerationConfigError, match="runner_config.batch_size must be a positive integer"):
        generation_config(user, GenerationSettings(world_size=1))


def test_checkpoints_go_to_checkpoint_2_0_in_the_job_directory() -> None:
    settings = GenerationSettings(world_size=2, checkpoint_dir=Path("/ckpt/llm"), checkpoint_every=50,
                                  checkpoint_keep=3)
    config = generation_config(user_config(), settings)
    assert config["checkpoint"] == {"save_path": "/ckpt/llm", "save_interleaved_steps": 50, "save_max": 3}
    assert config["use_legacy_format"] is False
    assert {"type": "CheckpointMonitor", "checkpoint_format": "safetensors"} in config["callbacks"]
    # A CheckpointMonitor the user lists is kept as written (its settings come from `checkpoint:`).
    user = user_config()
    user["callbacks"].append({"type": "CheckpointMonitor", "prefix": "llama"})
    config = generation_config(user, settings)
    assert [c for c in config["callbacks"] if c["type"] == "CheckpointMonitor"] == [
        {"type": "CheckpointMonitor", "prefix": "llama"}]


def test_a_legacy_format_job_cannot_keep_trainerd_checkpoints() -> None:
    user = {**user_config(), "use_legacy_format": True}
    with pytest.raises(GenerationConfigError, match="remove use_legacy_format: True"):
        generation_config(user, GenerationSettings(world_size=2, checkpoint_dir=Path("/ckpt")))


def test_resume_from_a_checkpoint_2_0_iteration_at_another_world_size() -> None:
    resume = ResumeCheckpoint(Path("/ckpt/llm/iteration_00000400"), "iteration", consumed_samples=400 * 16)
    config = generation_config(user_config(), GenerationSettings(world_size=2, checkpoint_dir=Path("/ckpt/llm"),
                                                                 resume=resume))
    assert config["checkpoint"]["load_path"] == "/ckpt/llm/iteration_00000400"
    assert config["checkpoint"]["no_load_optim"] is False
    assert config["resume_training"] is True
    assert config["load_ckpt_format"] == "safetensors"
    assert config["data_skip_steps"] == 400
    assert trainerd_callback(config)["initial_step"] == 400, "the callback counts on from the resumed step"
    assert config["ignore_data_skip"] is False
    assert "auto_trans_ckpt" not in config, "MindFormers reshards Checkpoint 2.0 from its metadata.json"


def test_resume_from_a_legacy_rank_layout_transforms_it_when_the_world_size_changed() -> None:
    for saved_world, transform in ((4, True), (2, False)):
        resume = ResumeCheckpoint(Path("/old/checkpoint"), "ranks", consumed_samples=160, world_size=saved_world)
        config = generation_config(user_config(), GenerationSettings(world_size=2, resume=resume))
        assert (config["load_checkpoint"], config["resume_training"]) == ("/old/checkpoint", True)
        assert config["auto_trans_ckpt"] is transform
        assert config["data_skip_steps"] == 10


def test_a_legacy_checkpoint_cannot_resume_a_checkpoint_2_0_job() -> None:
    resume = ResumeCheckpoint(Path("/old/checkpoint"), "ranks", consumed_samples=160, world_size=4)
    with pytest.raises(GenerationConfigError, match="legacy rank_N/ checkpoint"):
        generation_config(user_config(), GenerationSettings(world_size=2, checkpoint_dir=Path("/ckpt"),
                                                            resume=resume))


def test_consumed_samples_that_are_not_whole_global_batches_are_refused() -> None:
    resume = ResumeCheckpoint(Path("/ckpt/iteration_00000010"), "iteration", consumed_samples=100)
    with pytest.raises(GenerationConfigError, match="consumed 100 samples, not a whole number of global batches"):
        generation_config(user_config(), GenerationSettings(world_size=2, resume=resume))


def test_the_callback_is_added_or_updated_with_the_batch_and_mindformers_skip_threshold() -> None:
    config = generation_config(user_config(), GenerationSettings(world_size=2))
    assert trainerd_callback(config) == {"type": CALLBACK_TYPE, "auto_register": CALLBACK_AUTO_REGISTER,
                                         "global_batch_size": 16, "skip_norm_threshold": None, "initial_step": 0}
    assert config["callbacks"][0] == {"type": "MFLossMonitor"}
    user = user_config()
    user["runner_wrapper"] = {"type": "MFTrainOneStepCell", "use_skip_data_by_global_norm": True,
                              "global_norm_spike_threshold": 3.5}
    user["callbacks"].insert(0, {"type": CALLBACK_TYPE})
    config = generation_config(user, GenerationSettings(world_size=2))
    assert config["callbacks"][0] == {"type": CALLBACK_TYPE, "auto_register": CALLBACK_AUTO_REGISTER,
                                      "global_batch_size": 16, "skip_norm_threshold": 3.5, "initial_step": 0}
    assert len(config["callbacks"]) == 2


def test_base_configs_keep_pointing_at_the_users_files(tmp_path: Path) -> None:
    config = {"base_config": ["../common/model.yaml", "/abs/run.yaml"]}
    absolute_base_configs(config, tmp_path / "jobs" / "llama.yaml")
    assert config["base_config"] == [str((tmp_path / "common" / "model.yaml").resolve()), "/abs/run.yaml"]
    single = copy.deepcopy({"base_config": "base.yaml"})
    absolute_base_configs(single, tmp_path / "llama.yaml")
    assert single["base_config"] == str(tmp_path / "base.yaml")
