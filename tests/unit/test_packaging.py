"""A normal (non-editable) install works: the wheel holds every subpackage, and a 2-rank
program compiles and simulates from the installed copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = {
    "autopar": ROOT / "autopar",
    "autopar/passes": ROOT / "passes",
    "autopar/cost_model": ROOT / "cost_model",
}

SCRIPT = """
import numpy as np, paddle, autopar
from autopar.testing.models import simple_net
seed = simple_net(batch=4, sizes=(8, 16, 4))
mesh = autopar.ProcessMesh([0, 1], ["dp"])
autopar.shard_tensor(seed.feeds["x"], mesh, ["dp", None])
dist = autopar.compile(seed.main, mesh, startup_program=seed.startup)
rng = np.random.default_rng(0)
feed = {"x": rng.standard_normal((4, 8)).astype("float32"), "label": rng.integers(0, 4, (4, 1)).astype("int64")}
res = autopar.simulate(dist, [feed], fetch_list=[seed.loss])
print(autopar.__file__, float(res.fetches[0][0]))
"""


def _source_packages() -> set[str]:
    """Every directory with an __init__.py, named as installed (autopar/..., autopar/passes/...)."""
    found = set()
    for installed, root in SOURCE_PACKAGES.items():
        for init in root.rglob("__init__.py"):
            found.add(str(Path(installed) / init.parent.relative_to(root)))
    return {p.rstrip("/.").replace("/.", "") for p in found}


@pytest.mark.slow
def test_wheel_installs_every_package_and_runs(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".*cache"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("autopar-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {str(Path(n).parent) for n in zf.namelist() if n.endswith("__init__.py")}
    missing = _source_packages() - in_wheel
    assert not missing, f"subpackages missing from the wheel: {sorted(missing)}"
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    installed_at, loss = out.stdout.split()[-2:]
    assert installed_at.startswith(str(target)), f"imported {installed_at}, not the installed wheel"
    assert float(loss) == float(loss)  # a finite number came back
