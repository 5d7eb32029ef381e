"""DistributedProgram: everything compile produced, queried by later stages and users.

So far: the placement of every serial value, the ops each runs on, what needs resharding,
and the compile report (conflicts, ops without a rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.passes.base import CommOp, CompileState, RankProgram
from autopar.propagation import ConflictRecord, PropagationResult, ReshardNeed
from autopar.strategy import Strategy

if TYPE_CHECKING:
    from autopar.inspect.cost_report import CostReport
    from autopar.inspect.dump import DumpResult


@dataclass
class CompileReport:
    """What a user should read after compile: conflicts, unsupported ops, reshards needed."""

    conflicts: list[ConflictRecord]
    unsupported_ops: list[str]
    reshards: list[ReshardNeed]
    rounds: int

    def __str__(self) -> str:
        lines = [f"propagation converged in {self.rounds} round(s)"]
        lines.append(f"ops without an SPMD rule (computed replicated): {len(self.unsupported_ops)}")
        lines += [f"  {name}" for name in self.unsupported_ops]
        lines.append(f"conflicts: {len(self.conflicts)}")
        lines += [f"  {c}" for c in self.conflicts]
        lines.append(f"reshards needed: {len(self.reshards)}")
        return "\n".join(lines)


class DistributedProgram:
    """The result of :func:`autopar.compile` (see DESIGN.md, public API contract)."""

    def __init__(self, program: Any, startup_program: Any, state: CompileState) -> None:
        self.serial_program = program
        self.serial_startup_program = startup_program
        self.state = state
        self.mesh: ProcessMesh = state.mesh
        self.strategy: Strategy = state.strategy
        self.graph: ProgramGraph = state.graph
        self.propagation: PropagationResult = state.propagation

    @property
    def world_size(self) -> int:
        return self.mesh.size

    @property
    def report(self) -> CompileReport:
        p = self.propagation
        return CompileReport(p.conflicts, p.unsupported, p.reshards, p.rounds)

    def key(self, name_or_value: Any) -> ValueKey:
        if isinstance(name_or_value, str):
            key = self.graph.by_name.get(name_or_value)
            if key is None:
                raise AutoparError(f"no parameter, feed or state named {name_or_value!r} in the compiled program")
            return key
        key = self.graph.key_of(name_or_value)
        if key is None:
            raise AutoparError(f"{name_or_value!r} is not a value of the compiled program")
        return key

    def dist_attr(self, name_or_value: Any) -> DistAttr | tuple[DistAttr, ...]:
        """Placement of a serial value (parameters, feeds and states also by name).

        A vector value (``builtin.combine`` / ``split`` plumbing) answers with its members'.
        """
        key = self.key(name_or_value)
        members = self.graph.vectors.get(key)
        if self.graph.values[key].kind == "vector" and members is not None:
            return tuple(self.propagation.dist(k) for k in members)
        return self.propagation.dist(key)

    def _rank(self, rank: int) -> RankProgram:
        if self.state.unavailable:
            raise AutoparError(self.state.unavailable)
        if rank not in self.state.ranks:
            raise AutoparError(f"rank {rank} is not in {self.mesh}")
        return self.state.ranks[rank]

    def rank_program(self, rank: int) -> Any:
        """The PIR program rank ``rank`` runs (local shapes, inserted collectives)."""
        return self._rank(rank).program

    def rank_startup_program(self, rank: int) -> Any:
        """The startup program of ``rank``: the serial initial values, sliced to its pieces."""
        startup = self._rank(rank).startup
        if startup is None:
            raise AutoparError("compile was called without startup_program=; there is no startup to partition")
        return startup

    def comm_ops(self, rank: int) -> list[CommOp]:
        """The collectives inserted for ``rank``, in program order: kind, group, bytes, reason, time."""
        return list(self._rank(rank).comm_ops)

    def local_shape(self, name_or_value: Any, rank: int) -> tuple[int, ...]:
        return self._rank(rank).local_shapes[self.key(name_or_value)]

    def op_mesh(self, op_index: int) -> ProcessMesh:
        return self.propagation.op_meshes.get(op_index, self.mesh)

    @property
    def cost(self) -> CostReport:
        """Predicted step time, comm bytes and peak memory per rank (see autopar.inspect.cost_report)."""
        from autopar.inspect.cost_report import cost_report

        return cost_report(self)

    def dump_diff(self, directory: Any, **options: Any) -> DumpResult:
        """Per-rank text diffs and graphviz pictures into ``directory`` (see autopar.inspect.dump)."""
        from autopar.inspect.dump import dump_diff

        return dump_diff(self, directory, **options)
