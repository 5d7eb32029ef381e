"""Write docs/ops.md from the SPMD rule registry: each op, its rule and what the rule supports.

The page is generated, never edited: ``tests/unit/test_docs.py`` fails when the committed
docs/ops.md differs from what this prints. After changing a rule:

    .venv/bin/python tools/gen_ops.py --write
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections import defaultdict
from pathlib import Path

from autopar.spmd import RULES, SpmdRule, trait_values
from autopar.spmd.registry import TRAIT_MEANINGS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ops.md"

HEADER = """# Ops and their SPMD rules

Generated from the rule registry (`autopar/spmd/registry.py`) by `tools/gen_ops.py`; do not
edit: `tests/unit/test_docs.py::test_ops_page_is_generated_from_the_registry` fails when this
page and the registry differ. What the rules mean, and how to check one of your own:
[rules.md](rules.md).

Names are Paddle's PIR op names without `pd_op.`; an in-place variant (`relu_`) uses the rule
of its name without the underscore. Ops share a row when their rules read alike (most are one
registration). **Rule**: `equation` = an `EinsumRule` (the family is one equation over dim
letters, both directions done by the engine), `grad equation` = an `EquationGradRule` (the grad
op stated by its operands' letters), otherwise the hand-written class. **Partial inputs**: how
an operand holding a pending sum (`P(sum)`) is taken — kept pending through the op, or made
complete by a reduction planned in front of it. An op with no rule here runs replicated and is
listed in `dist.report.unsupported_ops`.
"""

PARTIAL = {
    None: "made complete",
    "multi": "kept pending (one operand per mesh dim)",
    "additive": "kept pending (all operands alike)",
    "alike": "kept pending (whole operands made pending locally)",
    "first": "kept pending in the first operand only (the others whole)",
}
ENGINE = ("EinsumRule", "EquationGradRule")


def _markdown(text: str) -> str:
    """Docstring markup to Markdown: ``code`` and :mod:`x` / :class:`x` / :func:`x` as `code`."""
    return re.sub(r":(?:mod|class|func|meth|attr):`", "`", text).replace("``", "`")


def _first_sentence(doc: str | None) -> str:
    """The docstring's first sentence (a period outside `code` followed by a space), one line."""
    if not doc:
        return ""
    paragraph = _markdown(" ".join(inspect.cleandoc(doc).split("\n\n")[0].split()))
    ticks = 0
    for i, char in enumerate(paragraph):
        ticks += char == "`"
        if char == "." and ticks % 2 == 0 and (i + 1 == len(paragraph) or paragraph[i + 1] == " "):
            return paragraph[: i + 1]
    return paragraph


def _described_by(rule: SpmdRule):
    """The function an engine rule is stated by (equation / letters), else the rule's class."""
    return getattr(rule, "equation", None) or getattr(rule, "letters", None) or type(rule)


def _rule_kind(rule: SpmdRule) -> str:
    name = type(rule).__name__
    return {"EinsumRule": "equation", "EquationGradRule": "grad equation"}.get(name, f"`{name}`")


def _partial_inputs(rule: SpmdRule) -> str:
    name = type(rule).__name__
    if name == "EquationGradRule":
        return "incoming gradients kept pending"
    if name == "EinsumRule":
        linearity = rule.linearity
        if callable(linearity):
            return "per op: " + (_first_sentence(linearity.__doc__) or f"`{linearity.__name__}`")
        return PARTIAL.get(linearity, str(linearity))
    return "see the rule"


def _notes(rule: SpmdRule) -> str:
    described = _described_by(rule)
    notes = []
    if described is not type(rule) or type(rule).__name__ not in ENGINE:
        notes.append(_first_sentence(described.__doc__) or f"`{described.__name__}`")
    engine = type(rule).__name__ in ENGINE
    if (engine and rule.scale is not None) or (not engine and type(rule).local_scale is not SpmdRule.local_scale):
        notes.append("Local result rescaled.")
    if rule.free_outputs:
        notes.append("Outputs made in any split a reader fixes.")
    if rule.lowering is not None:
        notes.append(f"Lowered per rank where its kernel is wrong on the piece: `{rule.lowering}`.")
    return " ".join(n for n in notes if n).replace("|", "\\|")


def render() -> str:
    """The whole page, deterministic: families by module name, rows by their first op."""
    rows: dict[tuple[str, ...], list[str]] = defaultdict(list)  # ops whose rules read alike share a row
    rules = {id(rule) for rule in RULES.values()}
    for op_name, rule in RULES.items():
        row = (_described_by(rule).__module__, _rule_kind(rule), _partial_inputs(rule), _notes(rule))
        rows[row].append(op_name)
    families: dict[str, list[tuple[list[str], tuple[str, ...]]]] = defaultdict(list)
    for row, op_names in rows.items():
        families[row[0]].append((sorted(op_names), row[1:]))
    lines = [HEADER]
    lines.append(f"{len(RULES)} op names, {len(rules)} rules, {len(families)} families.\n")
    for module in sorted(families):
        path = module.replace(".", "/") + ".py"
        lines.append(f"## {module.rsplit('.', 1)[1]} (`{path}`)\n")
        summary = _first_sentence(sys.modules[module].__doc__)
        if summary:
            lines.append(summary + "\n")
        lines.append("| ops | rule | partial inputs | notes |")
        lines.append("|---|---|---|---|")
        for op_names, (kind, partial, notes) in sorted(families[module]):
            ops = ", ".join(f"`{n}`" for n in op_names)
            lines.append(f"| {ops} | {kind} | {partial} | {notes} |")
        lines.append("")
    lines += _traits()
    return "\n".join(lines)


def _traits() -> list[str]:
    """The op traits other stages ask (``ops_where(trait)``), with the ops declaring each."""
    lines = [
        "## What other stages know of ops (`autopar.spmd.registry.declare`)\n",
        "Declared beside each op's rule (ops without a rule: `autopar/spmd/op_traits.py`); a stage asks "
        '`ops_where("keeps_split")`, never a table of its own '
        "(`tests/unit/test_op_tables_in_registry.py`).\n",
        "| trait | meaning | ops |",
        "|---|---|---|",
    ]
    for trait, meaning in sorted(TRAIT_MEANINGS.items()):
        values = trait_values(trait)
        if all(isinstance(v, bool) for v in values.values()):
            ops = ", ".join(f"`{n}`" for n, v in values.items() if v)
        else:
            ops = ", ".join(f"`{n}` {v}" for n, v in values.items())
        lines.append(f"| `{trait}` | {meaning} | {ops} |")
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)} instead of printing")
    args = parser.parse_args()
    text = render()
    if args.write:
        PAGE.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
