"""Shared test setup: CPU tests run the blockwise path with tiny tiles, so that even short
sequences cross tile borders (odd lengths, partial and diagonal tiles)."""
import os

# One intra-op thread unless the environment asks for more: the tests' tensors are tiny, and
# pytest-xdist runs a worker per core, so a second OpenMP thread only spins against the
# other worker (and the subprocesses some tests start) for the same cores.
ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
if ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"     # before torch is imported, for inductor's C++ too
# Inductor compiles in-process: a pool of compile workers in every process that compiles
# (each worker, each example, each rank) costs CPU that a 2-core machine, its cores all
# busy here, does not have (examples/quickstart.py: 76.5 CPU-seconds with the pool, 69.9 without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels without SIMD: the tests compare compiled code with eager code on tiny
# tensors, and vectorized C++ (at::vec templates, after probing the CPU's instruction sets in
# every process) compiles ~3x slower: 22 s against 7 s for test_backend.py's first inductor
# test from a cold cache, 103 s against 79 s for six of the slowest inductor tests.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import collections  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if ONE_THREAD:
    torch.set_num_threads(1)    # in case a plugin imported torch before this file ran

from bob_compile.backend import counters, recent_reports  # noqa: E402
from bob_compile.kernels import blockwise, settings  # noqa: E402


@pytest.hookimpl(tryfirst=True)      # before -m deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    """A test marked `sweep` runs its first parametrization in the default tier and the
    others in the slow tier.

    Tests marked interpreter_subprocess run in the TRITON_INTERPRET=1 subprocess that
    test_kernels_under_the_interpreter starts: outside it they are deselected (counted as
    "deselected" in the summary, not mistaken for skipped GPU tests)."""
    seen = set()
    for item in items:
        if item.get_closest_marker("sweep"):
            function = (item.path, item.originalname)
            if function in seen:
                item.add_marker(pytest.mark.slow)
            seen.add(function)
    if os.environ.get("TRITON_INTERPRET") != "1":
        elsewhere = [item for item in items if item.get_closest_marker("interpreter_subprocess")]
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            items[:] = [item for item in items
                        if not item.get_closest_marker("interpreter_subprocess")]
    # tests that start a subprocess first (a stable sort): with one worker per core, a long
    # one started last would leave the other workers idle at the end
    items.sort(key=lambda item: item.get_closest_marker("spawns") is None)
    # tests marked gpu are skipped without a CUDA device
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session):
    """Compile the C++ node in the background while the tests before its first user run
    (the `cpp_node` fixture then waits for it): ~80 s of a 2-core machine."""
    if any("cpp_node" in getattr(item, "fixturenames", ()) for item in session.items):
        from bob_compile.eager import node as eager_node
        eager_node.extension(wait=False)


def pytest_terminal_summary(terminalreporter):
    """The counts of the OpInfo sweep's outcomes (test_opinfo_second_order.py), gathered
    from each test's recorded property (pytest-xdist hands those to the controller)."""
    outcomes = [value for status in ("passed", "failed") for report in terminalreporter.stats.get(status, [])
                if report.when == "call" for key, value in report.user_properties
                if key == "opinfo_outcome"]
    if not outcomes:
        return
    kinds = collections.Counter(kind for _, kind, _ in outcomes)
    terminalreporter.section("second order of OpInfo ops")
    terminalreporter.write_line(", ".join(f"{kind}: {n}" for kind, n in kinds.most_common())
                                + f" (of {len(outcomes)})")
    for name, kind, reason in sorted(outcomes, key=lambda o: (o[1], o[0])):
        if kind != "compiled":
            terminalreporter.write_line(f"  {kind}: {name}: {reason}")


@pytest.fixture(autouse=True)
def small_tiles():
    with blockwise.tiles(q=4, k=3):
        yield


@pytest.fixture(autouse=True)
def reread_settings():
    """The kernels read BOB_COMPILE_* once (bob_compile/kernels/settings.py); tests that change one use
    monkeypatch.setenv and then settings.reload(). Read them again after each test, once
    monkeypatch has restored the environment (this fixture is set up before the test's
    monkeypatch, so torn down after it), so that no choice leaks into later tests."""
    settings.reload()
    yield
    settings.reload()


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture
def tiles_at_any_size(monkeypatch):
    """FlexAttention's tile-by-tile and relative-bias routes at a test's small sizes: by
    default a mask of at most block_masks.TILES_ABOVE_BYTES is materialized, and relative
    biases go as rows only with BOB_COMPILE_DEV_RELATIVE_ROWS=1."""
    from bob_compile import block_masks
    monkeypatch.setattr(block_masks, "TILES_ABOVE_BYTES", 0)
    monkeypatch.setenv("BOB_COMPILE_DEV_RELATIVE_ROWS", "1")
    settings.reload()


@pytest.fixture
def fresh_dynamo():
    """No compiled graph, recompile count, backend report or counter leaks between tests."""
    torch._dynamo.reset()
    recent_reports.clear()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def cpp_node():
    """The module of the op's C++ autograd node (bob_compile/eager/node.py), built or loaded
    once per session."""
    from bob_compile.eager import node as eager_node
    module = eager_node.extension(wait=True)
    if module is None:
        pytest.fail("the C++ node did not build (see the logged warning)")
    return module
