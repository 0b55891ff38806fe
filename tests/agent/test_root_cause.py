"""The root cause of a failed rank, read from its output tail.

Tracebacks come from really running small failing scripts; the files in mindspore_output/ are real
output of MindSpore 2.10 on CPU (paths replaced): a 2-worker data-parallel job whose rank 1 lost
its data file, and single-process failures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.root_cause import MAX_MESSAGE_CHARS, RootCauseInLog, extract_root_cause
from agent.supervisor import FAULT_HANDLER_ENV
from daemon.job.state import error_key
from proto.vocabulary import CauseKind

SAMPLES = Path(__file__).parent / "mindspore_output"
MAX_TAIL = 64 * 1024


def run_failing(tmp_path: Path, source: str) -> str:
    """The merged stdout+stderr of `python train.py` run in tmp_path, which must fail, with the fault handler
    on as the agent runs every training process (agent/supervisor.py FAULT_HANDLER_ENV)."""
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    result = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=60, check=False,
                            env={**os.environ, **FAULT_HANDLER_ENV})
    assert result.returncode != 0, result.stdout
    return result.stdout


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()[-MAX_TAIL:]


def test_a_python_exception_with_the_line_that_raised_it(tmp_path: Path) -> None:
    output = run_failing(tmp_path, """\
        print("epoch: 1 step: 1, loss is 0.5", flush=True)

        def load(path):
            with open(path) as f:
                return f.read()

        load("data/x")
        """)
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause == RootCauseInLog(CauseKind.PYTHON_EXCEPTION,
                                 "FileNotFoundError: [Errno 2] No such file or directory: 'data/x'", "train.py:4")
    assert extract_root_cause(output).location == f"{tmp_path.resolve()}/train.py:4"


def test_an_error_raised_in_trainerds_own_code_points_at_the_users_line_also_from_a_checkout(tmp_path: Path) -> None:
    # The repository's own trainer package, imported from the checkout (as `make` installs it, editable).
    output = run_failing(tmp_path, f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        import mindspore.dataset as ds
        from trainer.runtime.elastic_dataset import trainerd_dataset

        dataset = ds.NumpySlicesDataset([[1.0], [2.0]], ["x"]).batch(1)
        trainerd_dataset(dataset, 1)
        """)
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause.message.startswith("ValueError: ") and "before .batch" in cause.message, cause
    assert cause.location == "train.py:7", cause


def test_a_dataset_pipeline_error_is_the_error_of_the_section_it_refers_to(tmp_path: Path) -> None:
    # MindRecord files written under a temporary name and renamed (their index keeps the old name):
    # MindSpore's RuntimeError only refers to a section below it, which holds the error.
    output = run_failing(tmp_path, """\
        import os
        import mindspore.dataset as ds
        from mindspore.mindrecord import FileWriter

        writer = FileWriter("a.mindrecord.tmp", 1)
        writer.add_schema({"x": {"type": "int32"}})
        writer.write_raw_data([{"x": 1}])
        writer.commit()
        os.rename("a.mindrecord.tmp", "a.mindrecord")
        os.rename("a.mindrecord.tmp.db", "a.mindrecord.db")
        ds.MindDataset("a.mindrecord").get_dataset_size()
        """)
    assert "Refer to 'Dataset Pipeline Error Message'" in output
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause.message.startswith("RuntimeError: Invalid file, mindrecord file: "), cause
    assert "a.mindrecord.tmp can not be found" in cause.message and cause.location == "train.py:11", cause


def test_an_exception_raised_in_library_code_points_at_the_users_line(tmp_path: Path) -> None:
    output = run_failing(tmp_path, """\
        import json

        config = json.loads("{not json")
        """)
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause.kind is CauseKind.PYTHON_EXCEPTION
    assert cause.message.startswith("json.decoder.JSONDecodeError: Expecting property name")
    assert cause.location == "train.py:3"  # not json/decoder.py


@pytest.mark.parametrize(("raise_it", "message", "line"), [
    ("raise RuntimeError('cannot load checkpoint ckpt/step_400') from exc",
     "RuntimeError: cannot load checkpoint ckpt/step_400", 7),
    ("undefined_name()", "NameError: name 'undefined_name' is not defined", 7),
])
def test_a_chain_of_exceptions_gives_the_last_one(tmp_path: Path, raise_it: str, message: str, line: int) -> None:
    output = run_failing(tmp_path, f"""\
        def read(path):
            return open(path).read()

        try:
            read("ckpt/step_400")
        except OSError as exc:
            {raise_it}
        """)
    assert ("direct cause" in output) != ("During handling" in output)
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause == RootCauseInLog(CauseKind.PYTHON_EXCEPTION, message, f"train.py:{line}")


def test_an_exception_without_a_message_keeps_its_line_alone(tmp_path: Path) -> None:
    output = run_failing(tmp_path, """\
        import atexit, sys
        atexit.register(lambda: print("dataset workers stopped", file=sys.stderr, flush=True))
        def check(batch):
            assert batch
        check([])
        """)
    assert output.rstrip().endswith("AssertionError\ndataset workers stopped")
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause == RootCauseInLog(CauseKind.PYTHON_EXCEPTION, "AssertionError", "train.py:4")


def test_a_syntax_error(tmp_path: Path) -> None:
    output = run_failing(tmp_path, "import os\nsteps = (1,\n")
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause.kind is CauseKind.PYTHON_EXCEPTION
    assert cause.message == "SyntaxError: '(' was never closed" and cause.location == "train.py:2"


SEGFAULT_IN_A_THREAD = """\
    import ctypes, threading, time

    def read(address):
        return ctypes.string_at(address)

    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    print("epoch: 1 step: 3, loss is 0.5", flush=True)
    read(0)
    """


def test_a_crash_in_native_code_is_the_line_of_the_users_code_that_ran_into_it(tmp_path: Path) -> None:
    """The fault handler lists every thread; the crashing one's innermost frame of the user's code is the
    location (ctypes' own frame is library code), so the same crash on two ranks is one error."""
    output = run_failing(tmp_path, SEGFAULT_IN_A_THREAD)
    cause = extract_root_cause(output, work_dir=str(tmp_path))
    assert cause == RootCauseInLog(CauseKind.FATAL_ERROR, "Fatal Python error: Segmentation fault", "train.py:4")
    again = extract_root_cause(run_failing(tmp_path, SEGFAULT_IN_A_THREAD), work_dir=str(tmp_path))
    assert error_key(again.message, again.location, again.kind) == error_key(cause.message, cause.location,
                                                                              cause.kind)
    aborted = run_failing(tmp_path, """\
        import os
        print("epoch: 1 step: 3, loss is 0.5", flush=True)
        os.abort()
        """)
    assert extract_root_cause(aborted, work_dir=str(tmp_path)) == RootCauseInLog(
        CauseKind.FATAL_ERROR, "Fatal Python error: Aborted", "train.py:3")


def test_mindspore_leaves_the_fault_handler_in_place(tmp_path: Path) -> None:
    """Nothing `import mindspore` loads replaces the fault handler: a crash after it is still reported."""
    output = run_failing(tmp_path, """\
        import ctypes
        import mindspore, mindspore.communication, mindspore.dataset
        ctypes.string_at(0)
        """)
    assert extract_root_cause(output, work_dir=str(tmp_path)) == RootCauseInLog(
        CauseKind.FATAL_ERROR, "Fatal Python error: Segmentation fault", "train.py:3")


def test_a_crash_after_an_exception_that_was_handled_is_the_cause(tmp_path: Path) -> None:
    output = run_failing(tmp_path, """\
        import ctypes, traceback
        try:
            int("x")
        except ValueError:
            traceback.print_exc()  # handled: training goes on
        ctypes.string_at(0)
        """)
    assert extract_root_cause(output, work_dir=str(tmp_path)) == RootCauseInLog(
        CauseKind.FATAL_ERROR, "Fatal Python error: Segmentation fault", "train.py:6")


def test_a_crash_with_no_python_frame_after_an_exception_is_the_teardown_and_the_exception_stays_the_cause(
        ) -> None:
    # What the fault handler prints when the crashing thread runs no Python code: here, the interpreter's
    # teardown after the uncaught exception above it.
    tail = ('Traceback (most recent call last):\n  File "/job/train.py", line 9, in <module>\n'
            "ValueError: bad shape\nFatal Python error: Segmentation fault\n\n"
            "Current thread 0x00007f2c1c1f8740 (most recent call first):\n  <no Python frame>\n")
    assert extract_root_cause(tail, work_dir="/job") == RootCauseInLog(
        CauseKind.PYTHON_EXCEPTION, "ValueError: bad shape", "train.py:9")
    alone = extract_root_cause(tail.split("ValueError: bad shape\n")[1])
    assert alone == RootCauseInLog(CauseKind.FATAL_ERROR, "Fatal Python error: Segmentation fault", None)


def test_a_mindspore_error_is_its_first_line_not_its_cpp_call_stack() -> None:
    cause = extract_root_cause(sample("matmul_shape_error.txt"), work_dir="/home/alice/mnist")
    assert cause == RootCauseInLog(
        CauseKind.PYTHON_EXCEPTION,
        "ValueError: For 'MatMul' the input dimensions must be equal, but got 'x1_col': 4 and 'x2_row': 5.",
        "train.py:41")


def test_an_empty_runtime_error_takes_the_text_of_its_first_section() -> None:
    # "RuntimeError: " then "- Kernel error:" then the message, on the rank whose peer died.
    cause = extract_root_cause(sample("rank0_peer_failed.txt"), work_dir="/home/alice/mnist")
    assert cause == RootCauseInLog(
        CauseKind.PYTHON_EXCEPTION,
        "RuntimeError: Launch kernel failed: Default/grad_reducer-DistributedGradReducer/AllReduce-op0",
        "train.py:24")


@pytest.mark.parametrize(("name", "message", "location"), [
    ("dataset_user_error.txt", "ValueError: bad sample 3", "train.py:15"),
    ("rank1_data_missing.txt", "FileNotFoundError: [Errno 2] No such file or directory: 'data/shard-1.bin'",
     "train.py:17"),
])
def test_an_error_in_the_users_dataset_code_is_taken_from_the_python_call_stack(
        name: str, message: str, location: str) -> None:
    cause = extract_root_cause(sample(name), work_dir="/home/alice/mnist")
    assert cause == RootCauseInLog(CauseKind.PYTHON_EXCEPTION, message, location)


def test_the_scheduler_names_the_node_that_timed_out() -> None:
    cause = extract_root_cause(sample("scheduler_node_timed_out.txt"), work_dir="/home/alice/mnist")
    assert cause.kind is CauseKind.PYTHON_EXCEPTION and cause.location == "train.py:11"
    assert cause.message.startswith("RuntimeError: The total number of timed out node is 1.")


def test_loss_monitors_nan_error() -> None:
    cause = extract_root_cause(sample("loss_monitor_nan.txt"), work_dir="/home/alice/mnist")
    assert cause.message == ("ValueError: In epoch: 1 step: 2, loss is NAN or INF, training process cannot "
                             "continue, terminating training.")
    assert cause.location == "train.py:41"


def test_a_tail_that_starts_inside_the_traceback() -> None:
    text = sample("rank1_data_missing.txt")
    tail = text[text.index('  File "/home/alice/mnist/train.py", line 17'):]
    assert "Traceback" not in tail
    cause = extract_root_cause(tail, work_dir="/home/alice/mnist")
    assert cause.location == "train.py:17" and cause.message.startswith("FileNotFoundError:")


def test_log_lines_between_the_frames_and_the_exception_are_skipped() -> None:
    tail = ('Traceback (most recent call last):\n  File "/job/train.py", line 9, in <module>\n    main()\n'
            "[WARNING] DEVICE(7,7f00,python):2026-11-23-09:15:30.042.257 [mindspore/ccsrc/x.cc:152] Run] busy\n"
            "KeyError: 'labels'\n")
    assert extract_root_cause(tail, work_dir="/job") == RootCauseInLog(
        CauseKind.PYTHON_EXCEPTION, "KeyError: 'labels'", "train.py:9")


def test_without_a_traceback_the_last_mindspore_error_line() -> None:
    text = sample("rank0_peer_failed.txt")
    before_traceback = text[:text.index("Traceback")]
    assert extract_root_cause(before_traceback) == RootCauseInLog(
        CauseKind.MINDSPORE_ERROR, "AllReduceCPUKernelMod launch failed.",
        "mindspore/ops/kernel/cpu/native/allreduce_cpu_kernel.cc:89")
    python_log = ("[ERROR] ME(25711:140711421467520,MainProcess):2026-11-23-09:19:18.600.000 "
                  "[mindspore/train/callback/_on_request_exit.py:211] Graceful exit failed [rank 3].\n"
                  "[WARNING] ME(25711:140711421467520,MainProcess):2026-11-23-09:19:18.700.000 "
                  "[mindspore/train/model.py:12] still going\n")
    assert extract_root_cause(python_log) == RootCauseInLog(
        CauseKind.MINDSPORE_ERROR, "Graceful exit failed [rank 3].",
        "mindspore/train/callback/_on_request_exit.py:211")


def test_failing_all_else_the_last_line() -> None:
    text = sample("rank0_peer_failed.txt")
    warnings_only = text[text.index("[INFO] DISTRIBUTED"):]  # what follows the traceback: no error
    assert extract_root_cause(warnings_only) == RootCauseInLog(
        CauseKind.LAST_LINE, "Kill this process with SIGTERM.", "mindspore/ccsrc/cluster/init.cc:135")
    assert extract_root_cause("loading data\nSegmentation fault (core dumped)\n\n  \n") == RootCauseInLog(
        CauseKind.LAST_LINE, "Segmentation fault (core dumped)", None)
    assert extract_root_cause("\n \r\n") is None


def test_the_line_that_said_why_is_not_hidden_by_mindspores_info_logging_at_exit() -> None:
    """A rank that exits with a one-line reason (trainerd's runtime refusing a checkpoint, exit 65) and
    then logs MindSpore's teardown at INFO level: the reason is the cause."""
    tail = ("trainerd_dataset: cannot resume from checkpoint /ckpt/step_00000450: manifest.json is missing\n"
            "[INFO] DISTRIBUTED(25711,7f1c2b7fe640,python):2026-11-29-20:01:02.123.456 "
            "[mindspore/ccsrc/cluster/rpc/core/communicator/tcp_server.cc:314] operator()] Event base dispatch "
            "success!\n"
            "[DEBUG] ME(25711:140711421467520,MainProcess):2026-11-29-20:01:02.200.000 [mindspore/log.py:1] bye\n")
    assert extract_root_cause(tail) == RootCauseInLog(
        CauseKind.LAST_LINE, "trainerd_dataset: cannot resume from checkpoint /ckpt/step_00000450: manifest.json "
        "is missing", None)
    info_only = tail.split("\n", 1)[1]
    assert extract_root_cause(info_only) == RootCauseInLog(  # nothing else: the last of them
        CauseKind.LAST_LINE, "bye", "mindspore/log.py:1")


def test_the_message_is_one_capped_line() -> None:
    cause = extract_root_cause("ValueError: " + "x" * 1000 + "\n")
    assert cause.kind is CauseKind.LAST_LINE
    assert len(cause.message) == MAX_MESSAGE_CHARS and cause.message.endswith("…")
    tail = 'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\nValueError: a\tb   c\n'
    assert extract_root_cause(tail).message == "ValueError: a b c"


def test_non_utf8_output_decoded_with_replacement() -> None:
    raw = b'Traceback (most recent call last):\n  File "/j/train.py", line 3, in <module>\nOSError: bad \xff\xfe name\n'
    cause = extract_root_cause(raw.decode("utf-8", errors="replace"), work_dir="/j")
    assert cause == RootCauseInLog(CauseKind.PYTHON_EXCEPTION, "OSError: bad \ufffd\ufffd name", "train.py:3")


def test_the_causes_read_from_two_ranks_hitting_the_same_bug_are_one_error_to_the_coordinator() -> None:
    """The agent's cause feeds the coordinator's error_key, which ignores a Python exception's numbers."""
    def key(cause: RootCauseInLog | None) -> tuple[str, str]:
        assert cause is not None and cause.location is not None
        return error_key(cause.message, cause.location, cause.kind)
    rank1 = extract_root_cause(sample("rank1_data_missing.txt"), work_dir="/home/alice/mnist")
    rank3 = extract_root_cause(sample("rank1_data_missing.txt").replace("shard-1", "shard-3"),
                                  work_dir="/home/alice/mnist")
    assert rank1 != rank3 and key(rank1) == key(rank3)
    peer = extract_root_cause(sample("rank0_peer_failed.txt"), work_dir="/home/alice/mnist")
    assert key(rank1) != key(peer)
    assert rank1 is not None and key(rank1) != key(RootCauseInLog(rank1.kind, rank1.message, "train.py:18"))
    # a MindSpore error is compared whole: its numbers say which peer timed out, in which process
    timeout = RootCauseInLog(CauseKind.MINDSPORE_ERROR, "The node: 1 is timed out at 0x7f49e4f9e6c0.", "x.cc:548")
    assert key(timeout) != key(RootCauseInLog(CauseKind.MINDSPORE_ERROR, "The node: 1 is timed out at 0x7f00.",
                                            "x.cc:548"))
