"""The ``vision-ckpt`` command line: the only code in vision_ckpt that prints or exits."""

from __future__ import annotations

import argparse
import sys

from ._version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vision-ckpt",
        description="Activation checkpointing for vision models: levels 0-5, one training level.",
    )
    parser.add_argument("--version", action="version", version=f"vision-ckpt {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vision-ckpt`` console script; returns the exit code."""
    parser = _parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
