"""Inspection of compiled programs (stage: after compile): per-rank diffs against the serial
program (text and graphviz), and the predicted cost report.

``DistributedProgram.dump_diff`` and ``DistributedProgram.cost`` delegate here; the
``autopar`` command line (:mod:`autopar.cli`) prints and writes the same.
"""

from autopar.inspect.cost_report import CostReport, RankCost, cost_report
from autopar.inspect.diff import diff_text
from autopar.inspect.dump import DumpResult, dump_diff
from autopar.inspect.render import render_dot
from autopar.inspect.view import RankView, rank_view

__all__ = [
    "CostReport",
    "DumpResult",
    "RankCost",
    "RankView",
    "cost_report",
    "diff_text",
    "dump_diff",
    "rank_view",
    "render_dot",
]
