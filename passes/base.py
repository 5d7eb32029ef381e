"""Pass infrastructure: a pass is a small named object over the compile state (stage: passes).

A pass checks what it needs (``requires``), rewrites every rank's program at once (``run``;
it never asks "which rank am I"), and marks the stage it leaves (``ensures``). A
``PassPipeline`` runs passes in order and calls a callback between them — where dumps and
graph diffs hook in. The state's ``stages`` make the IR's progress checkable:
propagated -> partitioned -> comm-inserted -> lowered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from autopar.dist_attr import DistAttr
from autopar.errors import AutoparError
from autopar.graph import ProgramGraph, ValueKey
from autopar.mesh import ProcessMesh
from autopar.propagation import PropagationResult


@dataclass
class CommOp:
    """One collective autopar inserted into a rank program, and why.

    ``group`` lists the ranks in piece order (rank ``group[i]`` holds piece ``i``); ``bytes``
    is what this rank sends for it (the planner's figure); ``time`` the predicted seconds.
    """

    kind: str
    group: tuple[int, ...]
    value: str  # label of the serial value being resharded
    src: DistAttr
    dst: DistAttr
    reason: str
    bytes: int
    time: float
    reduce: str = "sum"
    axis: int = 0  # all_gather / reduce_scatter: tensor dim; all_to_all: concat dim
    split_axis: int = 0  # all_to_all: split dim
    root: int = 0
    op_id: int = -1  # the op carrying it in the rank program
    output_shape: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()  # global shape of the value
    step_key: tuple[int, int] = (-1, -1)  # (reshard need, plan step): the same collective on every rank

    def __str__(self) -> str:
        return (
            f"{self.kind}(group={list(self.group)}, {self.bytes} B, {self.time * 1e6:.1f}us) "
            f"{self.value}: {self.src} -> {self.dst} — {self.reason}"
        )


@dataclass
class RankProgram:
    """One rank's program (a clone of the serial one) and how serial values map into it."""

    rank: int
    program: Any
    ops: list[Any]  # serial op index -> op of the clone (erased ops stay listed; check erased)
    erased: set[int] = field(default_factory=set)
    startup: Any = None  # the rank's startup program: serial initial values, sliced
    comm_ops: list[CommOp] = field(default_factory=list)
    local_shapes: dict[ValueKey, tuple[int, ...]] = field(default_factory=dict)
    replaced: dict[ValueKey, Any] = field(default_factory=dict)  # value after a local-scale correction

    def value(self, key: ValueKey) -> Any:
        """The serial value's result in this clone, as its op made it."""
        return self.ops[key[0]].result(key[1])

    def current(self, key: ValueKey) -> Any:
        """What later ops read for the serial value (after a local-scale correction, if any)."""
        replaced = self.replaced.get(key)
        return replaced if replaced is not None else self.value(key)


@dataclass
class CompileState:
    """What passes read and write; becomes the DistributedProgram."""

    graph: ProgramGraph
    propagation: PropagationResult
    mesh: ProcessMesh
    strategy: Any
    cluster: Any = None
    startup: Any = None  # the serial startup program (read only)
    ranks: dict[int, RankProgram] = field(default_factory=dict)
    unavailable: str = ""  # why no rank programs were built (empty: they were)
    rings: dict[tuple[int, ...], int] = field(default_factory=dict)  # communicator group -> ring id
    stages: list[str] = field(default_factory=lambda: ["propagated"])


class Pass:
    """Base: override ``run``; ``requires_stage`` / ``ensures_stage`` name the IR states."""

    name: ClassVar[str] = "pass"
    requires_stage: ClassVar[str] = "propagated"
    ensures_stage: ClassVar[str] = ""

    def requires(self, state: CompileState) -> None:
        if self.requires_stage not in state.stages:
            raise AutoparError(f"pass {self.name!r} needs the program {self.requires_stage}; it is {state.stages[-1]}")

    def run(self, state: CompileState) -> None:
        raise NotImplementedError

    def ensures(self, state: CompileState) -> None:
        if self.ensures_stage:
            state.stages.append(self.ensures_stage)


@dataclass
class PassPipeline:
    passes: Sequence[Pass]
    callback: Callable[[Pass, CompileState], None] | None = None

    def run(self, state: CompileState) -> CompileState:
        for p in self.passes:
            p.requires(state)
            p.run(state)
            p.ensures(state)
            if self.callback is not None:
                self.callback(p, state)
        return state
