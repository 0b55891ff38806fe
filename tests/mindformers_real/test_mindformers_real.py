"""trainerd's MindFormers integration against MindFormers 2.0.0's real classes, on real MindSpore on CPU.

Run by `make test-mindformers` (its own venv: docs/jobs/mindformers.md), not by `make test`. The training test
runs the tiny LLaMA of tests/mindformers_support through trainerd's launcher and MindFormers' Trainer twice (a
run and a resume), about a minute each on a 2-core machine.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import mindspore.dataset as ds
import numpy as np
import pytest
import yaml
from mindformers.core.callback import EvalCallBack
from mindformers.core.callback.build_callback import build_callback
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister
from mindspore import Tensor, nn
from mindspore.common import dtype as mstype
from mindspore.train import Model, RunContext
from mindspore.train.callback._callback import InternalCallbackParam

from proto.progress_datagram import (
    BadBatchReason,
    BadBatchReport,
    CheckpointReport,
    EventReport,
    ProgressMessage,
    StepReport,
    WorkerEvent,
    decode,
)
from tests.mindformers_support.make_dataset import write
from trainer.checkpoint.manifest import step_dir_name
from trainer.checkpoint.mindformers_import import TRACKER_FILE
from trainer.integrations.mindformers.callback import TrainerdMindFormersCallback
from trainer.integrations.mindformers.generation_config import CALLBACK_AUTO_REGISTER, CALLBACK_TYPE
from trainer.integrations.mindformers.launch import REGISTER_DIR

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "mindformers_support"
RUN_TIMEOUT_S = 150


class ProgressSocket:
    """A unix datagram socket standing in for the agent's progress socket; a thread decodes what arrives (the
    kernel queues only ~10 datagrams, so it must read while the run goes on)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="trainerd-mf-", dir="/tmp")  # AF_UNIX paths are short
        self.path = os.path.join(self._dir, "progress.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)
        self.messages: list[ProgressMessage] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:  # once stopped, until the queue has been empty for the timeout
            try:
                self.messages.append(decode(self._sock.recv(65536)))
            except TimeoutError:
                if self._stop.is_set():
                    return

    def take(self) -> list[ProgressMessage]:
        """What arrived so far (waiting for the reader to drain the socket), then forgotten."""
        self._stop.set()
        self._thread.join()
        taken, self.messages = self.messages, []
        self._stop.clear()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return taken

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture
def progress() -> Iterator[ProgressSocket]:
    receiver = ProgressSocket()
    try:
        yield receiver
    finally:
        receiver.close()


def of_type(messages: list[ProgressMessage], kind: type) -> list:
    return [m for m in messages if isinstance(m, kind)]


def test_mindformers_builds_the_registered_callback_from_its_yaml_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry the launcher appends to `callbacks:`, built by MindFormers' own builder, with the
    `auto_register` import from the register directory the launcher passes as --register_path."""
    monkeypatch.setenv("REGISTER_PATH", str(REGISTER_DIR))
    monkeypatch.delenv("TRAINERD_JOB", raising=False)
    entry = {"type": CALLBACK_TYPE, "auto_register": CALLBACK_AUTO_REGISTER, "global_batch_size": 8,
             "skip_norm_threshold": None, "initial_step": 30}
    [callback] = build_callback([entry])
    assert MindFormerRegister.is_exist(MindFormerModuleType.CALLBACK, CALLBACK_TYPE)
    assert isinstance(callback, TrainerdMindFormersCallback) and callback.global_batch == 8 and callback.initial_step == 30


def net_outputs(loss: float, overflow: bool, global_norm: float) -> tuple[Tensor, ...]:
    """What MFTrainOneStepCell.construct returns with clipping on: (loss, overflow, loss_scale, lr, global_norm)."""
    return (Tensor(loss, mstype.float32), Tensor(overflow, mstype.bool_), Tensor(1024.0, mstype.float32),
            Tensor(1e-3, mstype.float32), Tensor(global_norm, mstype.float32))


def test_the_callback_reports_steps_overflows_and_commits_from_mindformers_outputs(
        tmp_path: Path, progress: ProgressSocket, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name, value in {"TRAINERD_JOB": "llm", "TRAINERD_GENERATION": "2", "TRAINERD_PROGRESS_SOCKET": progress.path,
                        "TRAINERD_CHECKPOINT_DIR": str(ckpt)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REGISTER_PATH", str(REGISTER_DIR))
    [callback] = build_callback([{"type": CALLBACK_TYPE, "auto_register": CALLBACK_AUTO_REGISTER,
                                  "global_batch_size": 4, "initial_step": 10}])
    params = InternalCallbackParam(cur_step_num=0, net_outputs=None)
    context = RunContext(params)
    callback.on_train_begin(context)  # MindFormers 2.0.0 resumes with Model.train counting from 0
    params.cur_step_num, params.net_outputs = 1, net_outputs(2.5, False, 0.75)
    callback.on_train_step_begin(context)
    callback.on_train_step_end(context)
    (ckpt / "iteration_00000012").mkdir()
    (ckpt / TRACKER_FILE).write_text("12")  # MindFormers commits step 12 (the overflow step's save)
    params.cur_step_num, params.net_outputs = 2, net_outputs(2.4, True, math.inf)
    callback.on_train_step_begin(context)
    callback.on_train_step_end(context)
    callback.on_train_end(context)
    messages = progress.take()

    assert of_type(messages, EventReport)[0] == EventReport("llm", 2, 0, WorkerEvent.STARTED, 10)
    steps = of_type(messages, StepReport)
    assert [(s.step, s.consumed_samples) for s in steps] == [(11, 44), (12, 48)]
    assert steps[0].loss == pytest.approx(2.5) and steps[0].grad_norm == pytest.approx(0.75)
    assert of_type(messages, BadBatchReport) == [
        BadBatchReport("llm", 2, 0, 12, 44, 48, BadBatchReason.NONFINITE_GRAD_NORM, pytest.approx(2.4), math.inf)]
    assert of_type(messages, CheckpointReport) == [
        CheckpointReport("llm", 2, 0, 12, 48, str(ckpt / "iteration_00000012"))]
    assert of_type(messages, EventReport)[-1].event is WorkerEvent.FINISHED


def test_an_evaluation_while_training_is_reported_as_mindformers_runs_it(
        progress: ProgressSocket, monkeypatch: pytest.MonkeyPatch) -> None:
    """MindFormers' do_eval: its EvalCallBack calls model.eval(eval_dataset) between steps, with no callbacks."""
    for name, value in {"TRAINERD_JOB": "llm", "TRAINERD_GENERATION": "1",
                        "TRAINERD_PROGRESS_SOCKET": progress.path}.items():
        monkeypatch.setenv(name, value)
    callback = TrainerdMindFormersCallback(global_batch_size=4)
    model = Model(nn.Dense(3, 2), nn.MSELoss(), metrics={"loss"})
    data = ds.NumpySlicesDataset({"x": np.ones((8, 3), np.float32), "y": np.zeros((8, 2), np.float32)}).batch(4)
    params = InternalCallbackParam(cur_step_num=0, net_outputs=None)
    context = RunContext(params)
    callback.on_train_begin(context)
    params.cur_step_num, params.net_outputs = 1, net_outputs(2.5, False, 0.75)
    callback.on_train_step_end(context)
    mindformers_eval = EvalCallBack(eval_func=lambda: model.eval(data, dataset_sink_mode=False), step_interval=1)
    mindformers_eval.on_train_step_end(context)
    callback.on_train_end(context)
    model.eval(data)  # after training: not reported (the agent has heard FINISHED)
    events = [(e.event, e.step) for e in of_type(progress.take(), EventReport)]
    assert events == [(WorkerEvent.STARTED, 0), (WorkerEvent.EVALUATING, 1), (WorkerEvent.FINISHED, 1)], events


def tiny_llama_yaml(tmp_path: Path, samples: int) -> Path:
    """tests/mindformers_support/tiny_llama.yaml on one process: global batch 2, `samples` samples, one epoch."""
    data = tmp_path / "data.mindrecord"
    write(str(data), samples)
    config = yaml.safe_load((SUPPORT / "tiny_llama.yaml").read_text())
    config["train_dataset"]["data_loader"]["dataset_dir"] = str(data)
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["parallel_config"]["data_parallel"] = 1
    config["use_parallel"] = False
    config["output_dir"] = str(tmp_path / "output")
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_generation(user_yaml: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """One generation as trainerd's agent launches it: the launcher, which execs MindFormers' runner (on CPU)."""
    command = [sys.executable, "-m", "trainer.integrations.mindformers.launch", "--config", str(user_yaml), "--",
               sys.executable, str(SUPPORT / "run_mindformer_cpu.py"), str(SUPPORT / "train_runner.py"),
               "--run_mode", "train", "--use_parallel", "False"]
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return done


def test_tiny_llama_trains_checkpoints_imports_and_resumes(tmp_path: Path, progress: ProgressSocket) -> None:
    """8 steps of global batch 2, a Checkpoint 2.0 save every 4; then generation 1 resumes from iteration 4
    (data_skip_steps 4) and repeats steps 5-8 with the same losses."""
    user_yaml = tiny_llama_yaml(tmp_path, samples=16)
    ckpt = tmp_path / "ckpt"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINERD_", "MS_", "RANK_"))}
    env = {**base, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")])),
           "TRAINERD_JOB": "llm", "TRAINERD_GENERATION": "0", "TRAINERD_PROGRESS_SOCKET": progress.path,
           "TRAINERD_CHECKPOINT_DIR": str(ckpt), "TRAINERD_CHECKPOINT_EVERY": "4", "TRAINERD_CHECKPOINT_KEEP": "3",
           # With no agent's generation directory to write into, the launcher writes each generation's YAML to
           # the temporary directory: this test's, not /tmp, where every run left two.
           "TMPDIR": str(tmp_path)}

    run_generation(user_yaml, env, tmp_path)
    first = progress.take()
    steps = {s.step: s for s in of_type(first, StepReport)}
    assert sorted(steps) == list(range(1, 9))
    assert all(s.consumed_samples == 2 * s.step and math.isfinite(s.loss) and math.isfinite(s.grad_norm)
               and s.grad_norm > 0 for s in steps.values())
    assert steps[8].loss < steps[1].loss  # the ramp corpus is learnable
    assert [(c.step, c.consumed_samples, c.path) for c in of_type(first, CheckpointReport)] == [
        (4, 8, str(ckpt / "iteration_00000004")), (8, 16, str(ckpt / "iteration_00000008"))]
    assert (ckpt / TRACKER_FILE).read_text().strip() == "8"

    out = tmp_path / "imported"
    out.mkdir()
    imported = subprocess.run([sys.executable, "-m", "daemon.cli.trainerctl", "checkpoint", "import",
                               str(ckpt / "iteration_00000004"), "--world-size", "1", "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()) == out / step_dir_name(4) and (out / step_dir_name(4)).is_dir()

    resume = {**env, "TRAINERD_GENERATION": "1", "TRAINERD_RESUME_FROM": str(ckpt / "iteration_00000004"),
              "TRAINERD_RESUME_SAMPLES": "8"}
    run_generation(user_yaml, resume, tmp_path)
    assert len(list(tmp_path.glob("trainerd-llm-g*-rank0-*.yaml"))) == 2  # generations 0 and 1
    second = progress.take()
    assert of_type(second, EventReport)[0] == EventReport("llm", 1, 0, WorkerEvent.STARTED, 4)
    resumed = {s.step: s for s in of_type(second, StepReport)}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert np.allclose([resumed[n].loss for n in resumed], [steps[n].loss for n in resumed], rtol=1e-5)
    assert [c.step for c in of_type(second, CheckpointReport)] == [8]
