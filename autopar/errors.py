"""User-facing errors.

Every error autopar raises on bad input derives from :class:`AutoparError` and names the
tensor, op or mesh at fault, so a user never has to read a Paddle stack trace to find it.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error autopar raises for bad input or an unsupported request."""


class MeshError(AutoparError):
    """A ProcessMesh is malformed (duplicate ranks, ragged shape, empty dim, bad names)."""


class PlacementError(AutoparError):
    """A DistAttr / dims_mapping does not fit its tensor or mesh."""


class AnnotationError(AutoparError):
    """An annotation (shard_tensor / shard_op) does not fit the program being compiled."""


class NativeUnsupported(AutoparError):
    """The native backend cannot run this plan (a pipeline, a sub-group ring on CPU, uneven
    pieces to gather): ``backend="host"`` can; ``backend="auto"`` picks it."""


class CostModelError(AutoparError):
    """A cluster profile, dtype or reshard request the cost model cannot price (names the field)."""


class AnnotationWarning(UserWarning):
    """An annotation that compile can see but not apply (made on another program's value)."""


class ParallelismWarning(UserWarning):
    """A split the annotations asked for is made whole for lack of an SPMD rule: the program
    is still equal to serial, but moves bytes and repeats work the user did not ask for."""


class ScheduleError(AutoparError):
    """A pipeline schedule request that cannot be built, or a schedule that fails verification."""


class CheckpointError(AutoparError):
    """A checkpoint that cannot be written or read: names the tensor and the file at fault."""


def removed_error(label: str) -> AutoparError:
    """The refusal of a fetch of a value removed as dead."""
    return AutoparError(
        f"{label} was removed as dead before analysis: nothing in the program reads it. To fetch it, "
        "call autopar.keep(value) while building the program, before autopar.compile"
    )
