"""The tests that load ONNX Runtime or OpenVINO (marked own_process) in a pytest process of their
own: run in one process with the trainer's tests, whose DataLoader workers fork it, the process
crashed with a segmentation fault (Intel Xeon with AMX), after every test had passed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OWN_PROCESS, OWN_PROCESS_FILES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_the_tests_that_load_onnx_runtime_or_openvino_pass_in_a_process_of_their_own(request):
    files = request.config.stash[OWN_PROCESS_FILES]
    args = [sys.executable, "-m", "pytest", "-m", "own_process", "-p", "no:cacheprovider", "-q", *files]
    precision = request.config.getoption("--embedding-precision")
    if precision:
        args += ["--embedding-precision", precision]
    done = subprocess.run(
        args, cwd=REPO, env={**os.environ, OWN_PROCESS: "1"}, capture_output=True, text=True, timeout=1800
    )
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
    assert done.returncode == 0, f"the own_process tests failed (exit status {done.returncode}):\n{tail}"
    assert " passed" in tail and " failed" not in tail
