"""Strategy: what the user asks of the compiler beyond annotations (frozen values).

Later stages read these fields (pipeline schedules, ZeRO, sequence parallel, recompute);
compile validates them up front so a typo fails before any work is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import AutoparError

SCHEDULES = ("FThenB", "1F1B", "Interleaved1F1B")


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    micro_batches: int = 1
    schedule: str = "1F1B"

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise AutoparError(f"PipelineConfig.micro_batches must be >= 1, got {self.micro_batches}")
        if self.schedule not in SCHEDULES:
            raise AutoparError(f"unknown pipeline schedule {self.schedule!r}; expected one of {SCHEDULES}")


@dataclass(frozen=True, slots=True)
class Strategy:
    pipeline: PipelineConfig | None = None
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: bool = False
    cluster: str | None = None  # a cost_model profile name or JSON path; None = the default profile
    fuse_allreduce: bool = True  # gradient all-reduces packed into buckets (passes/allreduce_fusion.py)
    allreduce_bucket_mb: float = 32.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.allreduce_bucket_mb <= 0:
            raise AutoparError(f"Strategy.allreduce_bucket_mb must be > 0, got {self.allreduce_bucket_mb}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise AutoparError(f"Strategy.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
