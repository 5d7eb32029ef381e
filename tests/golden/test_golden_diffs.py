"""Golden text diffs of the examples' rank programs against their serial programs.

Regenerate after an intended change with ``UPDATE_GOLDEN=1 .venv/bin/python -m pytest
tests/golden`` and review the changed ``.diff`` files in the commit. Compiled on the
``h100-node`` profile: the predicted times in the diffs are the same on every machine (without
a cluster the profile follows the hardware in use).
"""

import os
import sys
from functools import cache
from pathlib import Path

import pytest

import autopar
from autopar.inspect import diff_text

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "examples"))
import inspect_models  # noqa: E402

UPDATE = os.environ.get("UPDATE_GOLDEN", "") not in ("", "0")
H100 = autopar.Strategy(cluster="h100-node")
CASES = [
    ("simple_net_dp", 0), ("simple_net_dp", 1), ("simple_net_mp", 0), ("simple_net_mp", 1),
    ("simple_net_dp_mp", 0), ("simple_net_dp_mp", 3), ("alexnet_conv_dp_fc_mp", 0), ("alexnet_conv_dp_fc_mp", 3),
]  # fmt: skip


@cache
def compiled(name: str):
    return inspect_models.EXAMPLES[name](H100)


@pytest.mark.parametrize(("example", "rank"), CASES)
def test_rank_diff_matches_golden(example: str, rank: int) -> None:
    text = diff_text(compiled(example), rank)
    path = HERE / f"{example}.rank{rank}.diff"
    if UPDATE or not path.exists():
        path.write_text(text)
        if not UPDATE:
            pytest.fail(f"{path.name} did not exist; written now — review it and commit it")
    assert text == path.read_text(), f"{path.name} changed: rerun with UPDATE_GOLDEN=1 and review the diff"


def test_diff_is_stable_across_compiles() -> None:
    """No op ids or addresses leak into the text: two compiles print the same."""
    first = diff_text(inspect_models.simple_net_dp_mp(H100), 0)
    second = diff_text(inspect_models.simple_net_dp_mp(H100), 0)
    assert first == second
    assert "0x" not in first
