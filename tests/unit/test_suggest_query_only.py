"""``autopar.suggest`` prices from the query API only (issue 37 item 4): no module of
``autopar/suggest`` reads a compile state (``dist.state``, ``analysis.state``, ``x._state``) or
names ``CompileState``; the price of a candidate is ``dist.decisions.price()``."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

from autopar.suggest import price_plan
from autopar.testing.models import gpt_block_program

SUGGEST = Path(__file__).resolve().parents[2] / "autopar" / "suggest"
STATE = {"state", "_state"}


def compile_state_reads(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of each read of an attribute named ``state`` / ``_state`` and each mention
    of ``CompileState`` (a name, an attribute or an imported name) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and (node.attr in STATE or node.attr == "CompileState"):
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "CompileState":
            found.append(f"{filename}:{node.lineno}: CompileState")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "CompileState" for a in node.names):
            found.append(f"{filename}:{node.lineno}: import CompileState")
    return found


def test_the_scan_finds_a_state_read():
    source = "def f(dist, analysis):\n    a = dist.state.graph\n    return price(analysis._state)\n"
    assert compile_state_reads(source) == ["<source>:2: .state", "<source>:3: ._state"]
    assert compile_state_reads("from autopar.passes.base import CompileState\n") == ["<source>:1: import CompileState"]
    assert compile_state_reads("x = dist.decisions.price()\nstates = 1\n") == []


def test_suggest_reads_no_compile_state():
    files = sorted(SUGGEST.glob("*.py"))
    assert SUGGEST / "__init__.py" in files and len(files) >= 5
    found = [hit for path in files for hit in compile_state_reads(path.read_text(), path.name)]
    assert not found, "autopar/suggest reads the compile state; ask the query API instead:\n" + "\n".join(found)


def test_the_search_price_is_the_query_answer():
    """``price_plan``'s price is ``dist.decisions.price()`` of its compile, and on a 2-rank
    data-parallel mesh (both ranks stand for it) the step of ``priced()`` over every rank."""
    seed = gpt_block_program(batch=8, seq=16, hidden=64, heads=4, vocab=128, layers=2, optimizer="adamw", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = price_plan(seed.main, (2, 1, 1), startup_program=seed.startup, cluster="h100-node")
        dist = plan.compile()
    answer = dist.decisions.price()
    assert answer == plan.price
    _, every_rank = dist.decisions.priced()
    assert every_rank.step == answer.step and every_rank.memory == answer.memory
