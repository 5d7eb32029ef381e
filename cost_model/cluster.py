"""Cluster description: nodes, links and devices (stage: plan reshards / cost report).

A :class:`Cluster` is ``nodes`` x ``devices_per_node`` devices, one intra-node and one
inter-node :class:`Link` (alpha = latency per message step in seconds, bandwidth in bytes/s
per direction per device) and a :class:`Device` (peak FLOP/s per dtype, memory bandwidth,
memory size). Profiles are JSON files (:func:`load_cluster` / :meth:`Cluster.save`); the
shipped ones are ``h100-node`` (8 x H100 SXM per node, NVLink + 400 Gb/s InfiniBand, figures
cited in the file), ``cpu-shm`` and ``cpu-gloo`` (this machine's CPU runtime over shared memory
and over gloo, written by ``tools/calibrate.py [--communicator shm]``).
Without a profile named, :func:`default_cluster` takes the one for the hardware in use
(:func:`hardware_profile`: a GPU profile with a CUDA build and a visible GPU, else the CPU
profile of the communicator a one-machine job uses).

Placement: rank ``r`` lives on node ``r // devices_per_node`` (launcher order). A mesh whose
ranks are numbered row-major (``ProcessMesh([[0,1,2,3],[4,5,6,7]])``) therefore keeps its
last mesh dim innermost, inside a node; a group along an outer mesh dim crosses nodes, and
:meth:`Cluster.link_for` returns the slowest link a group crosses.

A calibrated profile may carry per-collective fits (``collectives``: kind -> latency and
bandwidth of the link as seen by that collective's implementation, optionally with a *knee*
for buffers big enough to be fresh memory, see :class:`Link`), ``emulated`` kinds (gloo has
no reduce_scatter / all_to_all: they run as all_reduce / all_gather plus a slice) and
``subgroups``, how a collective over part of the world runs:

- ``"native"`` (default; NCCL): the group has its own communicator;
- ``"world_exchange"`` (``cpu-gloo``: the host backend, since gloo sub-groups deadlock with
  4 processes): every rank of the world sends its input to every other rank
  (``all_gather_object``, priced by the ``exchange`` fit: world x input bytes gathered,
  pickling included) and computes its group's result locally.

:mod:`autopar.cost_model.comm` reads both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from autopar.collective_kinds import KINDS
from autopar.errors import CostModelError
from autopar.host_comm import one_host_default

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}  # fmt: skip
EMULATIONS = {k.value: e.emulated_by.value for k, e in KINDS.items() if e.emulated_by is not None}  # reduce_scatter, all_to_all
SUBGROUPS = ("native", "world_exchange")
PROFILES = {"h100-node": "h100_node.json", "cpu-gloo": "cpu_gloo.json", "cpu-shm": "cpu_shm.json"}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (Paddle / numpy names; ``paddle.float32`` works too)."""
    name = str(dtype).removeprefix("paddle.").removeprefix("pd_op.")
    if name not in DTYPE_BYTES:
        raise CostModelError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _figure(data: Mapping[str, Any], key: str, where: str, *, allow_zero: bool = True) -> float:
    if key not in data:
        raise CostModelError(f"cluster profile: missing field {where}.{key}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CostModelError(f"cluster profile: field {where}.{key} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise CostModelError(
            f"cluster profile: field {where}.{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}"
        )
    return float(value)


@dataclass(frozen=True, slots=True)
class Link:
    """Alpha-beta link: ``latency`` seconds per message step, ``bandwidth`` bytes/s per direction.

    Optional *knee* (fitted on ``cpu-gloo``): a collective whose buffer (its nccl-tests size) is
    at least ``knee`` bytes also pays ``buffer / knee_bandwidth`` seconds: from that size on its
    buffers are fresh memory. On glibc every allocation of at least 32 MiB (the largest dynamic
    mmap threshold) is a fresh mapping, Paddle's CPU collectives allocate their outputs per call,
    and each 4 KiB page then faults in on first touch (3-6 us here: 32 MiB of ``paddle.ones``
    took 25 ms, 8193 faults). Measured on 2 processes: the time per byte of an all_gather
    roughly doubles between 16 and 64 MiB of output. Default: no knee.
    """

    latency: float
    bandwidth: float
    knee: float = math.inf
    knee_bandwidth: float = math.inf

    def __post_init__(self) -> None:
        _figure({"latency": self.latency}, "latency", "link")
        _figure({"bandwidth": self.bandwidth}, "bandwidth", "link", allow_zero=False)
        if not self.knee > 0 or not self.knee_bandwidth > 0:
            raise CostModelError(f"link: knee and knee_bandwidth must be > 0, got {self.knee}, {self.knee_bandwidth}")

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth

    def seconds(self, steps: float, volume: float, buffer: float) -> float:
        """``steps`` latencies + ``volume`` bytes at the bandwidth (+ the knee's term for ``buffer``)."""
        extra = buffer / self.knee_bandwidth if buffer >= self.knee else 0.0
        return steps * self.latency + volume / self.bandwidth + extra

    def to_dict(self) -> dict[str, float]:
        out = {"latency": self.latency, "bandwidth": self.bandwidth}
        if math.isfinite(self.knee) and math.isfinite(self.knee_bandwidth):
            out.update(knee=self.knee, knee_bandwidth=self.knee_bandwidth)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Link:
        if not isinstance(data, Mapping):
            raise CostModelError(f"cluster profile: field {where} must be an object, got {data!r}")
        knee = {}
        if "knee" in data or "knee_bandwidth" in data:
            knee = {key: _figure(data, key, where, allow_zero=False) for key in ("knee", "knee_bandwidth")}
        return cls(_figure(data, "latency", where), _figure(data, "bandwidth", where, allow_zero=False), **knee)


@lru_cache(maxsize=8)
def _table(pairs: tuple[tuple[str, float], ...]) -> dict[str, float]:
    return dict(pairs)


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or one CPU process): peak FLOP/s per dtype, memory bandwidth and size,
    and what its ops *achieve* (the compute side prices with these: :meth:`OpCost.time
    <autopar.cost_model.compute.OpCost.time>`).

    ``achieved_flops``: the matmul rate per dtype as measured (h100-node: cuBLAS GEMMs of GPT
    shapes, ``measured/H100.md``; cpu profiles: Paddle's CPU matmul kernel, calibrated); a dtype
    not measured runs at its peak. ``achieved_bandwidth``: what elementwise ops stream (0: the
    peak ``memory_bandwidth``); ``cache_bandwidth``: what they stream when their bytes fit in
    ``cache_bytes`` (a CPU's level-2 cache; 0: no such tier). ``cores``: a CPU node's cores,
    which its processes share (four processes on two cores each compute at half speed). ``op_seconds``: the fixed cost of running one op (a kernel
    launch on a GPU; Paddle's interpreter step on CPU). ``segment_seconds``: the fixed cost of
    one program run on the host (the host backend ends a program segment at every collective
    and a pipeline runs one per phase; 0 where collectives run inside the program).
    ``kernel_seconds``: seconds per element (of an op's largest operand) each kernel took in
    training steps (cpu profiles: ``tools/kernel_rates.py``); an op of a measured
    kernel costs at least its elements times that; absent: the roofline alone.
    ``batched_flops``: the rate per dtype of a *batched* matmul (both operands carry batch
    dims: attention's score and context products, which run far below a GEMM's rate on a
    GPU: h100-node's bfloat16 score bmm at 300 TFLOP/s against GEMMs' 710, ``measured/H100.md``);
    a dtype not measured: :meth:`matmul_rate`'s GEMM rate.
    """

    peak_flops: tuple[tuple[str, float], ...]  # (dtype, FLOP/s); "float32" is the fallback
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    achieved_flops: tuple[tuple[str, float], ...] = ()  # (dtype, FLOP/s) measured; absent: the peak
    achieved_bandwidth: float = 0.0  # bytes/s measured; 0: memory_bandwidth
    op_seconds: float = 5e-6
    segment_seconds: float = 0.0
    cache_bytes: float = 0.0  # an op moving at most this many bytes streams at cache_bandwidth
    cache_bandwidth: float = 0.0
    cores: int = 0  # a CPU node's cores, shared by its processes; 0: each device computes on its own
    kernel_seconds: tuple[tuple[str, float], ...] = ()  # (kernel, seconds per element) measured
    batched_flops: tuple[tuple[str, float], ...] = ()  # (dtype, FLOP/s) of batched matmuls measured; absent: matmul_rate

    def shared_by(self, processes: int) -> float:
        """How much slower each of ``processes`` computing at once on a node runs (a CPU's
        processes share its cores; an accelerator is its own)."""
        return max(1.0, processes / self.cores) if self.cores else 1.0

    def flops_for(self, dtype: str) -> float:
        table = dict(self.peak_flops)
        return table.get(str(dtype).removeprefix("paddle."), table["float32"])

    def matmul_rate(self, dtype: str, batched: bool = False) -> float:
        """FLOP/s a matmul of ``dtype`` achieves (the peak where none was measured);
        ``batched``: a batched matmul's (attention's products), where the device measured one."""
        name = str(dtype).removeprefix("paddle.")
        if batched and name in _table(self.batched_flops):
            return _table(self.batched_flops)[name]
        achieved = dict(self.achieved_flops)
        if name in achieved:
            return achieved[name]
        if name not in dict(self.peak_flops) and "float32" in achieved:
            return achieved["float32"]
        return self.flops_for(name)

    def element_seconds(self, kernel: str) -> float:
        """Seconds per element ``kernel`` took in measured training steps (0: not measured)."""
        return _table(self.kernel_seconds).get(kernel, 0.0)

    def stream_bandwidth(self, nbytes: float) -> float:
        """Bytes/s an elementwise op moving ``nbytes`` achieves (in the cache when they fit)."""
        if nbytes <= self.cache_bytes and self.cache_bandwidth:
            return self.cache_bandwidth
        return self.achieved_bandwidth or self.memory_bandwidth

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "memory_bytes": self.memory_bytes,
        }
        achieved: dict[str, Any] = {"flops": dict(self.achieved_flops)} if self.achieved_flops else {}
        if self.achieved_bandwidth:
            achieved["memory_bandwidth"] = self.achieved_bandwidth
        if self.cache_bandwidth:
            achieved.update(cache_bytes=self.cache_bytes, cache_bandwidth=self.cache_bandwidth)
        if self.cores:
            out["cores"] = self.cores
        achieved.update(op_seconds=self.op_seconds, segment_seconds=self.segment_seconds)
        if self.kernel_seconds:
            achieved["kernel_seconds"] = dict(self.kernel_seconds)
        if self.batched_flops:
            achieved["batched_flops"] = dict(self.batched_flops)
        out["achieved"] = achieved
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "device") -> Device:
        if not isinstance(data, Mapping):
            raise CostModelError(f"cluster profile: field {where} must be an object")
        flops = data.get("peak_flops")
        if not isinstance(flops, Mapping) or "float32" not in flops:
            raise CostModelError(f"cluster profile: missing field {where}.peak_flops.float32")
        peak = tuple(sorted((k, _figure(flops, k, f"{where}.peak_flops", allow_zero=False)) for k in flops))
        achieved = data.get("achieved", {})
        if not isinstance(achieved, Mapping):
            raise CostModelError(f"cluster profile: field {where}.achieved must be an object")
        rates = achieved.get("flops", {})
        if not isinstance(rates, Mapping):
            raise CostModelError(f"cluster profile: field {where}.achieved.flops must be an object")
        at = f"{where}.achieved"
        kernels = achieved.get("kernel_seconds", {})
        if not isinstance(kernels, Mapping):
            raise CostModelError(f"cluster profile: field {at}.kernel_seconds must be an object")
        batched = achieved.get("batched_flops", {})
        if not isinstance(batched, Mapping):
            raise CostModelError(f"cluster profile: field {at}.batched_flops must be an object")
        return cls(
            peak,
            _figure(data, "memory_bandwidth", where, allow_zero=False),
            _figure(data, "memory_bytes", where, allow_zero=False),
            tuple(sorted((k, _figure(rates, k, f"{at}.flops", allow_zero=False)) for k in rates)),
            _figure(achieved, "memory_bandwidth", at) if "memory_bandwidth" in achieved else 0.0,
            _figure(achieved, "op_seconds", at) if "op_seconds" in achieved else 5e-6,
            _figure(achieved, "segment_seconds", at) if "segment_seconds" in achieved else 0.0,
            *(_figure(achieved, k, at) if k in achieved else 0.0 for k in ("cache_bytes", "cache_bandwidth")),
            int(_figure(data, "cores", where)) if "cores" in data else 0,
            tuple(sorted((k, _figure(kernels, k, f"{at}.kernel_seconds")) for k in kernels)),
            tuple(sorted((k, _figure(batched, k, f"{at}.batched_flops", allow_zero=False)) for k in batched)),
        )


@dataclass(frozen=True, slots=True)
class Cluster:
    """Nodes x devices per node, intra / inter links, the device, optional calibrated fits.

    The hash is computed once (every cached reshard plan is keyed on the cluster) and never
    pickled (string hashes differ between processes)."""

    name: str
    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    device: Device
    collectives: tuple[tuple[str, Link], ...] = ()  # kind or kind@p -> link as that collective sees it
    emulated: tuple[str, ...] = ()  # kinds run as their EMULATIONS entry plus a local slice
    subgroups: str = "native"  # how a collective over part of the world runs: one of SUBGROUPS
    tree: bool = True  # whether tree algorithms (all_reduce, broadcast) are available
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.name, self.nodes, self.devices_per_node, self.intra, self.inter, self.device, self.collectives)
        object.__setattr__(self, "_hash", hash((*fields, self.emulated, self.subgroups, self.tree)))
        for key in ("nodes", "devices_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CostModelError(f"cluster profile: field {key} must be a positive integer, got {value!r}")
        for kind in self.emulated:
            if kind not in EMULATIONS:
                raise CostModelError(
                    f"cluster profile: field emulated lists {kind!r}; only {sorted(EMULATIONS)} can be emulated"
                )
        if self.subgroups not in SUBGROUPS:
            raise CostModelError(f"cluster profile: field subgroups must be one of {SUBGROUPS}, got {self.subgroups!r}")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        """Pickle the fields only: the receiving process computes its own hash."""
        return _cluster, (self.name, self.nodes, self.devices_per_node, self.intra, self.inter, self.device,
                          self.collectives, self.emulated, self.subgroups, self.tree, self.sources)  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise CostModelError(f"rank {rank} does not fit cluster {self.name!r} of {self.world_size} devices")
        return rank // self.devices_per_node

    def crosses_nodes(self, group: Sequence[int]) -> bool:
        return len({self.node_of(r) for r in group}) > 1

    def link_for(self, group: Sequence[int], kind: str | None = None) -> Link:
        """The slowest link ``group`` crosses; for intra-node groups a calibrated fit if there is
        one: ``kind@p`` (fitted on groups of ``p`` ranks), else ``kind``, else ``intra``."""
        if self.crosses_nodes(group):
            return self.inter
        fits = dict(self.collectives)
        if kind is None:
            return self.intra
        return fits.get(f"{kind}@{len(group)}", fits.get(kind, self.intra))

    def fitted(self, ranks: Sequence[int]) -> Cluster:
        """This cluster with enough nodes to hold ``ranks`` (used for the default profile)."""
        need = max(ranks, default=0) // self.devices_per_node + 1
        return self if need <= self.nodes else _replace_nodes(self, need)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "intra": self.intra.to_dict(),
            "inter": self.inter.to_dict(),
            "device": self.device.to_dict(),
            "collectives": {k: v.to_dict() for k, v in self.collectives},
            "emulated": list(self.emulated),
            "subgroups": self.subgroups,
            "tree": self.tree,
            "sources": dict(self.sources),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        if not isinstance(data, Mapping):
            raise CostModelError("cluster profile must be a JSON object")
        for key in ("name", "nodes", "devices_per_node", "intra", "inter", "device"):
            if key not in data:
                raise CostModelError(f"cluster profile: missing field {key}")
        fits = data.get("collectives", {})
        return cls(
            name=str(data["name"]),
            nodes=data["nodes"],
            devices_per_node=data["devices_per_node"],
            intra=Link.from_dict(data["intra"], "intra"),
            inter=Link.from_dict(data["inter"], "inter"),
            device=Device.from_dict(data["device"]),
            collectives=tuple(sorted((k, Link.from_dict(v, f"collectives.{k}")) for k, v in fits.items())),
            emulated=tuple(data.get("emulated", ())),
            subgroups=str(data.get("subgroups", "native")),
            tree=bool(data.get("tree", True)),
            sources=tuple(sorted((str(k), str(v)) for k, v in data.get("sources", {}).items())),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    def __str__(self) -> str:
        return f"cluster {self.name}: {self.nodes} x {self.devices_per_node} devices"


def _cluster(*fields: Any) -> Cluster:
    return Cluster(*fields)


def _replace_nodes(cluster: Cluster, nodes: int) -> Cluster:
    import dataclasses

    return dataclasses.replace(cluster, nodes=nodes)


def load_cluster(path_or_name: str | Path) -> Cluster:
    """A cluster from a JSON file, or a shipped profile by name (``"h100-node"``, ``"cpu-gloo"``)."""
    if str(path_or_name) in PROFILES:
        return shipped_profile(str(path_or_name))
    path = Path(path_or_name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CostModelError(f"cluster profile {str(path)!r} not found; shipped: {sorted(PROFILES)}") from err
    except IsADirectoryError as err:
        raise CostModelError(f"cluster profile {str(path)!r} is a directory; give a JSON file or a shipped profile: {sorted(PROFILES)}") from err
    except UnicodeDecodeError as err:
        raise CostModelError(f"cluster profile {str(path)!r} is not a text (JSON) file: {err.reason} at byte {err.start}") from err
    except OSError as err:
        raise CostModelError(f"cluster profile {str(path)!r} cannot be read: {err.strerror or err}") from err
    except json.JSONDecodeError as err:
        raise CostModelError(f"cluster profile {str(path)!r} is not valid JSON: {err}") from err
    return Cluster.from_dict(data)


@cache
def shipped_profile(name: str) -> Cluster:
    if name not in PROFILES:
        raise CostModelError(f"no shipped cluster profile {name!r}; shipped: {sorted(PROFILES)}")
    text = resources.files("autopar.cost_model.profiles").joinpath(PROFILES[name]).read_text()
    return Cluster.from_dict(json.loads(text))


GPU_PROFILE, CPU_PROFILE, SHM_PROFILE = "h100-node", "cpu-gloo", "cpu-shm"


@dataclass(frozen=True, slots=True)
class ProfileChoice:
    """The shipped profile for the hardware in use, and why (the cost report prints it)."""

    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.name}, chosen from the hardware ({self.why}); Strategy(cluster=...) names another"


def _cuda_visible() -> bool:
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


@cache
def _hardware_has_gpu() -> bool:
    return _cuda_visible()


def hardware_profile(cuda: bool | None = None, shared_memory: bool | None = None) -> ProfileChoice:
    """The shipped profile for this machine: ``h100-node`` (the only shipped GPU profile) with a
    CUDA build of Paddle and a visible GPU; else the CPU runtime's collectives, calibrated:
    ``cpu-shm`` where a one-machine job talks through shared memory
    (:func:`autopar.host_comm.one_host_default`), ``cpu-gloo`` where it uses gloo.
    ``cuda`` / ``shared_memory`` override the detection (tests)."""
    gpu = _hardware_has_gpu() if cuda is None else cuda
    if gpu:
        return ProfileChoice(GPU_PROFILE, "a CUDA build of Paddle sees a GPU; the only shipped GPU profile")
    if shared_memory is None:
        shared_memory = one_host_default()
    if shared_memory:
        return ProfileChoice(SHM_PROFILE, "no GPU visible to Paddle: the ranks run on the CPU, one machine's through shared memory")
    return ProfileChoice(CPU_PROFILE, "no GPU visible to Paddle: the ranks run on the CPU with gloo")


def profile_origin(given: str | None, cuda: bool | None = None) -> str:
    """How a compile got its profile, for the cost report: named by ``Strategy(cluster=given)``,
    or chosen from the hardware."""
    if given:
        return f"{load_cluster(given).name}, from Strategy(cluster={given!r})"
    return str(hardware_profile(cuda))


def default_cluster(cuda: bool | None = None, shared_memory: bool | None = None) -> Cluster:
    """The profile used when none is given: the one for the hardware in use
    (:func:`hardware_profile`), one node of it (``fitted`` grows it to as many nodes as needed)."""
    return shipped_profile(hardware_profile(cuda, shared_memory).name)
