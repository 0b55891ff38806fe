"""The MindFormers YAML of one generation, written from the user's: pure logic, no MindFormers needed.

From the user's config (as run_mindformer.py reads it, a nested dict) and what trainerd decided for this
generation (`GenerationSettings`), `generation_config` returns the config to run:

- **The global batch stays** what the user's YAML gives (`global_batch`), or TRAINERD_GLOBAL_BATCH. At the
  generation's world size, data_parallel becomes world size / (model_parallel × context_parallel ×
  pipeline_stage), and the accumulation fills the rest: gradient_accumulation_steps without pipeline
  parallel, micro_batch_num with it (MindFormers ignores the first under pipeline parallel). A list
  `parallel.dataset_strategy` gets the new data_parallel as its first dimension.
- **Checkpoints** go to Checkpoint 2.0 in TRAINERD_CHECKPOINT_DIR (`checkpoint.save_path`, `save_max` =
  TRAINERD_CHECKPOINT_KEEP, `save_interleaved_steps` = TRAINERD_CHECKPOINT_EVERY when set), saved by a
  CheckpointMonitor (added when the YAML lists none). Its tracker file is the commit point the callback
  reports.
- **Resume** through MindFormers' own settings. A Checkpoint 2.0 iteration: `checkpoint.load_path`,
  `no_load_optim: False` and `load_ckpt_format: safetensors` (MindFormers reshards it to any world size
  itself, from its metadata.json). A legacy `rank_N/` directory: `load_checkpoint`, `resume_training: True`,
  and `auto_trans_ckpt` when its rank count differs from the world size. Either way `data_skip_steps` =
  consumed samples / global batch, so the dataset (`set_init_step`) starts where the checkpoint's samples
  end, and `ignore_data_skip: False`.
- **The callback** (`trainer.integrations.mindformers.callback`) is appended to `callbacks`, or updated
  where the YAML lists it, with the global batch, MindFormers' skip threshold and the resumed step, so it can
  count steps and tell a skipped step and its samples.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CALLBACK_TYPE = "TrainerdMindFormersCallback"
# run_mindformer.py --register_path puts a directory on REGISTER_PATH; `auto_register: file.Class` imports
# file.py from it, which registers the callback (launch.REGISTER_DIR holds that file).
CALLBACK_AUTO_REGISTER = "trainerd_mindformers.TrainerdMindFormersCallback"

ResumeLayout = Literal["iteration", "ranks"]


class GenerationConfigError(ValueError):
    """The user's YAML cannot run at this generation's world size or resume point; the message says why."""


@dataclass(frozen=True)
class ResumeCheckpoint:
    """What to resume from: a Checkpoint 2.0 iteration directory, or a legacy directory of `rank_N/`."""

    path: Path
    layout: ResumeLayout
    consumed_samples: int
    world_size: int | None = None  # the legacy layout's rank count (auto_trans_ckpt when it differs)


@dataclass(frozen=True)
class GenerationSettings:
    world_size: int
    checkpoint_dir: Path | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int | None = None
    resume: ResumeCheckpoint | None = None
    global_batch: int | None = None  # TRAINERD_GLOBAL_BATCH; None: the YAML's
    micro_batch: int | None = None   # TRAINERD_MICRO_BATCH; None: the YAML's runner_config.batch_size


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name)
    if value is None:
        value = config[name] = {}
    if not isinstance(value, dict):
        raise GenerationConfigError(f"'{name}' must be a mapping, not {type(value).__name__}")
    return value


def _positive(section: dict[str, Any], key: str, where: str, default: int = 1) -> int:
    value = section.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GenerationConfigError(f"{where}.{key} must be a positive integer, not {value!r:.40}")
    return value


def global_batch(config: dict[str, Any]) -> int:
    """The global batch of the YAML as written, by MindFormers' rule: batch_size × data_parallel ×
    micro_batch_interleave_num × (micro_batch_num under pipeline parallel, else gradient_accumulation_steps)."""
    runner = config.get("runner_config") or {}
    parallel = config.get("parallel_config") or {}
    batch = _positive(runner, "batch_size", "runner_config")
    dp = _positive(parallel, "data_parallel", "parallel_config")
    interleave = _positive(config, "micro_batch_interleave_num", "config")
    if _positive(parallel, "pipeline_stage", "parallel_config") > 1:
        return batch * dp * interleave * _positive(parallel, "micro_batch_num", "parallel_config")
    return batch * dp * interleave * _positive(runner, "gradient_accumulation_steps", "runner_config")


def _set_batch_split(config: dict[str, Any], settings: GenerationSettings) -> int:
    """Fill data_parallel and the accumulation for the world size; returns the global batch kept."""
    target = settings.global_batch if settings.global_batch is not None else global_batch(config)
    runner, parallel = _section(config, "runner_config"), _section(config, "parallel_config")
    if settings.micro_batch is not None:
        runner["batch_size"] = settings.micro_batch
    batch = _positive(runner, "batch_size", "runner_config")
    stages = _positive(parallel, "pipeline_stage", "parallel_config")
    cut = _positive(parallel, "model_parallel", "parallel_config") * stages * \
        _positive(parallel, "context_parallel", "parallel_config")
    if settings.world_size % cut:
        raise GenerationConfigError(
            f"world size {settings.world_size} is not a multiple of model_parallel × context_parallel × "
            f"pipeline_stage = {cut}")
    dp = settings.world_size // cut
    per_step = batch * dp * _positive(config, "micro_batch_interleave_num", "config")
    if target % per_step:
        raise GenerationConfigError(
            f"global batch {target} is not a multiple of batch_size {batch} × data_parallel {dp} at world size "
            f"{settings.world_size}: choose world sizes that divide it (job.world_sizes)")
    parallel["data_parallel"] = dp
    if stages > 1:
        parallel["micro_batch_num"] = target // per_step
    else:
        runner["gradient_accumulation_steps"] = target // per_step
    strategy = (config.get("parallel") or {}).get("dataset_strategy")
    if isinstance(strategy, list):
        config["parallel"]["dataset_strategy"] = [
            [dp, *item[1:]] if isinstance(item, list) and item else item for item in strategy
        ]
    return target


def _callbacks(config: dict[str, Any]) -> list[Any]:
    callbacks = config.get("callbacks")
    if callbacks is None:
        callbacks = config["callbacks"] = []
    if not isinstance(callbacks, list):
        raise GenerationConfigError("'callbacks' must be a list")
    return callbacks


def _set_checkpoints(config: dict[str, Any], settings: GenerationSettings) -> None:
    if settings.checkpoint_dir is None:
        return
    if config.get("use_legacy_format") is True and "checkpoint" not in config:
        raise GenerationConfigError(
            "trainerd keeps MindFormers checkpoints in Checkpoint 2.0 (its commit point is "
            "latest_checkpointed_iteration.txt): remove use_legacy_format: True")
    section = _section(config, "checkpoint")  # present: MindFormers turns use_legacy_format off
    section["save_path"] = str(settings.checkpoint_dir)
    if settings.checkpoint_every:
        section["save_interleaved_steps"] = settings.checkpoint_every
    if settings.checkpoint_keep is not None:
        section["save_max"] = settings.checkpoint_keep
    config["use_legacy_format"] = False
    callbacks = _callbacks(config)
    if not any(isinstance(c, dict) and c.get("type") == "CheckpointMonitor" for c in callbacks):
        callbacks.append({"type": "CheckpointMonitor", "checkpoint_format": "safetensors"})


def _set_resume(config: dict[str, Any], resume: ResumeCheckpoint, batch: int, world_size: int) -> None:
    if resume.consumed_samples % batch:
        raise GenerationConfigError(
            f"the checkpoint at {resume.path} consumed {resume.consumed_samples} samples, not a whole number of "
            f"global batches of {batch}")
    if resume.layout == "iteration":
        section = _section(config, "checkpoint")
        section["load_path"] = str(resume.path)
        section["no_load_optim"] = False
        config["use_legacy_format"] = False
        config["load_ckpt_format"] = "safetensors"  # its files; with the default "ckpt" MindFormers looks for rank_N/
        config["resume_training"] = True
    else:
        if config.get("use_legacy_format") is False:
            raise GenerationConfigError(
                f"{resume.path} is a legacy rank_N/ checkpoint, which MindFormers loads only with "
                "use_legacy_format: True, and job.checkpoint.dir switches the job to Checkpoint 2.0")
        config["load_checkpoint"] = str(resume.path)
        config["resume_training"] = True
        config["auto_trans_ckpt"] = resume.world_size is not None and resume.world_size != world_size
    config["data_skip_steps"] = resume.consumed_samples // batch
    config["ignore_data_skip"] = False


def _skip_threshold(config: dict[str, Any]) -> float | None:
    """MindFormers skips an update whose global norm reaches global_norm_spike_threshold when
    use_skip_data_by_global_norm is on (runner_wrapper, or the top level)."""
    wrapper = config.get("runner_wrapper") or {}
    for section in (wrapper, config):
        if isinstance(section, dict) and section.get("use_skip_data_by_global_norm"):
            threshold = section.get("global_norm_spike_threshold", wrapper.get("global_norm_spike_threshold"))
            if isinstance(threshold, (int, float)) and math.isfinite(threshold):
                return float(threshold)
    return None


def _set_callback(config: dict[str, Any], batch: int, initial_step: int) -> None:
    callbacks = _callbacks(config)
    entry = next((c for c in callbacks if isinstance(c, dict) and c.get("type") == CALLBACK_TYPE), None)
    if entry is None:
        entry = {"type": CALLBACK_TYPE}
        callbacks.append(entry)
    entry["auto_register"] = CALLBACK_AUTO_REGISTER
    entry["global_batch_size"] = batch
    entry["skip_norm_threshold"] = _skip_threshold(config)
    entry["initial_step"] = initial_step


def generation_config(user_config: dict[str, Any], settings: GenerationSettings) -> dict[str, Any]:
    """The config this generation runs; `user_config` is left as it was."""
    if settings.world_size < 1:
        raise GenerationConfigError(f"world size {settings.world_size} must be positive")
    config = copy.deepcopy(user_config)
    batch = _set_batch_split(config, settings)
    _set_checkpoints(config, settings)
    if settings.resume is not None:
        _set_resume(config, settings.resume, batch, settings.world_size)
    _set_callback(config, batch, config.get("data_skip_steps", 0) if settings.resume is not None else 0)
    return config


def absolute_base_configs(config: dict[str, Any], user_yaml: Path) -> None:
    """MindFormerConfig resolves `base_config` against the YAML's own directory: keep them pointing at the
    user's files when the generated YAML lives elsewhere."""
    base = config.get("base_config")
    if base is None:
        return
    names = base if isinstance(base, list) else [base]
    resolved = [str((user_yaml.parent / name).resolve()) if isinstance(name, str) else name for name in names]
    config["base_config"] = resolved if isinstance(base, list) else resolved[0]
