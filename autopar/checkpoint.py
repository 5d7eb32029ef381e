"""Distributed checkpoints: every rank writes its own boxes; loading reshards onto any mesh,
annotation or strategy (stage: runtime; behind ``Executor.save`` / ``Executor.load`` and
``autopar.simulate(..., load_from=, save_to=)``).

A checkpoint is a directory::

    ckpt/index.json                                  the index: written last, by one rank
    ckpt/data-20250101T120000-1a2b3c4d/              this checkpoint's files, plain .npy
        linear_2.b_0.npy                             a whole tensor (it was replicated)
        linear_0.w_0.at_0_16.npy                     the box starting at [0, 16] (it was split)

``index.json``::

    {"format": "autopar-checkpoint", "version": 2, "data": "data-20250101T120000-1a2b3c4d",
     "mesh": {"shape": [2, 2], "dim_names": ["dp", "mp"], "ranks": [0, 1, 2, 3]},
     "metadata": {},                                  # the user's, from exe.save(path, metadata=)
     "tensors": {"linear_0.w_0": {"kind": "parameter", "shape": [16, 32], "dtype": "float32",
                  "stored_as": "float32",           # the files' numpy dtype ("uint16" for bfloat16)
                  "placement": "[R,S(1)]", "mesh": "...",          # how it lay when saved
                  "boxes": [{"file": "data-.../linear_0.w_0.at_0_0.npy", "offsets": [0, 0],
                             "shape": [16, 16], "bytes": 1152, "sha256": "<hex>", "rank": 0},
                            ...]}, ...}}

A tensor's boxes tile it. Reading one without autopar (``sha256sum`` checks a file)::

    index = json.load(open("ckpt/index.json"))
    t = index["tensors"]["linear_0.w_0"]
    full = np.empty(t["shape"], t["stored_as"])
    for b in t["boxes"]:
        full[tuple(slice(o, o + n) for o, n in zip(b["offsets"], b["shape"]))] = np.load("ckpt/" + b["file"])
    if t["dtype"] == "bfloat16":  # the bits: as float32 values, exactly
        full = (full.astype(np.uint32) << 16).view(np.float32)

A bfloat16 tensor (Paddle's AMP O2 parameters) is saved as the ``uint16`` bits the scope hands
out, tagged ``"dtype": "bfloat16"``; a load gives the scope back a bfloat16 tensor with the same
bits. O2's fp32 master weights (``<param>_fp32_master_0``) are states like the moments, saved
and resharded as placed. Version-1 checkpoints (before bfloat16) load as they are.

:func:`load_full` gives the whole serial state dict (``paddle.static.set_program_state`` takes
it) and :func:`export_paddle` writes the ``.pdparams`` / ``.pdopt`` pair ``paddle.static.load``
reads.

The tensors are the program's parameters and persistable states (optimizer moments, beta
powers, the learning rate). A value replicated along some mesh dims is held identically by
several ranks: each distinct box is written once, by the lowest rank holding it; a pipeline
stage's tensor only by that stage's ranks (the other ranks' copies are stale).

Save, atomically: every rank writes its files into ``data-<token>.partial`` (the token chosen
by the mesh's lowest rank), fsyncs them, and reports them (or its error) in one exchange. If
all succeeded, the lowest rank renames the directory to ``data-<token>``, writes ``index.json``
under a temporary name and renames it over the old one — the commit: a crash at any point before it
leaves the previous checkpoint whole and loadable — then removes the previous data directory
and the leftovers of crashed saves. A last exchange returns only after the commit, so every rank
can load at once. A failed save raises on every rank.

Load: each rank opens only the files whose boxes overlap its piece (each verified: size,
SHA-256, header), assembles the piece, and once every rank has read its pieces without error
(one exchange) writes them into its scope: a failed load leaves every rank's state as it was
(the price: a rank holds its loaded pieces beside its state for the moment of the load).

The path must be visible to every rank (one host, or shared storage), and one job saves into a
path at a time. Tensors of a dtype the format cannot hold (numpy lacks it and it is not
bfloat16: ``float8_e4m3fn``) are refused by name.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autopar.checkpoint_format import (
    BITS,
    DATA_DIR,
    INDEX,
    Box,
    BoxFile,
    CheckpointError,
    Index,
    TensorEntry,
    dtype_name,
    export_paddle,
    fsync_directory,
    load_full,
    read_index,
    stored_dtype,
    sync_files,
    write_index,
    write_npy,
)
from autopar.errors import AutoparError
from autopar.mesh import ProcessMesh
from autopar.rank_plan import RankPlan, ValueInfo, ValueTable

__all__ = ["Box", "CheckpointError", "Index", "export_paddle", "load_full", "read_index", "sync_files"]

Exchange = Callable[[Any], list[Any]]  # all_gather_object: every rank's object, in rank order
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


# ---- what is saved, and by whom --------------------------------------------------------
def saved_values(values: ValueTable) -> dict[str, ValueInfo]:
    """The program's parameters and states by name (sorted), their dtypes checked."""
    keys = {**values.named("parameter"), **values.named("state")}
    out = {}
    for name in sorted(keys):
        info = values.info(keys[name])
        if info.placement.is_partial:
            raise CheckpointError(
                f"{info.kind} {name!r} is placed {info.placement} (partial): only whole values can be saved"
            )
        try:
            dtype_name(info.dtype)
        except CheckpointError as err:
            raise CheckpointError(f"{info.kind} {name!r}: {err}") from None
        out[name] = info
    return out


@dataclass(frozen=True, slots=True)
class BoxWrite:
    """One file of a save: tensor ``name``'s ``box``, written by ``rank`` as ``file``; ``dtype``
    the tensor's (its index name: the runner's array must be of ``stored_dtype(dtype)``)."""

    name: str
    box: Box
    rank: int
    file: str
    dtype: str


def plan_writes(values: ValueTable) -> list[BoxWrite]:
    """Every distinct non-empty box of every saved tensor, with the lowest rank holding it (the
    same list on every rank: each takes its own part)."""
    writes, files = [], set()
    for name, info in saved_values(values).items():
        seen: set[Box] = set()
        for rank in sorted(info.placement.mesh.ranks):
            box = Box.of(info.placement.local_slices(info.shape, rank))
            if box in seen or box.size == 0:
                continue
            seen.add(box)
            whole = box == Box.whole(info.shape)
            file = _UNSAFE.sub("_", name) + ("" if whole else ".at_" + "_".join(map(str, box.offsets))) + ".npy"
            if file in files:
                raise CheckpointError(
                    f"two boxes of the checkpoint would share the file name {file!r} (tensor {name!r}): rename one"
                )
            files.add(file)
            writes.append(BoxWrite(name, box, rank, file, dtype_name(info.dtype)))
    return writes


def checkpoint_root(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint path is a str or os.PathLike (a directory), got {type(path).__name__}")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} exists and is not a directory")
    return root


def check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CheckpointError(f"metadata must be a dict (saved in index.json), got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"metadata must be JSON-serializable (it is saved in index.json): {err}") from None


def new_token() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


# ---- one save --------------------------------------------------------------------------
class SaveTransaction:
    """The files of one save, in ``data-<token>.partial`` until :meth:`commit`."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token
        self.data = f"data-{token}"
        self.staging = root / f"{self.data}.partial"

    def write(self, writes: Sequence[BoxWrite], rank: int, read: Callable[[str], np.ndarray]) -> list[tuple[str, dict]]:
        """Write ``rank``'s boxes; (tensor name, file record) of each."""
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"rank {rank}: cannot create the checkpoint directory {self.staging}: {err}") from err
        records, written = [], []
        for item in writes:
            if item.rank != rank:
                continue
            array = np.asarray(read(item.name))
            if array.shape != item.box.shape:
                raise CheckpointError(
                    f"rank {rank} holds {item.name!r} with shape {list(array.shape)}, its placement gives the box {item.box}"
                )
            if array.dtype != stored_dtype(item.dtype):  # (bfloat16: the bits, never values converted)
                raise CheckpointError(
                    f"rank {rank} hands out {item.name!r} as a {array.dtype} array; a {item.dtype} tensor is saved "
                    f"from a {stored_dtype(item.dtype)} array"
                )
            target = self.staging / item.file
            try:
                size, digest = write_npy(target, array)
            except OSError as err:
                raise CheckpointError(f"rank {rank}: writing tensor {item.name!r} to {target}: {err}") from err
            written.append(target)
            record = BoxFile(f"{self.data}/{item.file}", item.box, size, digest, rank)
            records.append((item.name, record.to_json()))
        try:
            sync_files(written)
        except OSError as err:
            raise CheckpointError(
                f"rank {rank}: flushing its checkpoint files in {self.staging} to disk: {err}"
            ) from err
        return records

    def commit(
        self, values: ValueTable, mesh: ProcessMesh, records: Sequence[tuple[str, dict]], metadata: Mapping[str, Any]
    ) -> None:
        """Publish: rename the data directory, replace index.json, remove what it replaced."""
        final = self.root / self.data
        boxes: dict[str, list[BoxFile]] = {}
        for name, item in records:
            box = Box(tuple(item["offsets"]), tuple(item["shape"]))
            boxes.setdefault(name, []).append(BoxFile(item["file"], box, item["bytes"], item["sha256"], item["rank"]))
        tensors = {
            name: TensorEntry(name, info.kind, info.shape, dtype_name(info.dtype), str(info.placement), str(info.placement.mesh),
                              tuple(sorted(boxes.get(name, []), key=lambda b: b.box.offsets)))
            for name, info in saved_values(values).items()
        }  # fmt: skip
        layout = {"shape": list(mesh.shape), "dim_names": list(mesh.dim_names), "ranks": list(mesh.ranks)}
        try:
            self.staging.mkdir(parents=True, exist_ok=True)  # (a save with no file to write)
            fsync_directory(self.staging)
            os.rename(self.staging, final)
            write_index(self.root, Index(self.root, tensors, self.data, layout, dict(metadata)), self.token)
        except OSError as err:
            shutil.rmtree(final, ignore_errors=True)
            raise CheckpointError(
                f"committing the checkpoint {self.root / INDEX}: {err}; the previous checkpoint is unchanged"
            ) from err
        for entry in self.root.iterdir():  # the previous checkpoint's files, crashed saves' leftovers
            if entry.name != self.data and entry.is_dir() and DATA_DIR.match(entry.name):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(f".{INDEX}.") and entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _failure(rank: int, err: BaseException) -> str:
    text = str(err) if isinstance(err, AutoparError) else f"{type(err).__name__}: {err}"
    return text if text.startswith(f"rank {rank}") else f"rank {rank}: {text}"


def save_ranks(path: Any, plans: Mapping[int, RankPlan], runners: Mapping[int, Any], metadata: Any = None) -> Path:
    """Save every rank of one process (the simulator): the same files and commit as
    :func:`save_rank` on each rank of a job."""
    root, metadata = checkpoint_root(path), check_metadata(metadata)
    plan = next(iter(plans.values()))
    transaction = SaveTransaction(root, new_token())
    writes, records = plan_writes(plan.values), []
    for rank in sorted(runners):
        try:
            records += transaction.write(writes, rank, runners[rank].parameter_piece)
        except Exception as err:
            transaction.abort()
            raise CheckpointError(
                f"save to {root} failed (the previous checkpoint is unchanged): {_failure(rank, err)}"
            ) from err
    transaction.commit(plan.values, plan.mesh, records, metadata)
    return root


def save_rank(path: Any, plan: RankPlan, runner: Any, exchange: Exchange, metadata: Any = None) -> Path:
    """This rank's part of a job's save; every rank of the mesh calls it (three exchanges)."""
    root, metadata = checkpoint_root(path), check_metadata(metadata)
    lead = min(plan.mesh.ranks)
    token = exchange(new_token() if plan.rank == lead else None)[lead]
    transaction = SaveTransaction(root, token)
    outcome: Any
    try:
        outcome = transaction.write(plan_writes(plan.values), plan.rank, runner.parameter_piece)
    except Exception as err:
        outcome = _failure(plan.rank, err)
    everyone = exchange(outcome)
    failures = [everyone[r] for r in sorted(plan.mesh.ranks) if isinstance(everyone[r], str)]
    status = None
    if plan.rank == lead and failures:
        transaction.abort()
    elif plan.rank == lead:
        try:
            records = [r for rank in sorted(plan.mesh.ranks) for r in everyone[rank]]
            transaction.commit(plan.values, plan.mesh, records, metadata)
        except Exception as err:
            status = _failure(plan.rank, err)
    status = exchange(status)[lead]  # every rank returns after the commit (or the clean-up)
    if failures:
        raise CheckpointError(f"save to {root} failed (the previous checkpoint is unchanged): {'; '.join(failures)}")
    if status is not None:
        raise CheckpointError(f"save to {root} failed: {status}")
    return root


# ---- load ------------------------------------------------------------------------------
def load_targets(plan: RankPlan) -> list[tuple[str, ValueInfo, Box]]:
    """The boxes this rank holds: its piece of each tensor placed on a mesh it is in; the whole
    value of a replicated tensor placed elsewhere that its program reads all the same (a
    pipeline's learning rate, placed on stage 0, read by every stage)."""
    out = []
    for name, info in saved_values(plan.values).items():
        if plan.rank in info.placement.mesh.ranks:
            out.append((name, info, Box.of(info.placement.local_slices(info.shape, plan.rank))))
            continue
        if info.placement.sharded_mesh_dims():
            continue
        if name in plan.scope_reads:
            out.append((name, info, Box.whole(info.shape)))
    return out


def read_pieces(index: Index, wanted: Sequence[tuple[str, ValueInfo, Box]]) -> dict[tuple[str, Box], np.ndarray]:
    """Each wanted (tensor, box), read once however many ranks want it; the checkpoint's shape
    and dtype checked against the program's first."""
    missing = sorted({name for name, _, _ in wanted if name not in index.tensors})
    if len(missing) > 1:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        raise CheckpointError(
            f"checkpoint {index.root / INDEX} has no tensor {missing[0]!r}: {len(missing)} tensors of the program are not "
            f"in it ({shown}); it holds {len(index.tensors)}, saved from another program or optimizer?"
        )
    boxes: dict[str, list[Box]] = {}
    for name, info, box in wanted:
        entry = index.entry(name)
        if entry.shape != info.shape:
            raise CheckpointError(
                f"checkpoint {index.root / INDEX}: tensor {name!r} has shape {list(entry.shape)}, the program's {info.kind} "
                f"has {list(info.shape)}"
            )
        if entry.dtype != dtype_name(info.dtype):
            raise CheckpointError(
                f"checkpoint {index.root / INDEX}: tensor {name!r} has dtype {entry.dtype}, the program's {info.kind} has {info.dtype}"
            )
        if box not in boxes.setdefault(name, []):
            boxes[name].append(box)
    return index.read_many(boxes)


def install(runner: Any, name: str, array: np.ndarray) -> None:
    """Write a loaded piece into the runner's scope, after checking the scope's own shape and
    dtype (Paddle makes a bfloat16 tensor of ``uint16`` bits: a bf16 tensor stays bf16)."""
    var = runner.scope.find_var(name)
    if var is not None and var.get_tensor()._is_initialized():
        held = tuple(var.get_tensor().shape())
        if held != array.shape:
            raise AutoparError(
                f"rank {runner.rank} holds {name!r} with shape {list(held)}, the loaded piece has {list(array.shape)}"
            )
        kept, given = dtype_name(var.get_tensor()._dtype()), _scope_dtype(array)
        if kept != given:
            raise AutoparError(f"rank {runner.rank} holds {name!r} as {kept}, the loaded piece would make it {given}")
    if hasattr(runner, "write"):
        runner.write(name, array)
        return
    from autopar.runtime.device import current_device

    runner.scope.var(name).get_tensor().set(np.require(array, requirements="C"), current_device().place)


def _scope_dtype(array: np.ndarray) -> str:
    """The dtype of the tensor Paddle's ``tensor.set(array)`` makes: ``uint16`` bits are bfloat16."""
    return next((name for name, bits in BITS.items() if array.dtype == bits), str(array.dtype))


def load_ranks(path: Any, plans: Mapping[int, RankPlan], runners: Mapping[int, Any]) -> dict[str, Any]:
    """Load every rank of one process (the simulator); the checkpoint's metadata."""
    index = read_index(checkpoint_root(path))
    targets = {rank: load_targets(plan) for rank, plan in plans.items()}
    pieces = read_pieces(index, [t for wanted in targets.values() for t in wanted])
    for rank, wanted in targets.items():
        for name, _, box in wanted:
            install(runners[rank], name, pieces[name, box])
    return dict(index.metadata)


def load_rank(path: Any, plan: RankPlan, runner: Any, exchange: Exchange) -> dict[str, Any]:
    """This rank's part of a job's load; every rank of the mesh calls it (one exchange)."""
    pieces: dict[tuple[str, Box], np.ndarray] = {}
    wanted: list[tuple[str, ValueInfo, Box]] = []
    metadata: dict[str, Any] = {}
    outcome = None
    try:
        index = read_index(checkpoint_root(path))
        wanted = load_targets(plan)
        pieces = read_pieces(index, wanted)
        metadata = dict(index.metadata)
    except Exception as err:
        outcome = _failure(plan.rank, err)
    everyone = exchange(outcome)
    failures = [everyone[r] for r in sorted(plan.mesh.ranks) if everyone[r] is not None]
    if failures:
        raise CheckpointError(f"load from {path} failed (no rank's state was changed): {'; '.join(failures)}")
    for name, _, box in wanted:
        install(runner, name, pieces[name, box])
    return metadata
