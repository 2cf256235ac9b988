from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizers and token caches go to a per-session temp folder, never ~/.cache."""
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path_factory.getbasetemp() / "shoal-cache"))


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture
def swarm(tmp_path):
    """Real shoal processes on loopback; every one is ended by pid when the test ends."""
    from tests.helpers.processes import Swarm

    launched = Swarm(tmp_path)
    try:
        yield launched
    finally:
        launched.close()
