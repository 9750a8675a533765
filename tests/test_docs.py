"""The documentation: rendered parts fresh, the README's promises kept, hand-written pages
manuals under their line limit, every relative link resolving to a file.

The rendered parts (docs/benchmarks.md, the README's frontier table, the preset tables of
docs/presets.md) come from ``benchmarks/render_docs.py``; regenerate them with
``python benchmarks/render_docs.py`` when a test here says they are out of date.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from importlib.metadata import version
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP_COMMANDS = (
    "pip install -e . && vision-ckpt profile --model vit_small_patch16_224 --batch-size 8 "
    "--steps 2",
    'pip install -e ".[dev]" && python -m pytest -q',
)
DOCS = [
    README,
    ROOT / "CHANGELOG.md",
    ROOT / "ARCHITECTURE.md",
    ROOT / "configs" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]


@pytest.fixture(scope="module")
def render_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "render_docs", ROOT / "benchmarks" / "render_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stale(render_docs: ModuleType, part: str) -> str:
    path, text = render_docs.rendered(part)
    if path.read_text() == text:
        return ""
    return (
        f"{path.relative_to(ROOT)} is out of date with its source: run "
        "python benchmarks/render_docs.py"
    )


def test_benchmarks_doc_is_rendered_from_the_results(render_docs: ModuleType) -> None:
    assert not _stale(render_docs, "benchmarks"), _stale(render_docs, "benchmarks")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    results = ROOT / "benchmarks" / "results"
    for path in sorted(results.glob("**/*.json")):
        key = path.parent if path.name == "results.json" else path.with_suffix("")
        shown = str(path.relative_to(ROOT)) in text  # a section's source
        older = f"`{key.relative_to(results)}`" in text  # named as a run a newer one replaced
        assert shown or older, f"{path} has no section and is not named as an older run"


def test_readme_frontier_table_is_rendered(render_docs: ModuleType) -> None:
    assert not _stale(render_docs, "readme"), _stale(render_docs, "readme")


def test_presets_doc_is_rendered_from_plan(render_docs: ModuleType) -> None:
    text = (ROOT / "docs" / "presets.md").read_text()
    # Module names come from the model libraries: at other versions the tables may differ
    # without any preset having changed.
    libs = ("timm", "torchvision", "transformers", "segmentation_models_pytorch", "monai")
    for lib in libs:
        if f"{lib} {version(lib)}" not in text:
            pytest.skip(f"docs/presets.md was rendered with another {lib} than {version(lib)}")
    assert not _stale(render_docs, "presets"), _stale(render_docs, "presets")


def test_check_mode_fails_on_a_stale_file(
    render_docs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    stale = tmp_path / "benchmarks.md"
    stale.write_text(render_docs.render_benchmarks().replace("| L3 |", "| L3 (edited) |", 1))
    monkeypatch.setattr(render_docs, "BENCHMARKS_MD", stale)
    assert render_docs.main(["--check", "--only", "benchmarks"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert render_docs.main(["--only", "benchmarks"]) == 0  # rewrites it
    assert render_docs.main(["--check", "--only", "benchmarks"]) == 0


def test_a_results_file_of_unknown_shape_still_gets_a_section(
    render_docs: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "gpu_run"
    run.mkdir()
    rows = [{"model": "resnet50", "level": 3, "allocated_mb": 812.5}]
    (run / "results.json").write_text(
        json.dumps({"command": "python benchmarks/x.py --device cuda", "rows": rows})
    )
    matrix = {"results": {"resnet18": {"0": {"ok": True, "seconds": 7.5}}}}
    (tmp_path / "matrix.json").write_text(json.dumps({"backend": "aot_eager", **matrix}))
    monkeypatch.setattr(render_docs, "RESULTS", tmp_path)
    text = render_docs.render_benchmarks()
    assert "## `gpu_run`" in text
    assert "`python benchmarks/x.py --device cuda`" in text
    assert "| resnet50 | 3 | 812.5 |" in text
    assert "## `matrix`" in text and "- backend: `aot_eager`" in text
    assert "| key | key2 | ok | seconds |" in text and "| resnet18 | 0 | True | 7.5 |" in text


def test_readme_is_a_manual() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the limit is 300"
    for command in SETUP_COMMANDS:
        assert command in text, f"README.md lost the set-up command {command!r}"
    for lab_log in ("What changed last", "Before that"):
        assert lab_log not in text, f"README.md carries run history ({lab_log!r})"


# Pages written by hand: a manual each, under its line limit. docs/benchmarks.md is rendered
# whole, docs/presets.md below its marker; only the text above the marker counts.
MANUAL_LINES = 250
MANUALS = [ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
RENDERED_WHOLE = {"benchmarks.md"}
RUN_HISTORY = ("measured again", "killed for memory", "ran again")


@pytest.mark.parametrize(
    "doc",
    [p for p in MANUALS if p.name not in RENDERED_WHOLE],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_hand_written_pages_are_manuals(doc: Path, render_docs: ModuleType) -> None:
    text = doc.read_text().split(render_docs.PRESETS_MARKER, 1)[0]
    lines = len(text.splitlines())
    name = doc.relative_to(ROOT)
    assert lines <= MANUAL_LINES, (
        f"{name} has {lines} hand-written lines; the limit is {MANUAL_LINES}"
    )
    for lab_log in RUN_HISTORY:
        assert lab_log not in text.lower(), f"{name} carries run history ({lab_log!r})"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]"' in ci
    assert "python -m pytest -q" in ci


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # links in code are not links
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


# A dotted name of the package in a doc (``vision_ckpt.config.presets.register_preset``): what a
# reader imports or calls. Source files named for their NOTEs (``vision_ckpt/measure/_measure.py``)
# are paths, not names, and are not checked here.
_DOTTED = re.compile(r"\bvision_ckpt(?:\.[A-Za-z_]\w*)+")


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")[1:])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_private_module(doc: Path) -> None:
    """Users are sent to public names only (issue 52): a name a doc needs is made public where it
    lives (its subpackage's ``__all__``), or the doc says it without the name."""
    private = sorted({d for d in _DOTTED.findall(doc.read_text()) if _private(d)})
    assert not private, f"{doc.relative_to(ROOT)} names private modules or names: {private}"


def _exists(dotted: str) -> bool:
    """Whether the package has ``dotted``; a name in a module that needs a library not installed
    here (an integration) counts as there."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("vision_ckpt"):
                return True
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


# The CHANGELOG names what existed at each release, so only the manuals are resolved.
@pytest.mark.parametrize(
    "doc", [d for d in DOCS if d.name != "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_package_name_a_doc_gives_exists(doc: Path) -> None:
    names = sorted(set(_DOTTED.findall(doc.read_text())))
    missing = [dotted for dotted in names if not _exists(dotted)]
    assert not missing, f"{doc.relative_to(ROOT)} names what the package lacks: {missing}"
