"""Shared test helpers, exposed as fixtures so that test modules never import this file.

- ``assert_exact(actual, expected)``: bit-exact comparison of tensors inside any nesting of
  lists, tuples and dicts (other leaves compared with ``==``).
- ``exact_step(model, x, *, seed=0, loss=None)``: the exactness oracle's training step; its
  result, compared with ``assert_exact`` against the same model without checkpointing, checks the
  output, the input gradient, every parameter gradient and every buffer bit for bit.
- ``scratch_preset(rules, name="scratch")``: registers a preset for this test only and returns
  its name; ``rules`` is a list of rules or the name of one of the fixture presets below
  (``"vit_like"``). A test of the machinery (plan, apply, runs, groups, lean) uses one, so that
  tuning a shipped preset under ``configs/presets/`` never breaks it.
- ``saved_bytes``: the library's ``count_saved_bytes``, a context manager that counts the bytes
  autograd packs for backward while it is active (each storage counted once).
- ``op_counter``: a context manager class that counts the aten ops dispatched while it is active.
- ``core_calls``: a list that records every call of the core's ``checkpoint`` during the test
  (the wrapper and ``apply`` reach the core through the module attribute, so this sees them).
- every test starts and ends at global training level 0.
- the markers ``needs_fsdp2_cpu`` and ``needs_fake_cuda`` skip a test on a torch that lacks
  the feature (FSDP2's collectives on CPU streams; faking CUDA tensors without a driver): the
  floor run of ``.ci/run`` meets such a torch.

Torch runs on one thread here: see the repository's top-level ``conftest.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _fake_cuda_works() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = torch.nn.Linear(2, 2)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer.to("cuda")(torch.empty(1, 2, device="cuda"))
    except (RuntimeError, AssertionError):
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lacks = {
        "needs_fsdp2_cpu": lambda: not hasattr(torch.cpu.Stream, "record_event"),
        "needs_fake_cuda": lambda: not _fake_cuda_works(),
    }
    why = {
        "needs_fsdp2_cpu": f"FSDP2 on CPU needs a newer torch than {torch.__version__}",
        "needs_fake_cuda": f"torch {torch.__version__} cannot fake CUDA without a driver",
    }
    known: dict[str, bool] = {}
    for item in items:
        for marker, missing in lacks.items():
            if item.get_closest_marker(marker) is None:
                continue
            if marker not in known:
                known[marker] = missing()
            if known[marker]:
                item.add_marker(pytest.mark.skip(reason=why[marker]))


def _assert_exact(actual: Any, expected: Any, where: str = "value") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
        if expected.device.type == "meta" or actual.device.type == "meta":
            assert (actual.shape, actual.dtype, actual.device) == (
                expected.shape,
                expected.dtype,
                expected.device,
            ), f"{where}: metadata differs"
            return
        torch.testing.assert_close(
            actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}"
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual)}"
        assert actual.keys() == expected.keys(), f"{where}: keys differ"
        for key in expected:
            _assert_exact(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_exact(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _float_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_leaves(v)]
    return []


def default_loss(out: Any) -> torch.Tensor:
    """``square().mean() + sum()`` over every floating tensor of the output, in float32: each
    element gets its own gradient, ``1 + 2 * element / numel``."""
    leaves = [t.float() for t in _float_leaves(out)]
    assert leaves, f"no floating tensor in the model's output of type {type(out).__name__}"
    return sum(t.square().mean() + t.sum() for t in leaves)


def _exact_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    *,
    seed: int = 0,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> dict[str, Any]:
    # NOTE: the step starts with no gradients (``zero_grad(set_to_none=True)``), so stepping the
    # same model twice compares each step's gradients, never a sum over steps; ``x`` is copied
    # to a fresh leaf (floating inputs require grad), so the caller's tensor is never changed.
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)  # dropout and drop-path draw the same masks in every run
    out = model(x)
    (loss or default_loss)(out).backward()
    return {
        "out": _detached(out),
        "x_grad": x.grad,
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


class OpCounter(TorchDispatchMode):
    """Count aten ops by packet name (``"mm"``, ``"sin"``...): ``with OpCounter() as c: ...``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def assert_exact():
    """The bit-exact nested comparison (see the module docstring)."""
    return _assert_exact


@pytest.fixture
def exact_step():
    """The exactness oracle's step: ``exact_step(model, x, seed=0, loss=None)`` clears the
    gradients, seeds torch, runs ``model`` on a copy of ``x`` and backward of ``loss(out)``
    (:func:`default_loss` unless given), and returns ``{"out", "x_grad", "grads", "buffers"}``
    (gradients and buffers by name, cloned). ``assert_exact(step(m, x), step(plain, x))`` is
    the oracle."""
    return _exact_step


# Fixture presets: the levels of a shipped preset as they were when the tests using them were
# written, frozen here so that tuning configs/presets/*.yaml changes no machinery test.
FIXTURE_PRESETS: dict[str, list[dict[str, Any]]] = {
    # configs/presets/vit.yaml for a timm VisionTransformer: selective layers, full MLPs, full
    # layers, groups of about sqrt(depth) layers, lean MLPs and attention halves as runs.
    "vit_like": [
        {"match": "blocks.*", "level": 1, "keep": "heavy"},
        {"match": "blocks.*.mlp", "level": 2},
        {"match": "blocks.*", "level": 3},
        {"match": "blocks", "level": 4, "segments": "auto"},
        {"match": "blocks.*.mlp", "level": 5, "lean": True},
        {"match": "blocks.*.norm1", "level": 5, "through": "drop_path1"},
    ],
}


@pytest.fixture
def scratch_preset(scratch_registry: None) -> Callable[..., str]:
    """``scratch_preset(rules, name="scratch")`` registers a preset in the test's copy of the
    registry (the top-level ``scratch_registry``) and returns its name, for ``{"preset": name}``
    or ``apply_preset(model, level, preset=name)``. ``rules`` is a list of rules (dicts as in a
    config) or the name of a fixture preset (:data:`FIXTURE_PRESETS`), registered under that
    name."""
    from vision_ckpt.config import CheckpointConfig
    from vision_ckpt.config.presets import register_preset

    def register(rules: list[dict[str, Any]] | str, name: str = "scratch") -> str:
        if isinstance(rules, str):
            name, rules = rules, FIXTURE_PRESETS[rules]
        register_preset(name, CheckpointConfig(rules=rules))
        return name

    return register


@pytest.fixture
def saved_bytes():
    """The library's own counter, :func:`vision_ckpt.measure._memory.count_saved_bytes`: ``with
    saved_bytes() as c: ...; c.nbytes``."""
    from vision_ckpt.measure._memory import count_saved_bytes

    return count_saved_bytes


@pytest.fixture
def op_counter():
    """The :class:`OpCounter` class: instantiate it as a context manager."""
    return OpCounter


@pytest.fixture(autouse=True)
def _reset_training_level() -> Any:
    import vision_ckpt

    vision_ckpt.set_training_level(0)
    yield
    vision_ckpt.set_training_level(0)


class CoreCalls(list):
    """The functions handed to the core, with what the caller told it of each region."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: list[str | None] = []
        self.modules: list[Any] = []


@pytest.fixture
def core_calls(monkeypatch: pytest.MonkeyPatch) -> CoreCalls:
    """Every function passed to the core (``checkpoint`` or the wrapper's ``checkpoint_region``)
    while the test runs; ``.labels`` and ``.modules`` hold the region names and modules the
    wrapper gave (``None`` for direct ``checkpoint`` calls)."""
    import vision_ckpt

    calls = CoreCalls()
    core = vision_ckpt.runtime._core
    real, real_region = core.checkpoint, core.checkpoint_region

    def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn)
        calls.labels.append(None)
        calls.modules.append(None)
        return real(fn, *args, **kwargs)

    def counting_region(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(fn)
        calls.labels.append(kwargs.get("label"))
        calls.modules.append(kwargs.get("module"))
        return real_region(fn, *args, **kwargs)

    monkeypatch.setattr(core, "checkpoint", counting)
    monkeypatch.setattr(core, "checkpoint_region", counting_region)
    return calls
