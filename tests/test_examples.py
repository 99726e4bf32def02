"""The examples at their tiny default sizes: each must finish and pass its own numeric check
(it exits non-zero when flashbob's numbers differ from eager math attention, or when flashbob
replaced no attention). Each runs in a fresh interpreter, as a user would run it, so that no
Dynamo cache or tile setting of this test process leaks in.

In the default tier: the README's main job (quickstart.py) and the two-process run; the
others cover what the default tier's own tests cover, and run in the slow tier."""
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name, *args, timeout=300, python_prefix=()):
    """The stdout of `python examples/<name> <args>`, once it exited 0."""
    # One intra-op thread: the tiny default sizes gain nothing from more, and on a busy
    # 2-core machine torch's spinning OpenMP threads made the same run 5-10x slower.
    # PYTHONFAULTHANDLER: a run that outlives its timeout is sent SIGABRT (each process of
    # its session: torchrun's ranks too), and every Python process prints where it was
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, *python_prefix, str(EXAMPLES / name), *args]
    process = subprocess.Popen(command, env=env, cwd=EXAMPLES.parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:   # a launcher that outlives its children
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s; where it was:\n"
                    f"{(stdout + stderr)[-12000:]}")
    output = stdout + stderr
    assert process.returncode == 0, f"{command} exited with {process.returncode}:\n{output[-6000:]}"
    return stdout


def torchrun_two_processes():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return ("-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={port}")


pytestmark = pytest.mark.spawns
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

@pytest.mark.slow
@pytest.mark.parametrize("name", ["maml.py", "sophia_h.py", "func_hvp.py", "hf_gpt2.py",
                                  "distributed_sophia_h.py"])
def test_help(name):
    assert "--device" in run_example(name, "--help")


@pytest.mark.slow
def test_maml():
    out = run_example("maml.py")
    assert "first-order MAML differs from second-order" in out
    assert "stock torch.compile(backend='aot_eager')" in out  # its outcome is reported, whatever it is
    assert "check flashbob meta-gradient vs eager math attention (second order)" in out
    assert "all checks passed" in out


@pytest.mark.slow
def test_sophia_h():
    out = run_example("sophia_h.py")
    assert out.count("(with Hessian estimate)") >= 2
    assert "check Hessian-vector product (trained weights)" in out
    assert "all checks passed" in out


def test_distributed_sophia_h():
    """torchrun with 2 CPU processes (gloo): DDP around the compiled model, the Hessian step
    averaged over the ranks, checked against one process on the concatenated batch."""
    out = run_example("distributed_sophia_h.py", "--steps", "3", "--n-layer", "1",
                      python_prefix=torchrun_two_processes())
    assert out.count("all checks passed") == 2
    assert "rank 1 Hessian-vector product (trained weights)" in out
    assert "samples/s" in out


def test_distributed_sophia_h_says_how_to_launch():
    result = subprocess.run([sys.executable, str(EXAMPLES / "distributed_sophia_h.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "launch with torchrun" in result.stderr


@pytest.mark.slow
def test_func_hvp():
    out = run_example("func_hvp.py")
    assert "check jvp(grad) HVP vs eager math attention" in out
    assert "check grad(grad) HVP vs eager math attention" in out
    assert "all checks passed" in out


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed "
                    "(optional extra: pip install -e '.[examples]')")
def test_hf_gpt2():
    out = run_example("hf_gpt2.py")
    assert "check sdpa: Hessian-vector product" in out
    assert "check eager: Hessian-vector product" in out
    assert "all checks passed" in out


# Runs a script as `python script.py` would (its folder first on sys.path), but with
# `import transformers` failing, installed or not.
WITHOUT_TRANSFORMERS = ("-c", "import os, runpy, sys; sys.modules['transformers'] = None; "
                              "sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
                              "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_hf_gpt2_skips_cleanly_without_transformers():
    out = run_example("hf_gpt2.py", python_prefix=WITHOUT_TRANSFORMERS)
    assert "skipped: this example needs Hugging Face transformers" in out


def test_quickstart():
    """The README's main job."""
    out = run_example("quickstart.py")
    assert "+" in out and "bob_compile_attention" in out      # it shows the graph diff
    assert "all checks passed" in out


def test_checks_fail_loudly():
    """The examples' pass/fail helpers: a large or non-finite error fails, and so does a
    flashbob run that replaced no attention (it would match eager trivially)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import _common
    finally:
        sys.path.remove(str(EXAMPLES))
    import torch
    from torch._dynamo.utils import counters
    ref = [torch.ones(3)]
    assert _common.check("same", [torch.ones(3)], ref, 1e-6)
    assert not _common.check("off by 1%", [torch.full((3,), 1.01)], ref, 1e-4)
    assert not _common.check("nan", [torch.tensor([1.0, float("nan"), 1.0])], ref, 1e-4)
    assert _common.finish(True) == 0 and _common.finish(False) == 1
    saved = dict(counters["flashbob"])
    counters["flashbob"].clear()
    try:
        assert not _common.attention_replaced("flashbob")
        counters["flashbob"]["sdpa_replaced"] += 1
        assert _common.attention_replaced("flashbob")
        counters["flashbob"]["fallback"] += 1
        assert not _common.attention_replaced("flashbob")
    finally:
        counters["flashbob"].clear()
        counters["flashbob"].update(saved)
