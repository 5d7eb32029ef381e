"""The checkpoint format on disk: boxes, ``.npy`` files with checksums, the JSON index, and the
full serial state dict (stage: runtime; no compiler or Paddle import, so a checkpoint can be
read, checked and exported without a DistributedProgram). :mod:`autopar.checkpoint` says which
rank writes and reads which box; the layout is described there.

Every read is checked before a byte is used: a file that is missing, shorter or longer than the
index says, whose SHA-256 differs, or whose ``.npy`` header disagrees with the index raises
:class:`CheckpointError` naming the tensor and the file.

Dtypes: every numpy dtype, and (since version 2) ``bfloat16``, which numpy lacks. A bfloat16
tensor's files hold its bits exactly as Paddle's scope hands them out (``np.array`` of a bf16
tensor is a ``uint16`` array of the top 16 bits of each float32), and its index entry says
``"dtype": "bfloat16", "stored_as": "uint16"``: the dtype is recorded, never inferred from the
files, and the values are never converted (so never rounded) on the way. Paddle takes such a
``uint16`` array back as a bfloat16 tensor (``tensor.set``, ``paddle.static.set_program_state``).
Another dtype numpy lacks (``float8_e4m3fn``) is refused by name (:func:`dtype_name`).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import math
import os
import pickle
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autopar.errors import CheckpointError

FORMAT = "autopar-checkpoint"
VERSION = 2  # 2: bfloat16 tensors (index entries gain "stored_as")
READS = (1, 2)  # version 1 (autopar before bfloat16) has numpy dtypes only: the same files
INDEX = "index.json"
DATA_DIR = re.compile(r"^data-\d{8}T\d{6}-[0-9a-f]{8}(\.partial)?$")  # the only directories a save removes
READERS = 4  # files read and verified at once by a load
_HEADER_BYTES = 16 + (1 << 16)  # the longest .npy 1.0 header (what write_npy writes)
_OVERLAP_BYTES = 1 << 20  # hash on a second thread above this size
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


@dataclass(frozen=True, slots=True)
class Box:
    """A block of a global tensor: ``offsets`` (its first element) and ``shape``."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, slices: Sequence[slice]) -> Box:
        return cls(tuple(s.start for s in slices), tuple(s.stop - s.start for s in slices))

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """This box as slices of an array whose first element is at ``origin`` (default 0)."""
        origin = origin or (0,) * len(self.offsets)
        return tuple(slice(o - base, o - base + n) for o, n, base in zip(self.offsets, self.shape, origin))

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None if it is empty."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        stops = tuple(min(a + m, b + n) for a, m, b, n in zip(self.offsets, self.shape, other.offsets, other.shape))
        if any(stop <= start for start, stop in zip(starts, stops)):
            return None
        return Box(starts, tuple(stop - start for start, stop in zip(starts, stops)))

    def inside(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.shape, shape)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.shape)) + "]"


# ---- one box file ------------------------------------------------------------------------
def write_npy(path: Path, array: np.ndarray) -> tuple[int, str]:
    """Write ``array`` as a ``.npy`` file (exclusive create; not yet fsynced: :func:`sync_files`);
    (bytes, sha256 of the file). The hash runs on a second thread while the bytes are written
    (both release the GIL)."""
    array = np.require(array, requirements="C")  # (ascontiguousarray would make a 0-d array 1-d)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(array))
    header = head.getvalue()
    body = array.reshape(-1).view(np.uint8)
    digest = hashlib.sha256(header)
    hashing = threading.Thread(target=digest.update, args=(body,)) if body.size > _OVERLAP_BYTES else None
    if hashing is None:
        digest.update(body)
    else:
        hashing.start()
    try:
        with open(path, "xb") as f:
            f.write(header)
            f.write(body)
    finally:
        if hashing is not None:
            hashing.join()
    return len(header) + body.size, digest.hexdigest()


def sync_files(paths: Sequence[Path]) -> None:
    """fsync files written earlier: one pass at the end lets the kernel write them back while
    the next ones are written, instead of waiting on each in turn."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class BoxFile:
    """One file of the index: the box of its tensor it holds, its size and checksum."""

    file: str  # relative to the checkpoint directory
    box: Box
    bytes: int
    sha256: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offsets": list(self.box.offsets), "shape": list(self.box.shape),
                "bytes": self.bytes, "sha256": self.sha256, "rank": self.rank}  # fmt: skip


def read_box_file(root: Path, name: str, dtype: str, record: BoxFile) -> np.ndarray:
    """The verified array of one box file (size, checksum, then header against the index)."""
    path = root / record.file
    where = f"checkpoint {root}: tensor {name!r}, file {path}"
    try:
        with open(path, "rb", buffering=0) as f:
            data = np.empty(record.bytes, dtype=np.uint8)  # writable, and not zero-filled first
            view, size = memoryview(data), 0
            while size < record.bytes and (count := f.readinto(view[size:])):
                size += count
            longer = size == record.bytes and f.read(1)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except OSError as err:
        raise CheckpointError(f"{where} cannot be read: {err}") from err
    if size < record.bytes:
        raise CheckpointError(f"{where} is truncated: {size} bytes, the index says {record.bytes}")
    if longer:
        raise CheckpointError(f"{where} is longer than the {record.bytes} bytes the index says: corrupted")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise CheckpointError(f"{where} is corrupted: its SHA-256 differs from the index's")
    fp = io.BytesIO(data[:_HEADER_BYTES].tobytes())  # (the header only: no copy of the data)
    try:
        version = np.lib.format.read_magic(fp)
        shape, fortran, found = _HEADER_READERS[version](fp)
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{where} is not a .npy file numpy can read: {err}") from err
    if tuple(shape) != record.box.shape or fortran:
        raise CheckpointError(
            f"{where} holds shape {list(shape)}, the index says box {record.box} (shape {list(record.box.shape)})"
        )
    if np.dtype(found) != stored_dtype(dtype):
        stored = "" if str(stored_dtype(dtype)) == dtype else f" (stored as {stored_dtype(dtype)})"
        raise CheckpointError(f"{where} holds dtype {found}, the index says {dtype}{stored}")
    return np.frombuffer(data, dtype=found, count=math.prod(shape), offset=fp.tell()).reshape(shape)


# ---- dtypes ------------------------------------------------------------------------------
# Dtypes numpy lacks that the format holds: the numpy dtype of their bits in the files.
BITS = {"bfloat16": np.dtype("<u2")}  # the top half of a float32's bits: what Paddle's scope hands out


def dtype_name(dtype: Any) -> str:
    """The index's name of a dtype (a numpy dtype, a Paddle dtype or its name): numpy's name, or
    ``bfloat16``; a dtype the format cannot hold raises :class:`CheckpointError` naming it."""
    text = str(dtype).removeprefix("paddle.")
    if text in BITS:
        return text
    try:
        return str(np.dtype(text))
    except TypeError:
        raise CheckpointError(
            f"dtype {text} cannot be held by the checkpoint format: numpy lacks it, and of the dtypes numpy lacks "
            f"the format holds only {', '.join(sorted(BITS))} (as bits)"
        ) from None


def stored_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of the files of a tensor of dtype ``dtype`` (an index name)."""
    return BITS.get(dtype) or np.dtype(dtype)


# ---- the index -------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str  # "parameter" or "state" (optimizer state, learning rate, step counters)
    shape: tuple[int, ...]
    dtype: str  # the tensor's: a numpy dtype's name or "bfloat16" (files: stored_dtype(dtype))
    placement: str  # as saved, for people: "[S(0),R]" on ``mesh``
    mesh: str
    boxes: tuple[BoxFile, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype, "stored_as": str(self.stored),
                "placement": self.placement, "mesh": self.mesh, "boxes": [b.to_json() for b in self.boxes]}  # fmt: skip

    @property
    def stored(self) -> np.dtype:
        """The numpy dtype of its files and of the arrays a read returns (bfloat16: uint16 bits)."""
        return stored_dtype(self.dtype)


@dataclass(frozen=True)
class Index:
    """A checkpoint's ``index.json``, checked against itself (every box inside its tensor)."""

    root: Path
    tensors: Mapping[str, TensorEntry]
    data: str  # the directory holding this checkpoint's files
    mesh: Mapping[str, Any]
    metadata: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "data": self.data, "mesh": dict(self.mesh),
                "metadata": dict(self.metadata), "tensors": {n: t.to_json() for n, t in sorted(self.tensors.items())}}  # fmt: skip

    def entry(self, name: str) -> TensorEntry:
        found = self.tensors.get(name)
        if found is None:
            near = sorted(self.tensors)
            raise CheckpointError(
                f"checkpoint {self.root / INDEX} has no tensor {name!r} ({len(near)} tensors: {', '.join(near[:8])}"
                f"{', ...' if len(near) > 8 else ''})"
            )
        return found

    def read(self, name: str, wanted: Sequence[Box]) -> list[np.ndarray]:
        """Each box of ``wanted`` of tensor ``name`` (see :meth:`read_many`)."""
        found = self.read_many({name: wanted})
        return [found[name, box] for box in wanted]

    def read_many(self, wanted: Mapping[str, Sequence[Box]]) -> dict[tuple[str, Box], np.ndarray]:
        """Each wanted box of each tensor, assembled from the files overlapping it. A file no
        wanted box overlaps is never opened; the others are read and verified once each, a few
        at a time on worker threads (reading and hashing release the GIL); a file holding
        exactly a wanted box becomes that box's array without a copy."""
        out: dict[tuple[str, Box], np.ndarray] = {}
        covered: dict[tuple[str, Box], int] = {}
        jobs = []
        for name in sorted(wanted):
            entry = self.entry(name)
            for record in entry.boxes:
                hits = [(box, common) for box in wanted[name] if (common := record.box.intersect(box)) is not None]
                if hits:
                    jobs.append((name, entry.dtype, record, hits))
        exact = {(name, box) for name, _, record, hits in jobs for box, _ in hits if record.box == box}
        for (name, dtype, record, hits), array in zip(jobs, self._verified(jobs)):
            for box, common in hits:
                key = (name, box)
                covered[key] = covered.get(key, 0) + common.size
                if key in exact:  # one file holds the box: its array, no copy (another overlapping it
                    if record.box == box:  # means overlapping boxes: the count below says so)
                        out[key] = array
                    continue
                if key not in out:
                    out[key] = np.empty(box.shape, dtype=stored_dtype(dtype))
                out[key][common.slices(box.offsets)] = array[common.slices(record.box.offsets)]
        for name, boxes in wanted.items():
            for box in boxes:
                if covered.get((name, box), 0) != box.size:
                    raise CheckpointError(
                        f"checkpoint {self.root / INDEX}: the boxes of tensor {name!r} cover {covered.get((name, box), 0)} "
                        f"of the {box.size} elements of {box}"
                    )
                out.setdefault((name, box), np.empty(box.shape, dtype=self.tensors[name].stored))
        return out

    def _verified(self, jobs: Sequence[tuple[str, str, BoxFile, Any]]) -> Iterator[np.ndarray]:
        """The verified array of each job's file, in order, READERS files in flight."""
        with ThreadPoolExecutor(READERS) as pool:
            pending: collections.deque = collections.deque()
            for name, dtype, record, _ in jobs:
                pending.append(pool.submit(read_box_file, self.root, name, dtype, record))
                if len(pending) > READERS:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()


def read_index(path: str | os.PathLike) -> Index:
    """Read and check a checkpoint directory's ``index.json``."""
    root = Path(path)
    where = root / INDEX
    try:
        document = json.loads(where.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {root}: {where} does not exist") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint index {where} cannot be read: {err}") from err
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f'{where} is not an autopar checkpoint index (no "format": "{FORMAT}")')
    if document.get("version") not in READS:
        raise CheckpointError(
            f"{where} has format version {document.get('version')!r}; this autopar reads versions "
            f"{', '.join(map(str, READS))}"
        )
    try:
        tensors = {name: _entry(name, spec) for name, spec in document["tensors"].items()}
        return Index(
            root, tensors, str(document["data"]), dict(document.get("mesh", {})), dict(document.get("metadata", {}))
        )
    except CheckpointError as err:
        raise CheckpointError(f"{where}: {err}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{where} is malformed: {type(err).__name__}: {err}") from None


def _entry(name: str, spec: Mapping[str, Any]) -> TensorEntry:
    shape = tuple(int(s) for s in spec["shape"])
    dtype = dtype_name(spec["dtype"])  # ("stored_as" follows from it: written for readers without autopar)
    boxes = []
    for item in spec["boxes"]:
        box = Box(tuple(int(o) for o in item["offsets"]), tuple(int(s) for s in item["shape"]))
        file = str(item["file"])
        if not box.inside(shape):
            raise CheckpointError(f"tensor {name!r}: file {file} holds box {box}, outside its shape {list(shape)}")
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"tensor {name!r}: file {file!r} is not inside the checkpoint directory")
        boxes.append(BoxFile(file, box, int(item["bytes"]), str(item["sha256"]), int(item["rank"])))
    return TensorEntry(
        name, str(spec["kind"]), shape, dtype, str(spec.get("placement", "")), str(spec.get("mesh", "")), tuple(boxes)
    )


def write_index(root: Path, index: Index, token: str) -> None:
    """Replace ``root/index.json`` atomically: a temporary file, fsynced, then renamed over it."""
    temporary = root / f".{INDEX}.{token}.tmp"
    with open(temporary, "w") as f:
        json.dump(index.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, root / INDEX)
    fsync_directory(root)


def fsync_directory(path: Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- the full serial state -------------------------------------------------------------
def load_full(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as one full array, by name: the serial program's state dict
    (``paddle.static.set_program_state(main, state)`` after its start-up takes it). A bfloat16
    tensor comes as its ``uint16`` bits, as ``paddle.static.save`` writes it and Paddle takes it
    back (``index.tensors[name].dtype`` says bfloat16)."""
    index = read_index(path)
    found = index.read_many({name: [Box.whole(entry.shape)] for name, entry in index.tensors.items()})
    return {name: found[name, Box.whole(entry.shape)] for name, entry in sorted(index.tensors.items())}


def export_paddle(path: str | os.PathLike, model_prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write a checkpoint as the files ``paddle.static.save`` writes: ``<prefix>.pdparams``
    (parameters) and ``<prefix>.pdopt`` (optimizer states, learning rate): pickled dicts of
    name -> numpy array, which ``paddle.static.load(main_program, prefix)`` reads."""
    index = read_index(path)
    state = load_full(path)
    prefix = Path(model_prefix)
    if not prefix.name:
        raise CheckpointError(f"model_prefix must be 'directory/name', got {str(model_prefix)!r}")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    files = (Path(f"{prefix}.pdparams"), Path(f"{prefix}.pdopt"))
    for file, parameters in zip(files, (True, False)):
        part = {n: a for n, a in state.items() if (index.tensors[n].kind == "parameter") == parameters}
        with open(file, "wb") as f:
            pickle.dump(part, f, protocol=4)
    return files
