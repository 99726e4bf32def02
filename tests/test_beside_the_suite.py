"""Test modules that a second pytest process runs beside the rest of the suite.

`.ci/run` runs on two cores. The examples, the Triton-interpreter suite and the distributed
ranks (early_start.py) keep the second core busy only for the first half of the suite; these
modules' tests (self-contained: Hugging Face models built from small configs) then run in a
second pytest process started when collection ends, and this test reports its result.
conftest.py moves the selected tests of MODULES into it whenever this test is selected too,
in a plain (not pytest-xdist) session; run alone, or with this test deselected, they run in
this process as usual.
"""
import os
import pathlib
import sys

import pytest
from early_start import Subprocess

MODULES = ("test_hf_masks.py", "test_hf_architectures.py", "test_hf_checkpointing.py")
INSIDE = os.environ.get("BOB_COMPILE_TESTS_BESIDE") == "1"    # this is the second process
NODE_IDS = []       # the tests conftest.py moved here, as pytest node ids

EARLY_SUBPROCESSES = {"test_modules_beside_the_suite": Subprocess(
    lambda: [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NODE_IDS],
    env=dict(os.environ, BOB_COMPILE_TESTS_BESIDE="1"),
    cwd=pathlib.Path(__file__).resolve().parent.parent, timeout=1800)}


def test_modules_beside_the_suite():
    if not NODE_IDS:
        pytest.skip("no test of MODULES was moved to a second process (they run here)")
    done = EARLY_SUBPROCESSES["test_modules_beside_the_suite"].result()
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
    print(done.stdout.strip().splitlines()[-1])        # the second process's summary
