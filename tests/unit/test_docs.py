"""The README and docs/ say only what the tree holds: every test, file and link they name exists,
and docs/ops.md is what the rule registry generates (so neither can rot)."""

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path the docs name from the repository root: tests/unit/test_x.py, tests/unit/test_x.py::test_y, ...
NAMED_PATH = re.compile(r"\b((?:autopar|passes|cost_model|benchmarks|examples|tests|tools)/[\w/.-]*\w)((?:::\w+)*)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _named(pages=PAGES):
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in NAMED_PATH.finditer(line):
                yield f"{page.relative_to(ROOT)}:{number}", match.group(1), match.group(2)


def test_ops_page_is_generated_from_the_registry():
    spec = importlib.util.spec_from_file_location("gen_ops", ROOT / "tools" / "gen_ops.py")
    gen_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_ops)
    committed = (ROOT / "docs" / "ops.md").read_text()
    assert committed == gen_ops.render(), "docs/ops.md is stale: run .venv/bin/python tools/gen_ops.py --write"


def test_every_test_the_docs_name_exists():
    """`tests/x.py::test_y` needs `def test_y` (or `class`) in tests/x.py; `tests/x.py` needs the file."""
    missing = []
    for where, path, names in _named():
        if not path.startswith("tests/"):
            continue
        file = ROOT / path
        if not file.exists():
            missing.append(f"{where}: {path}")
            continue
        text = file.read_text() if names else ""
        missing += [
            f"{where}: {path}::{n}"
            for n in names.split("::")[1:]
            if not re.search(rf"^\s*(def|class) {n}\b", text, re.M)
        ]
    assert not missing, missing


def test_every_file_the_docs_name_exists():
    """A module, benchmark or example the docs point at (`autopar/runtime/shm.py`, a folder `autopar/rewrites/`)."""
    missing = [f"{where}: {path}" for where, path, _ in _named() if not (ROOT / path).exists()]
    assert not missing, missing


def test_links_between_the_pages_resolve():
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken, broken


def test_the_readme_is_a_front_page_and_every_guide_is_linked_from_it():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make test" in readme and "make demo" in readme
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name})" not in readme]
    assert not unlinked, unlinked


@pytest.fixture(scope="module")
def readme_example():
    """The README's annotated example, run: its variables, and what it printed."""
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## An annotated example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example, "README.md", "exec"), scope)
    return example, scope, printed.getvalue()


def test_the_readme_example_runs_as_its_comments_say(readme_example):
    example, scope, printed = readme_example
    dist = scope["dist"]
    said = re.findall(r"^(dist\.dist_attr\([\w.]+\))\s+# (.+?)(?:: |$)", example, re.M)
    assert len(said) == 2
    for expression, comment in said:
        value = eval(expression, scope)
        assert comment in (repr(value), str(value)), (expression, comment, repr(value))
    assert all(len(dist.comm_ops(rank)) == 2 for rank in range(4))  # "two collectives on each rank"
    collectives = dist.comm_ops(0)
    assert [(c.kind.value, list(c.group)) for c in collectives] == [("all_reduce", [0, 1]), ("all_reduce", [0, 2])]
    assert "row-parallel output" in collectives[0].reason and "bucket" in str(collectives[1])
    assert "reshards needed: 5" in str(dist.report)
    assert "every value equals serial" in printed


def test_the_passes_architecture_md_prints_are_the_readme_examples(readme_example):
    """docs/architecture.md shows `print(dist.passes)` of the README's example."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    shown = text.split("print(dist.passes)", 1)[1].split("plan = ", 1)[0]
    listed = re.compile(r"(\d+)\. (\w+\([^)]*\))")
    assert listed.findall(shown) == listed.findall(str(readme_example[1]["dist"].passes))
