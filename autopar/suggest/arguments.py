"""What ``autopar.suggest`` and ``autopar.price_plan`` accept, read once at the door (stage:
strategy search).

Each argument is taken in the forms a user reaches for first — ``world=np.int64(4)``,
``shapes=[[2, 2, 1]]``, ``memory_per_rank="80GB"`` (the CLI's parser), ``cluster=`` a
:class:`~autopar.cost_model.Cluster` — or refused by an :class:`AutoparError` naming the argument
and what to pass instead, never a raw ``TypeError`` from deep inside.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from typing import Any

from autopar.errors import AnnotationWarning, AutoparError
from autopar.suggest.search import Shape

SMALL_BUDGET = 1 << 20  # a plain number of bytes below this is likely meant in another unit (80 -> 80 GB?)


def count(who: str, name: str, value: Any, what: str = "whole number") -> int:
    """A positive whole number: ``int``, ``np.int64`` and anything else integral (``__index__``)."""
    number = None if isinstance(value, bool) else _integral(value)
    if number is None or number < 1:
        raise AutoparError(f"{who}: {name} must be a positive {what}, got {value!r}")
    return number


def shapes(who: str, given: Any, world: int | None) -> list[Shape]:
    """Mesh shapes: ``Shape`` values or ``(dp, mp, pp)`` / ``(dp, mp, pp, cp[, ep])`` sequences (tuples,
    lists, arrays) of positive whole numbers, each on at most ``world`` devices."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise AutoparError(f"{who}: shapes must be a list of mesh shapes (dp, mp, pp), got {given!r}")
    out = []
    for item in given:
        shape = item if isinstance(item, Shape) else _shape(item)
        if shape is None:
            raise AutoparError(f"{who}: a mesh shape is a Shape or (dp, mp, pp) of positive ints, got {item!r}")
        if world is not None and shape.world > world:
            raise AutoparError(f"{who}: mesh shape {shape} has {shape.world} devices, more than the world's {world}")
        out.append(shape)
    return out


def budget(who: str, value: Any) -> int | None:
    """Bytes per rank: a whole number, or a size with its unit as the CLI reads it (``"80GB"``,
    ``"512 MiB"``); None: the profile's device memory."""
    from autopar.units import parse_bytes

    if value is None:
        return None
    if isinstance(value, str):
        return parse_bytes(value, f"{who}: memory_per_rank")
    number = None if isinstance(value, bool) else _integral(value)
    if number is None and isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < 1:
        raise AutoparError(f"{who}: memory_per_rank must be bytes per rank (a positive whole number) or a size such "
                           f"as '80GB', got {value!r}")  # fmt: skip
    return number


def unit_hint(given: Any, budget: int) -> str:
    """A hint when the budget was a bare number too small to be meant in bytes."""
    if isinstance(given, str) or budget >= SMALL_BUDGET:
        return ""
    return (f"memory_per_rank is in bytes per rank: {given!r} is {budget} bytes; for {budget} GB pass "
            f"memory_per_rank='{budget}GB' (or {budget * 10**9})")  # fmt: skip


def profile(who: str, cluster: Any) -> str | None:
    """The profile a Strategy names: a shipped name or a JSON path as given; a ``Cluster`` object
    by its shipped name when it is one, else saved as a JSON profile (Strategy names profiles by
    name or path, so that strategies stay small printable values) under the temp directory,
    one file per distinct cluster (named by its content: saving it again finds the same file)."""
    from autopar.cost_model.cluster import PROFILES, Cluster, shipped_profile

    if cluster is None or isinstance(cluster, str):
        return cluster
    if isinstance(cluster, os.PathLike):
        return os.fspath(cluster)
    if not isinstance(cluster, Cluster):
        raise AutoparError(f"{who}: cluster must be a profile name {sorted(PROFILES)}, a JSON profile's path or an "
                           f"autopar.cost_model.Cluster, got a {type(cluster).__name__}")  # fmt: skip
    shipped = next((name for name in PROFILES if shipped_profile(name) == cluster), None)
    return shipped or _saved(cluster)


def programs(who: str, program: Any, startup: Any) -> None:
    """Refuse, saying what to pass, anything but a static (PIR) program: a DistributedProgram,
    an ``nn.Layer``, ..."""
    _program(who, "program", program)
    if startup is not None:
        _program(who, "startup_program", startup)


def warn_annotated(who: str, program: Any) -> None:
    """A program the user annotated: the search does not use the annotations (see the warning)."""
    import warnings

    from autopar.annotate import annotations_of

    found = annotations_of(program)
    if not (found.tensors or found.ops):
        return
    said = [f"{len(found.tensors)} value(s) placed with shard_tensor / reshard"] if found.tensors else []
    said += [f"{len(found.ops)} op(s) placed on a sub-mesh with shard_op"] if found.ops else []
    warnings.warn(
        f"{who}: the program's own annotations ({', '.join(said)}) are not used: the search places every value "
        "itself on each mesh shape it tries (yours name a mesh of another size and dims); to price your plan, "
        "compile it and read dist.cost, or pass the unannotated program",
        AnnotationWarning,
        stacklevel=3,
    )


def _integral(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


def _shape(item: Any) -> Shape | None:
    if isinstance(item, (str, bytes)) or not isinstance(item, Iterable):
        return None
    sizes = [None if isinstance(n, bool) else _integral(n) for n in item]
    if len(sizes) not in (3, 4, 5) or any(n is None or n < 1 for n in sizes):
        return None
    return Shape(*sizes)


def _program(who: str, name: str, value: Any) -> None:
    import paddle

    if isinstance(value, paddle.pir.Program):
        return
    from autopar.distributed_program import DistributedProgram

    if isinstance(value, DistributedProgram):
        raise AutoparError(f"{who}: {name} is a DistributedProgram (a compiled plan); pass the serial program it was "
                           "compiled from: dist.serial_program, startup_program=dist.serial_startup_program")  # fmt: skip
    if isinstance(value, paddle.nn.Layer):
        raise AutoparError(
            f"{who}: {name} is an nn.Layer ({type(value).__name__}); pass the static training program: under "
            "paddle.enable_static(), build the step inside paddle.static.program_guard(main, startup) (feeds, the "
            "layer's forward, the loss, optimizer.minimize(loss)) and pass main, startup_program=startup"
        )
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise AutoparError(f"{who}: {name} must be a Paddle static (PIR) program (paddle.static.Program() under "
                       f"paddle.enable_static()), got a {kind}")  # fmt: skip


def _saved(cluster: Any) -> str:
    import hashlib
    import json
    import tempfile
    from pathlib import Path

    text = json.dumps(cluster.to_dict(), indent=2) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / "autopar-profiles"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.json"
    if not path.exists() or path.read_text() != text:
        partial = folder / f".{digest}.{os.getpid()}.tmp"
        partial.write_text(text)
        os.replace(partial, path)
    return str(path)
