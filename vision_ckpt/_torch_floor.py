"""The oldest torch vision_ckpt supports, checked when the package is imported.

:data:`MIN_TORCH` is the release CI tests the contract on (``.ci/run``, in an environment built
from ``.ci/floor-constraints.txt``); the newest release is tested by the default install, and
the compile tests also run on a release between (``.ci/middle-constraints.txt``). What
differs between the supported releases is detected in one module, ``vision_ckpt._compat``,
which lists each such entry point with the release it is native from and the fallback used
before it.

The check reads the installed distribution's version without importing torch, so
``vision_ckpt.config`` stays usable where torch is not installed at all.
"""

from __future__ import annotations

import importlib.metadata
import re

__all__ = ["MIN_TORCH", "installed_torch_version", "check_torch_version", "require_torch"]

MIN_TORCH = (2, 6)
"""The oldest (major, minor) torch release supported: the one CI tests the contract on."""


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
    ImportError: vision_ckpt needs torch>=2.6, found torch 2.4.1. ...
    """
    if version is None:
        return
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= MIN_TORCH:
        return
    floor = ".".join(map(str, MIN_TORCH))
    raise ImportError(
        f"vision_ckpt needs torch>={floor}, found torch {version}. The checkpoint core uses "
        f"autograd and selective-checkpoint entry points that older releases lack or that "
        f"vision_ckpt does not test there. Upgrade with: "
        f'pip install "torch>={floor}"'
    )


def require_torch() -> None:
    """Check the installed torch against :data:`MIN_TORCH` (see :func:`check_torch_version`)."""
    check_torch_version(installed_torch_version())
