"""Runs tests/kernel/test_triton_kernels.py under the Triton interpreter, in a child process.

TRITON_INTERPRET=1 must be set before triton is first imported (transformers
imports it too), so it cannot be switched on inside this process without
changing every other test module here; the child gets it from the start.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).with_name("test_triton_kernels.py")
MIN_TESTS = 27  # the module's test count when all run: fewer means some were skipped or lost


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (it is in the test extra: pip install -e '.[test]')")
def test_triton_kernels_pass_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(KERNEL_TESTS)],
                          cwd=KERNEL_TESTS.parents[2], env=env, capture_output=True, text=True, timeout=500)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= MIN_TESTS and "skipped" not in summary, summary


@pytest.mark.parametrize("argv, env, message", [
    (["--kernels", "triton"], {}, "kernels=triton on cpu"),
    ([], {"DEEPINFER_KERNELS": "bogus"}, "kernels must be one of"),
])
def test_a_worker_refuses_impossible_kernels_in_one_line_before_loading_the_model(argv, env, message, monkeypatch,
                                                                                    capsys):
    from deepinfer.decode.service import DecodeService

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        DecodeService.main(["--model", "/nonexistent", *argv], "decode")
    assert e.value.code == 2 and message in capsys.readouterr().err
