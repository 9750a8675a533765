"""The oldest torch vision_ckpt works with, checked when the package is imported.

The core saves a region's inputs with ``torch._C._autograd._make_saved_tensor`` and finds the
user's saved-tensor hooks with ``torch._C._autograd._top_saved_tensors_default_hooks``; what a
selective region keeps goes through those hooks only where torch's selective-checkpoint mode
honours ``respect_saved_tensors_hooks`` (new in 2.14). The test suite was run on older
releases (2.14.1 is the reference):

* 2.4.1 and 2.6.0: ``_top_saved_tensors_default_hooks`` does not exist (AttributeError at the
  first checkpoint);
* 2.8.0 and 2.11.0: no ``_make_saved_tensor``. The fallback that saves inputs through an
  autograd Function failed on nested regions until NOTE [ Inputs saved through a Function ]
  was met. On 2.11.0 the core's tests and every level's exactness test now pass, but 35
  other tests do not: memory expectations (a level's peak against the level below, where a
  step peaks) differ, and torch.compile breaks the graph at every region (2.11's checkpoint
  operator refuses the wrapper's write of the ambient level). So the floor stays;
* 2.12.1: the core works, but the tests of that fallback failed the same way;
* 2.13.0: the checkpoint core works, but its selective-checkpoint mode has no
  ``respect_saved_tensors_hooks``: what a selective region keeps bypasses the saved-tensor
  hooks, so ``count_saved_bytes`` counts a selective region as keeping its input alone (a
  two-MLP model: 16 KiB, the same as full regions, against 88 KiB on 2.14.1) and
  ``save_on_cpu`` leaves its kept outputs on the device. The planner's and the derivation's
  menus are built on that count: on torch 2.11 on a GPU they priced every selective region as
  lean as a full one and derived levels 1-4 far above their goals
  (``benchmarks/results/gpu_check_derive``). So the floor is 2.14.

The check reads the installed distribution's version without importing torch, so
``vision_ckpt.config`` stays usable where torch is not installed at all.
"""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["MIN_TORCH", "installed_torch_version", "check_torch_version", "require_torch"]

MIN_TORCH = (2, 14)
"""The oldest (major, minor) torch release the test suite passed on."""


def installed_torch_version() -> str | None:
    """The version of the installed ``torch`` distribution, or ``None`` if it is not installed."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_torch_version(version: str | None) -> None:
    """Raise ``ImportError`` if ``version`` is older than :data:`MIN_TORCH`.

    ``None`` (torch not installed) and version strings that do not start with ``major.minor``
    pass: there is nothing to compare.

    >>> check_torch_version("2.14.1+cu128")
    >>> check_torch_version("2.4.1")
    Traceback (most recent call last):
    ...
    ImportError: vision_ckpt needs torch>=2.14, found torch 2.4.1. ...
    """
    if version is None:
        return
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= MIN_TORCH:
        return
    floor = ".".join(map(str, MIN_TORCH))
    raise ImportError(
        f"vision_ckpt needs torch>={floor}, found torch {version}. The checkpoint core uses "
        f"autograd entry points that older releases lack. Upgrade with: "
        f'pip install "torch>={floor}"'
    )


def require_torch() -> None:
    """Check the installed torch against :data:`MIN_TORCH` (see :func:`check_torch_version`)."""
    check_torch_version(installed_torch_version())
