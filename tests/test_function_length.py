"""No function of the package is longer than :data:`LIMIT` lines (issue 25), read from its
source with ``ast`` (nothing is imported).

A function's length runs from its ``def`` line to its last line, docstring included
(``end_lineno - lineno + 1``; decorators are not counted). Methods and nested functions count
on their own, named ``Class.method`` and ``outer.inner``. A long docstring may stay: split the
code into well-named helpers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vision_ckpt"
LIMIT = 80

# Functions over the limit that are being split right now (issue 25), as (file, function),
# e.g. ("vision_ckpt/cli/main.py", "_parser"): skipped by test_no_function_is_over_the_limit. The
# set only shrinks: an entry whose function is no longer over the limit (or no longer exists)
# fails test_pending_functions_are_still_long, so the change that splits a function deletes its
# entry here. Empty now: every split of issue 25 has landed.
PENDING: set[tuple[str, str]] = set()

_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, _Function]]:
    """Every function under ``node`` with its dotted name, outermost first."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def _lengths() -> list[tuple[str, str, int, int]]:
    """(file, function, line of its ``def``, length) for every function of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        file = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=file)
        for name, node in _functions(tree):
            out.append((file, name, node.lineno, node.end_lineno - node.lineno + 1))
    return out


def test_the_package_is_read() -> None:
    # Guards the two tests below against passing on an empty or misplaced package.
    files = {file for file, *_ in _lengths()}
    assert "vision_ckpt/regions/apply.py" in files and "vision_ckpt/integrations/hf.py" in files
    assert len(_lengths()) > 100


def test_no_function_is_over_the_limit() -> None:
    long = [
        f"{file}:{line} {name} is {length} lines"
        for file, name, line, length in _lengths()
        if length > LIMIT and (file, name) not in PENDING
    ]
    assert not long, (
        f"functions longer than {LIMIT} lines (from the def line to the last, docstring "
        "included):\n  " + "\n  ".join(long) + "\nSplit each into well-named helpers (issue "
        "25); a long docstring may stay, shorten the code."
    )


def test_pending_functions_are_still_long() -> None:
    lengths: dict[tuple[str, str], int] = {}
    for file, name, _, length in _lengths():
        lengths[file, name] = max(length, lengths.get((file, name), 0))
    done = [
        f"{file} {name}: "
        + (f"{lengths[file, name]} lines" if (file, name) in lengths else "no such function")
        for file, name in sorted(PENDING)
        if lengths.get((file, name), 0) <= LIMIT
    ]
    assert not done, (
        f"PENDING in {Path(__file__).name} lists functions that are no longer over {LIMIT} "
        "lines; delete their entries so the set shrinks as the splits land:\n  " + "\n  ".join(done)
    )
