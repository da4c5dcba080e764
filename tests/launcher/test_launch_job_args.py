"""Launch speaks for the script: its options reach it, `-m` without `--` says what to type, a traceback is named."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from gpuwatch.launcher.job_args import torchrun_job_args
from gpuwatch.launcher.torchrun_output import Failure, TorchrunOutput, failure_lines


@pytest.mark.parametrize(
    ("job", "script", "module", "args"),
    [
        (("train.py", "--log", "x.txt", "--node", "3"), "train.py", False, ["--log", "x.txt", "--node", "3"]),
        (("-m", "pkg.train", "--log-dir", "d", "--standalone"), "pkg.train", True, ["--log-dir", "d", "--standalone"]),
    ],
)
def test_torchrun_hands_the_scripts_own_options_to_the_script(
    job: tuple[str, ...], script: str, module: bool, args: list[str]
) -> None:
    parsed = get_args_parser().parse_args(["--nproc-per-node", "2", *torchrun_job_args(job)])

    assert (parsed.training_script, parsed.module, parsed.training_script_args) == (script, module, args)
    assert parsed.nproc_per_node == "2" and parsed.log_dir is None and not parsed.standalone


def test_a_module_without_the_separator_is_told_what_to_type() -> None:
    given = [sys.executable, "-m", "gpuwatch", "launch", "--nproc-per-node", "2", "-m", "pkg.train", "--lr", "3"]
    done = subprocess.run(given, capture_output=True, text=True, timeout=60)

    assert done.returncode == 2
    assert done.stderr.strip() == (
        "gpuwatch launch: error: the job goes after --: gpuwatch launch --nproc-per-node 2 -- -m pkg.train --lr 3"
    )


def test_a_rank_that_died_of_a_traceback_is_named_by_its_exception_whatever_its_name() -> None:
    output = TorchrunOutput(io.BytesIO(), io.BytesIO())
    output.feed(
        b"[default1]:Traceback (most recent call last):\n"
        b'[default1]:  File "train.py", line 9, in <module>\n'
        b"[default1]:    check(config)\n"
        b"[default1]:__main__.BadConfig: lr must be positive, not -3\n"
    )
    (line,) = failure_lines([Failure(1, 1, 1, 42)], output.last_error, "/tmp/log", "gpuwatch launch")

    assert "exited 1, its last error line: __main__.BadConfig: lr must be positive, not -3;" in line
    assert "no error line of its own" not in line
