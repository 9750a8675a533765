"""Settings for everything pytest runs here: the tests in ``tests/`` and the package's doctests.

``python -m pytest`` runs the ``>>>`` examples of every ``vision_ckpt`` module
(``--doctest-modules`` in pyproject.toml); ``tests/conftest.py`` holds the fixtures of the tests.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator

import pytest
import torch

# An integration's doctests import the library it is for; without the extra, skip its module.
collect_ignore = [
    f"vision_ckpt/integrations/{name}.py"
    for name, library in (("lightning", "lightning"),)
    if importlib.util.find_spec(library) is None
]

# The suite runs tiny models, where intra-op threads only add scheduling overhead; on a busy
# machine OpenMP's spinning worker threads made single steps up to 100x slower. One thread keeps
# the suite fast and its timings stable. (Benchmarks and examples keep torch's default.)
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Every test and doctest runs on one thread, and a test that changes the count (an
    example script, a benchmark helper) does not leak it into the next."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


# The registry's module-level state: what register_preset adds to and preset_for_model caches.
_REGISTRY_STATE = ("_selectors", "_registered", "_cache", "_registered_families")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset registry as a copy for the test: presets it registers are gone afterwards."""
    from vision_ckpt.config import presets

    for name in _REGISTRY_STATE:
        monkeypatch.setattr(presets, name, copy.copy(getattr(presets, name)))


@pytest.fixture(autouse=True)
def _isolated_doctest(request: pytest.FixtureRequest) -> Iterator[None]:
    """A doctest starts at training level 0 and leaves no global state behind: the level and
    the preset registry (the presets examples register a preset) are put back afterwards."""
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    import vision_ckpt

    request.getfixturevalue("scratch_registry")
    vision_ckpt.set_training_level(0)
    try:
        yield
    finally:
        vision_ckpt.set_training_level(0)
