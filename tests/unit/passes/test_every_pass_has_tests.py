"""tests/unit/passes mirrors passes/ (issue 37 item 5): every module of passes/ that defines a
pass (a class deriving from ``Pass``) has its own test file here, ``test_<module>_pass.py`` (the
``_pass`` suffix: tests/equivalence has test_site_fusion.py and test_vocab_parallel.py, and test
files share one namespace), whose docstring names the module it tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PASSES = ROOT / "passes"
HERE = Path(__file__).resolve().parent


def pass_modules(folder: Path = PASSES) -> list[str]:
    """Modules of ``folder`` defining a class that derives from ``Pass`` (by name or attribute)."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and "Pass" in bases:
                found.append(path.stem)
                break
    return found


def test_the_scan_finds_pass_classes(tmp_path):
    (tmp_path / "base.py").write_text("class Pass:\n    pass\n")
    (tmp_path / "fold.py").write_text("from .base import Pass\n\nclass Fold(Pass):\n    name = 'fold'\n")
    (tmp_path / "helpers.py").write_text("class Table(dict):\n    pass\n")
    assert pass_modules(tmp_path) == ["fold"]
    assert {"partition", "reshard_emission", "zero_sharding"} <= set(pass_modules())


def test_every_pass_module_has_its_test_file():
    missing, unnamed = [], []
    for module in pass_modules():
        test = HERE / f"test_{module}_pass.py"
        if not test.exists():
            missing.append(f"passes/{module}.py -> tests/unit/passes/{test.name}")
        elif f"passes/{module}.py" not in (ast.get_docstring(ast.parse(test.read_text())) or ""):
            unnamed.append(test.name)
    assert not missing, "passes without their unit test file:\n" + "\n".join(missing)
    assert not unnamed, f"test files whose docstring does not name their pass module: {unnamed}"
