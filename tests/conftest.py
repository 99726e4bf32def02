"""Shared test setup: CPU tests run the blockwise path with tiny tiles, so that even short
sequences cross tile borders (odd lengths, partial and diagonal tiles)."""
import pytest
import torch

from bob_compile.backend import counters, recent_reports
from bob_compile.kernels import blockwise, settings


@pytest.fixture(autouse=True)
def small_tiles():
    with blockwise.tiles(q=4, k=3):
        yield


@pytest.fixture(autouse=True)
def reread_settings():
    """The kernels read BOB_COMPILE_* once (kernels/settings.py); tests that change one use
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
def fresh_dynamo():
    """No compiled graph, recompile count, backend report or counter leaks between tests."""
    torch._dynamo.reset()
    recent_reports.clear()
    counters.clear()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
