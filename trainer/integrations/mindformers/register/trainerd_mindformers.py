"""Imported by MindFormers' `auto_register: trainerd_mindformers.TrainerdMindFormersCallback` from the
directory run_mindformer.py's `--register_path` names (the launcher passes this one); importing the callback
registers it in MindFormerRegister."""

from trainer.integrations.mindformers.callback import TrainerdMindFormersCallback

__all__ = ["TrainerdMindFormersCallback"]
