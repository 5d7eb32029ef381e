"""Strategy: what the user asks of the compiler beyond annotations (frozen values).

Every field is type-checked when the Strategy is made, so a typo fails before any work is
done. A field whose pass does not exist yet is refused by name at compile
(:meth:`Strategy.check_implemented`): never accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from autopar.errors import AutoparError
from autopar.schedule import SCHEDULES as SCHEDULE_GENERATORS

SCHEDULES = tuple(SCHEDULE_GENERATORS)  # the names autopar.schedule generates (one table)
MIB = 1 << 20
# what Strategy.reduce_dtype may name: the floating dtypes a collective sums (cast there and back)
REDUCE_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _named_fields(cls: type) -> type:
    """An unknown keyword or a missing / extra positional argument is an AutoparError naming
    the class's fields (the generated ``__init__`` would raise a bare TypeError)."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise AutoparError(f"{cls.__name__} has no field(s) {unknown}; its fields are {names}")
        try:
            init(self, *args, **kwargs)
        except TypeError as err:
            raise AutoparError(f"{cls.__name__}({', '.join(names)}): {err}") from err

    cls.__init__ = __init__
    return cls


def _check_type(owner: str, name: str, value: Any, expected: type | tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        raise AutoparError(f"{owner}.{name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise AutoparError(f"{owner}.{name} must be {what}, got {value!r} ({type(value).__name__})")


@_named_fields
@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """``stages``: split the forward pass by layers into this many stages, stage ``i`` on
    ``mesh[i % mesh.shape[0]]`` (more stages than sub-meshes: virtual stages); None: the stages
    are the sub-meshes ``autopar.shard_op`` placed layers on; 1: one stage on the whole mesh —
    gradient accumulation: forward and backward run once per micro-batch, holding one
    micro-batch's activations, the update once per step on the summed gradients."""

    micro_batches: int = 1
    schedule: str = "1F1B"
    stages: int | None = None

    def __post_init__(self) -> None:
        if self.stages is not None:
            _check_type("PipelineConfig", "stages", self.stages, int, "an int >= 1 or None")
            if self.stages < 1:
                raise AutoparError(f"PipelineConfig.stages must be >= 1 (or None), got {self.stages}")
        _check_type("PipelineConfig", "micro_batches", self.micro_batches, int, "an int >= 1")
        if self.micro_batches < 1:
            raise AutoparError(f"PipelineConfig.micro_batches must be >= 1, got {self.micro_batches}")
        _check_type("PipelineConfig", "schedule", self.schedule, str, f"one of {SCHEDULES}")
        if self.schedule not in SCHEDULES:
            raise AutoparError(f"unknown pipeline schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if self.stages == 1 and self.schedule == "Interleaved1F1B":
            raise AutoparError("PipelineConfig(stages=1) accumulates gradients on one stage: Interleaved1F1B needs stages >= 2")


def _recompute_selection(value: Any) -> bool | tuple[str, ...]:
    """``Strategy.recompute``: False, True, or op types / layer paths (a str or a list of them,
    kept as a tuple); see :mod:`autopar.rewrites.recompute`."""
    forms = "False, True, or a tuple of op types / layer paths such as ('softmax', 'dropout') or ('TransformerLayer',)"
    if isinstance(value, bool):
        return value
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n.strip("/ ") for n in names):
        raise AutoparError(f"Strategy.recompute must be {forms}; got {value!r}")
    return tuple(names)


CONTEXT_PARALLEL_METHODS = ("ring", "all_to_all", "all_gather")
CONTEXT_PARALLEL_BALANCES = (None, "zigzag")


@_named_fields
@dataclass(frozen=True, slots=True)
class ContextParallel:
    """Context parallelism: the sequence of the activations split over the mesh dim ``dim``
    (Paddle's ``sep``), and how attention sees the whole sequence (docs/context_parallel.md):

    - ``"ring"``: q stays split; key / value blocks travel around the ring (cp - 1 shifts), each
      rank merging its block results with the online-softmax rule, and the backward rings dK / dV;
    - ``"all_to_all"`` (DeepSpeed-Ulysses): q, k, v go from sequence-split to head-split before
      the attention core and back after it (heads divisible by the dim's size);
    - ``"all_gather"``: q stays split, key and value are gathered whole each layer.

    ``balance="zigzag"``: rank i holds sequence chunks i and 2cp-1-i (a causal mask's work even
    over the ranks); feeds are permuted on the way in, fetches back.
    """

    dim: str = "sep"
    method: str = "ring"
    balance: str | None = None

    def __post_init__(self) -> None:
        _check_type("ContextParallel", "dim", self.dim, str, "a mesh dim's name")
        if not self.dim.strip():
            raise AutoparError("ContextParallel.dim must name a mesh dim, got an empty name")
        if self.method not in CONTEXT_PARALLEL_METHODS:
            raise AutoparError(f"ContextParallel.method must be one of {CONTEXT_PARALLEL_METHODS}, got {self.method!r}")
        if self.balance not in CONTEXT_PARALLEL_BALANCES:
            raise AutoparError(f"ContextParallel.balance must be one of {CONTEXT_PARALLEL_BALANCES}, got {self.balance!r}")


# fields whose passes have not landed yet: value that means "off" -> the issue that builds it
NOT_YET: dict[str, tuple[Any, str]] = {}


@_named_fields
@dataclass(frozen=True, slots=True)
class Strategy:
    """What compile does beyond the annotations; every field type-checked here.

    ``local_batch_norm=True``: classic per-rank batch norm, NOT equal to serial. Each rank
    normalizes its rows with its own batch statistics (no statistics all_reduce in the forward or
    the backward; scale / bias gradients join the gradient sync). The running mean / variance are
    averaged over the data-parallel group right after each batch norm (one all_reduce of 2·C
    values, each rank weighted by its share of the rows), so replicas stay identical and the
    running mean equals serial's; why averaging and not rank 0's copy: passes/batch_norm_stats.py.
    Default (False): batch norm over a split batch is exact (global statistics).

    ``reduce_dtype``: the dtype gradient reductions (all_reduce / reduce_scatter of gradients,
    fused buckets and ZeRO's included) move and sum in. None: each gradient's own dtype (a
    bfloat16 gradient of an AMP O2 program is reduced in bfloat16); ``"float32"``: cast up before
    the collective and back after, so the optimizer reads the dtype it was built with.

    ``uneven_all_to_all=True``: the all_to_alls of a dropless dispatch buffer (a worst-case
    capacity, autopar/dropless.py) send each piece only up to its last filled row, after the
    row counts, as ``all_to_all_v`` (host backend and simulator; the native backend refuses it
    by name). Default (False): the padded buffer, its padding said in the collective's reason.
    """

    pipeline: PipelineConfig | None = None
    zero_stage: int = 0
    sequence_parallel: bool | str = False  # True, or the tensor-parallel mesh dim's name (autopar/rewrites/sequence_parallel.py)
    recompute: bool | tuple[str, ...] = False  # op types / layer paths, or True: every layer (autopar/rewrites/recompute.py)
    cluster: str | None = None  # a cost_model profile name or JSON path; None = the hardware's (cpu-gloo without a GPU)
    fuse_allreduce: bool = True  # gradient all-reduces packed into buckets (passes/allreduce_fusion.py)
    allreduce_bucket_mb: float = 32.0
    local_batch_norm: bool = False  # per-rank batch statistics, NOT equal to serial (passes/batch_norm_stats.py)
    reduce_dtype: str | None = None  # the dtype gradient reductions move; None: each gradient's own (docs/paddle_amp.md)
    context_parallel: ContextParallel | None = None  # the sequence split over a mesh dim (docs/context_parallel.md)
    uneven_all_to_all: bool = False  # a dropless buffer's all_to_alls sent uneven (autopar/dropless.py)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pipeline is not None:
            _check_type("Strategy", "pipeline", self.pipeline, PipelineConfig, "an autopar.PipelineConfig or None")
        _check_type("Strategy", "zero_stage", self.zero_stage, int, "0, 1, 2 or 3")
        if self.zero_stage not in (0, 1, 2, 3):
            raise AutoparError(f"Strategy.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _check_type("Strategy", "sequence_parallel", self.sequence_parallel, (bool, str), "True, False or a mesh dim name")
        object.__setattr__(self, "recompute", _recompute_selection(self.recompute))
        _check_type("Strategy", "fuse_allreduce", self.fuse_allreduce, bool, "True or False")
        _check_type("Strategy", "local_batch_norm", self.local_batch_norm, bool, "True or False")
        _check_type("Strategy", "uneven_all_to_all", self.uneven_all_to_all, bool, "True or False")
        if self.cluster is not None:
            _check_type("Strategy", "cluster", self.cluster, str, "a cluster profile name or JSON path")
            if not self.cluster.strip():  # (not the hardware's profile: that is None)
                from autopar.cost_model.cluster import PROFILES

                raise AutoparError(
                    f"Strategy.cluster={self.cluster!r} names no cluster: give a shipped profile {sorted(PROFILES)}, "
                    "a JSON file's path, or None for this hardware's profile"
                )
        _check_type("Strategy", "allreduce_bucket_mb", self.allreduce_bucket_mb, (int, float), "a number > 0")
        if not math.isfinite(self.allreduce_bucket_mb) or self.allreduce_bucket_mb <= 0:
            raise AutoparError(f"Strategy.allreduce_bucket_mb must be a finite number > 0, got {self.allreduce_bucket_mb}")
        if self.bucket_bytes < 1:
            raise AutoparError(
                f"Strategy.allreduce_bucket_mb={self.allreduce_bucket_mb} is less than one byte "
                f"(the least is 1 / 2**20 = {1 / MIB:.3g} MB)"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise AutoparError(
                f"Strategy.reduce_dtype={self.reduce_dtype!r} is not a dtype gradients are reduced in; "
                f"expected None (each gradient's own dtype) or one of {REDUCE_DTYPES}"
            )
        if self.context_parallel is not None:
            _check_type("Strategy", "context_parallel", self.context_parallel, ContextParallel, "an autopar.ContextParallel or None")
        _check_type("Strategy", "extra", self.extra, dict, "a dict")

    @property
    def bucket_bytes(self) -> int:
        """``allreduce_bucket_mb`` in bytes (what the fusion passes take)."""
        return int(self.allreduce_bucket_mb * MIB)

    def check_implemented(self) -> None:
        """Refuse, by field name, what no pass implements yet."""
        for name, (off, feature) in NOT_YET.items():
            value = getattr(self, name)
            if value != off:
                raise AutoparError(
                    f"Strategy.{name}={value!r}: {feature} is not implemented yet; compile refuses it rather than ignore it"
                )
        if self.extra:
            raise AutoparError(f"Strategy.extra: no pass reads the options {sorted(self.extra)}")


@dataclass(frozen=True, slots=True)
class EffectiveStrategy:
    """The Strategy a compile runs, as a value beside the one the user gave: ``requested`` (None:
    the default) with what the program itself implies added (``strategy``; ``added`` says what
    and why — annotations that place stages on sub-meshes imply a pipeline of one micro-batch).
    The user's Strategy is never changed; ``dist.effective_strategy`` records both."""

    requested: Strategy | None
    strategy: Strategy
    added: tuple[str, ...] = ()

    def __str__(self) -> str:
        return str(self.strategy) + "".join(f"\n  (added: {why})" for why in self.added)

