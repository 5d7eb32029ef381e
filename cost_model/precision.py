"""The precision a program is priced in (stage: strategy search and cost report).

Nobody trains a large model in float32, and the search prices what it is given:

- **as built** (:data:`AS_BUILT`, the default): every value in its own dtype. A user's AMP
  program (``paddle.amp.decorate(..., level="O2", dtype="bfloat16")`` + ``auto_cast``,
  docs/paddle_amp.md) is priced as the bfloat16 program it is: its matmuls read bfloat16 operands
  and run at the device's bfloat16 rate, its activations and parameters take 2 bytes, its fp32
  masters (persistable ``<param>_fp32_master_0`` states) and optimizer states 4, and its
  collectives move the bytes of the dtype they carry. :func:`program_precision` says which.
- **stood for** (``Precision("bfloat16")``): a float32 program priced as the mixed-precision
  program it stands for — what a synthetic program at GPT scale needs (Paddle's CPU build cannot
  build an O2 AdamW program: docs/paddle_amp.md). Its float32 activations, feeds, parameters and
  gradients count in ``compute`` (matmuls at that rate, 2 bytes an element held and moved),
  each float32 parameter gains a float32 master placed like its optimizer states (ZeRO shards
  both), the optimizer's own states stay float32 and its update runs on the master (its ops
  priced as built). Megatron-LM's mixed precision: 2 + 2 + 4 + 8 bytes per parameter with Adam.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from autopar.cost_model.cluster import Cluster, dtype_bytes
from autopar.errors import CostModelError

LOW = ("bfloat16", "float16")
NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": None, "float32": None}
HELD = ("activation", "feed", "parameter")  # the value kinds a stood-for precision retypes (not optimizer states)


@dataclass(frozen=True, slots=True)
class Precision:
    """How a program's values are priced (see the module docstring): ``compute`` None prices
    each value in its own dtype; a low-precision dtype prices the program's float32 values of
    :data:`HELD` kinds in it, with a float32 ``master`` per float32 parameter."""

    compute: str | None = None
    master: str = "float32"

    def __post_init__(self) -> None:
        if self.compute is not None and self.compute not in LOW:
            raise CostModelError(f"precision: compute dtype must be one of {LOW} or None (as built), got {self.compute!r}")
        dtype_bytes(self.master)

    @classmethod
    def parse(cls, text: str | None) -> Precision:
        """``None`` / ``"fp32"`` / ``"float32"``: as built; ``"bf16"`` / ``"bfloat16"`` /
        ``"fp16"`` / ``"float16"``: a float32 program priced in that dtype."""
        if text is None:
            return AS_BUILT
        key = str(text).lower().removeprefix("paddle.")
        if key not in NAMES:
            raise CostModelError(f"precision: unknown {text!r}; expected one of {sorted(NAMES)} (or None: as built)")
        return cls(NAMES[key])

    @property
    def as_built(self) -> bool:
        return self.compute is None

    def dtype(self, dtype: str, kind: str) -> str:
        """The dtype a value of ``dtype`` and graph ``kind`` is priced in."""
        name = str(dtype).removeprefix("paddle.")
        if self.compute is not None and name == "float32" and kind in HELD:
            return self.compute
        return name

    def master_of(self, dtype: str) -> str | None:
        """The dtype of the master copy a parameter of ``dtype`` gains (None: none)."""
        if self.compute is not None and str(dtype).removeprefix("paddle.") == "float32":
            return self.master
        return None

    def ratio(self, dtype: str, kind: str = "activation") -> float:
        """Bytes priced per byte built, for a value of ``dtype`` and ``kind`` (0.5: float32 as bfloat16)."""
        return dtype_bytes(self.dtype(dtype, kind)) / dtype_bytes(dtype)

    def __str__(self) -> str:
        return "as built" if self.compute is None else f"{self.compute} (float32 program priced as mixed precision)"


AS_BUILT = Precision()


def program_precision(matmul_dtypes: Iterable[str], parameter_dtypes: Iterable[str], masters: int = 0) -> str:
    """In words, the precision a program computes in, read off its matmuls' operand dtypes,
    its parameters' dtypes and the fp32 master weights it holds: ``"bfloat16 (O2: parameters
    bfloat16, 4 fp32 master weights)"``, ``"bfloat16 (O1: parameters float32)"``, ``"float32"``."""
    low = sorted({str(d).removeprefix("paddle.") for d in matmul_dtypes} & set(LOW))
    if not low:
        return "float32"
    params = sorted({str(d).removeprefix("paddle.") for d in parameter_dtypes} & set(LOW))
    if not params:
        return f"{'/'.join(low)} (O1: parameters float32)"
    held = f", {masters} fp32 master weight{'s' if masters != 1 else ''}" if masters else ", no fp32 master weights"
    return f"{'/'.join(low)} (O2: parameters {'/'.join(params)}{held})"


def rescaled_time(kind: str, group: tuple[int, ...], nbytes: float, seconds: float, ratio: float, cluster: Cluster) -> float:
    """A planned collective's ``seconds`` (``kind`` over ``group`` moving ``nbytes``) were it to move
    ``ratio`` times the bytes (a float32 gradient's all_reduce priced as bfloat16's: 0.5): its
    planned time scaled by the alpha-beta formula's ratio at the two sizes (the latency steps
    stay, the bytes' share shrinks). A kind without a formula scales with its bytes."""
    if ratio == 1.0 or seconds <= 0.0:
        return seconds
    return seconds * _formula_ratio(str(kind), tuple(group), float(nbytes), ratio, cluster)


@lru_cache(maxsize=1 << 14)
def _formula_ratio(kind: str, group: tuple[int, ...], nbytes: float, ratio: float, cluster: Cluster) -> float:
    from autopar.cost_model.comm import COLLECTIVES, collective_time

    if kind not in COLLECTIVES or len(group) <= 1:
        return ratio
    before = collective_time(kind, group, nbytes, cluster)
    return collective_time(kind, group, nbytes * ratio, cluster) / before if before > 0 else ratio
