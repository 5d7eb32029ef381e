"""Context parallelism priced side by side: the ring, Ulysses' all_to_all and the all-gather-KV
plan for one attention layer, from formulas (stage: strategy search and the guide's figures,
docs/context_parallel.md; issue 39).

The sequence of ``S`` tokens is split over ``cp`` ranks of one group; each rank holds ``S / cp``
tokens of q, k, v (``[B, S/cp, H, d]``, k and v with ``H_kv`` heads: grouped-query attention).
A *K/V block* is one rank's k and v: ``2 B (S/cp) H_kv d`` elements. Per method, one layer:

============  ==============================================  =====================================
method        forward / backward collectives (per rank)       attention activations per rank
============  ==============================================  =====================================
ring          ``cp - 1`` shifts of the K/V block (permute);   q, k, v, out of ``S/cp`` tokens and the
              backward ``cp - 1`` K/V shifts with the dK/dV   log-sum-exp ``[B, H, S/cp]`` (fp32)
              travelling beside them and one more dK/dV       saved; one block's scores
              shift home: ``cp`` dK/dV shifts                 ``[B, H, S/cp, S/cp]`` at a time
all_to_all    q, k, v to head-split and the output back:      q, k, v of ``H/cp`` heads over the whole
(Ulysses)     4 all_to_alls; backward 4 (dout in, dq, dk,     sequence and the probabilities
              dv back); each sends ``(cp-1)/cp`` of the       ``[B, H/cp, S, S]`` saved
              rank's piece: ~ 4 x activations / cp
all_gather    k, v gathered whole (2 all_gathers); backward   q, k, v whole gathered, probabilities
              dK, dV reduce-scattered (2 reduce_scatters)     ``[B, H, S/cp, S]`` saved
============  ==============================================  =====================================

**Overlap bound (the ring).** Each shift carries the block the next step computes with, so it
runs behind the current step's block of attention: a step costs ``max(compute of the block,
the shift)``, and only the last step's compute (forward) or the last dK/dV shift home
(backward) stands alone. Ulysses' and the all-gather plan's collectives sit on the critical
path (the core waits for its inputs): priced whole, added to the compute.

**Compute** is the attention core priced by the compute cost model (:func:`op_cost`: matmul,
scale, mask add, softmax and their grads, on the device's batched-matmul rate, in ``dtype``:
the program's precision, ``bfloat16`` for a mixed-precision model), each op with the device's
fixed cost. The ring's backward recomputes each block's probabilities from the saved
log-sum-exp (the scores matmul and the exponent again: flash attention's backward); the chain
methods keep the probabilities. A causal mask: autopar's ring lowering
(``passes/ring_attention.py``) computes every block (a fully masked one adds 0), as the chain
methods compute the masked scores in full (the mask is added); ``skip_masked=True`` prices a
ring that skips the blocks wholly above the diagonal and halves the diagonal ones (the ring
implementations of Megatron-Core and ring-flash-attention) — without balance the last rank then
computes ``cp - 1/2`` blocks, zig-zag (rank ``i`` holds chunks ``i`` and ``2cp-1-i``) gives every
rank half a block each step.

**Memory** is the attention core's: what it keeps for the backward (``saved``) and the largest
buffer it makes beside them at once (``working``: the scores before softmax; the ring's one
block of scores and the K/V block arriving while one is used). The ring's ``saved`` is exactly
``1/cp`` of its own ``cp = 1`` figure, and below ``1/cp`` of the serial chain's (whose
``[B, H, S, S]`` probabilities it never holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost_model.cluster import Cluster, dtype_bytes
from autopar.cost_model.comm import collective_time
from autopar.cost_model.compute import op_cost_or_traffic
from autopar.errors import CostModelError

METHODS = ("ring", "all_to_all", "all_gather")  # (Strategy's ContextParallel.method names)
BALANCES = (None, "zigzag")
LSE_DTYPE = "float32"  # the ring's saved log-sum-exp (flash attention keeps it in float32)


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One attention layer's core: ``batch`` x ``seq`` tokens, ``heads`` query heads of
    ``head_dim``, ``kv_heads`` key / value heads (None: as many as ``heads``), computed in
    ``dtype``; ``causal``: a causal mask."""

    batch: int
    seq: int
    heads: int
    head_dim: int
    kv_heads: int | None = None
    dtype: str = "bfloat16"
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"AttentionShape.{name} must be a positive integer, got {value!r}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise CostModelError(f"AttentionShape.kv_heads={self.kv_heads} must divide heads={self.heads}")
        dtype_bytes(self.dtype)

    @property
    def kv(self) -> int:
        """Key / value heads."""
        return self.kv_heads or self.heads

    def elements(self, tokens: int, heads: int) -> int:
        """Elements of a ``[batch, tokens, heads, head_dim]`` tensor."""
        return self.batch * tokens * heads * self.head_dim


@dataclass(frozen=True, slots=True)
class AttentionPrice:
    """One attention layer's core on the busiest rank of a ``cp`` group (see the module
    docstring): seconds, bytes one rank sends, collectives, attention activation bytes."""

    method: str
    cp: int
    balance: str | None
    forward: float  # seconds of the core with its collectives (the ring: max(compute, shift) per step)
    backward: float
    forward_compute: float  # seconds of the attention compute alone
    backward_compute: float
    forward_comm: float  # seconds of the collectives alone (run behind compute or not)
    backward_comm: float
    forward_sent: int  # bytes one rank sends
    backward_sent: int
    collectives: int  # forward + backward
    saved: int  # attention activation bytes per rank kept for the backward
    working: int  # bytes made beside them at once (scores; the ring's block in flight)

    @property
    def seconds(self) -> float:
        """Forward + backward of the layer's core."""
        return self.forward + self.backward

    @property
    def compute(self) -> float:
        return self.forward_compute + self.backward_compute

    @property
    def comm(self) -> float:
        return self.forward_comm + self.backward_comm

    @property
    def exposed(self) -> float:
        """Communication seconds not run behind compute."""
        return self.seconds - self.compute

    @property
    def sent(self) -> int:
        return self.forward_sent + self.backward_sent

    @property
    def memory(self) -> int:
        return self.saved + self.working


def price_attention(
    shape: AttentionShape, cp: int, method: str, cluster: Cluster, balance: str | None = None, group: Sequence[int] | None = None,
    skip_masked: bool = False,
) -> AttentionPrice:  # fmt: skip
    """One attention layer's core under context parallelism ``method`` over ``cp`` ranks
    (``group``: their ranks, default ``0 .. cp-1``, for the link they cross) on ``cluster``;
    ``skip_masked``: a ring that skips the blocks a causal mask hides (module docstring;
    default: every block computed, as autopar's lowering does)."""
    if method not in METHODS:
        raise CostModelError(f"context parallelism: method must be one of {METHODS}, got {method!r}")
    if balance not in BALANCES:
        raise CostModelError(f"context parallelism: balance must be one of {BALANCES}, got {balance!r}")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise CostModelError(f"context parallelism: cp must be a positive integer, got {cp!r}")
    chunks = 2 * cp if balance else cp
    if shape.seq % chunks:
        raise CostModelError(
            f"context parallelism: a sequence of {shape.seq} tokens does not split into {chunks} equal chunks "
            f"(cp={cp}{', zig-zag: two chunks per rank' if balance else ''})"
        )
    group = tuple(range(cp)) if group is None else tuple(group)
    if len(group) != cp:
        raise CostModelError(f"context parallelism: group {list(group)} has {len(group)} ranks, cp is {cp}")
    if method == "ring":
        return _ring(shape, cp, balance, cluster, group, skip_masked)
    return dict(_PRICERS)[method](shape, cp, balance, cluster, group)


def serial_attention(shape: AttentionShape, cluster: Cluster) -> AttentionPrice:
    """The attention core as a program writes it (matmul, scale, mask, softmax, matmul) on one
    device: the reference every method's memory is read against."""
    forward, backward = _chain_seconds(shape, shape.heads, shape.seq, shape.seq, cluster)
    saved, working = _chain_memory(shape, shape.heads, shape.seq, shape.seq, shape.seq)
    return AttentionPrice("serial", 1, None, forward, backward, forward, backward, 0.0, 0.0, 0, 0, 0, saved, working)


def compare(shape: AttentionShape, cp: int, cluster: Cluster, balance: str | None = None) -> dict[str, AttentionPrice]:
    """Every method's price for ``shape`` over ``cp`` ranks (Ulysses left out where ``cp`` does
    not divide the heads), the serial core's (key ``"serial"``) and, under a causal mask, a ring
    skipping the masked blocks with ``balance`` (key ``"ring, masked blocks skipped"``)."""
    out = {"serial": serial_attention(shape, cluster)}
    for method in METHODS:
        try:
            out[method] = price_attention(shape, cp, method, cluster)
        except CostModelError:
            if shape.heads % cp == 0:
                raise
    if shape.causal:
        out[SKIPPING] = price_attention(shape, cp, "ring", cluster, balance, skip_masked=True)
    return out


SKIPPING = "ring, masked blocks skipped"


# ---- the ring -------------------------------------------------------------------------------
def block_work(rank: int, source: int, cp: int, causal: bool, balance: str | None) -> float:
    """The share of a full ``(S/cp) x (S/cp)`` block of scores ``rank``'s queries compute against
    the K/V block ``source`` holds: 1 without a mask; causal, 1 below the diagonal, 1/2 on it,
    0 above; zig-zag (chunks ``i`` and ``2cp-1-i`` per rank, each a quarter of a block against
    another chunk) the sum over the four chunk pairs."""
    if not causal:
        return 1.0
    if balance is None:
        return 1.0 if source < rank else 0.5 if source == rank else 0.0
    mine, theirs = (rank, 2 * cp - 1 - rank), (source, 2 * cp - 1 - source)
    return sum(0.25 if k < q else 0.125 if k == q else 0.0 for q in mine for k in theirs)


def ring_steps(cp: int, causal: bool, balance: str | None) -> list[float]:
    """The busiest rank's block work at each of the ring's ``cp`` steps (step ``s``: rank ``r``
    holds the K/V block of rank ``(r - s) mod cp``; the ranks step together, so a step lasts as
    long as its busiest rank's block)."""
    return [max(block_work(r, (r - s) % cp, cp, causal, balance) for r in range(cp)) for s in range(cp)]


def _ring(
    shape: AttentionShape, cp: int, balance: str | None, cluster: Cluster, group: tuple[int, ...], skip_masked: bool = False
) -> AttentionPrice:  # fmt: skip
    tokens = shape.seq // cp
    size = dtype_bytes(shape.dtype)
    kv_block = 2 * shape.elements(tokens, shape.kv) * size  # k and v of one rank
    block_fwd, block_bwd = _block_seconds(shape, tokens, cluster)
    steps = ring_steps(cp, shape.causal and skip_masked, balance)
    shift = collective_time("permute", group, kv_block, cluster)  # k and v: one message
    shift_back = collective_time("permute", group, 2 * kv_block, cluster)  # k, v with dk, dv beside them
    home = collective_time("permute", group, kv_block, cluster)  # the last dk, dv shift home
    fwd_compute = sum(w * block_fwd for w in steps)
    bwd_compute = sum(w * block_bwd for w in steps)
    forward = sum(max(w * block_fwd, shift) for w in steps[:-1]) + steps[-1] * block_fwd
    backward = sum(max(w * block_bwd, shift_back) for w in steps[:-1]) + steps[-1] * block_bwd + (home if cp > 1 else 0.0)
    shifts = cp - 1
    fwd_sent, bwd_sent = shifts * kv_block, shifts * kv_block + cp * kv_block if cp > 1 else 0
    lse = shape.batch * shape.heads * tokens * dtype_bytes(LSE_DTYPE)
    saved = (2 * shape.elements(tokens, shape.heads) + 2 * shape.elements(tokens, shape.kv)) * size + lse  # q, out, k, v
    working = shape.batch * shape.heads * tokens * tokens * size + (kv_block if cp > 1 else 0)
    collectives = shifts + (shifts + 1 if cp > 1 else 0)
    return AttentionPrice("ring", cp, balance, forward, backward, fwd_compute, bwd_compute, shifts * shift,
                          shifts * shift_back + (home if cp > 1 else 0.0), fwd_sent, bwd_sent, collectives, saved, working)  # fmt: skip


def _block_seconds(shape: AttentionShape, tokens: int, cluster: Cluster) -> tuple[float, float]:
    """One full block's forward (scores, scale, mask, online softmax, times v) and backward (the
    probabilities recomputed from the log-sum-exp, then both products' gradients and the softmax's)."""
    b, h, d = shape.batch, shape.heads, shape.head_dim
    q, kv, scores = [b, h, tokens, d], [b, h, tokens, d], [b, h, tokens, tokens]
    forward = _ops(cluster, shape.dtype, *_core_ops(q, kv, scores, shape.causal))
    recompute = _ops(cluster, shape.dtype, ("matmul", [q, kv], [scores], True), ("exp", [scores], [scores], False))
    grads = _ops(cluster, shape.dtype, ("matmul_grad", [scores, kv, q], [scores, kv], False),
                 ("softmax_grad", [scores, scores], [scores], False), ("scale_grad", [scores], [scores], False),
                 ("matmul_grad", [q, kv, scores], [q, kv], True))  # fmt: skip
    return forward, recompute + grads


# ---- the chain methods (Ulysses, all_gather) -------------------------------------------------
def _ulysses(shape: AttentionShape, cp: int, balance: str | None, cluster: Cluster, group: tuple[int, ...]) -> AttentionPrice:
    if shape.heads % cp:
        raise CostModelError(f"context parallelism all_to_all (Ulysses): {shape.heads} heads do not split over cp={cp} ranks")
    kv_heads = shape.kv if shape.kv % cp == 0 else shape.heads  # (k, v repeated to every head where their heads do not split)
    size, tokens = dtype_bytes(shape.dtype), shape.seq // cp
    pieces = [shape.elements(tokens, n) * size for n in (shape.heads, kv_heads, kv_heads, shape.heads)]  # q, k, v, out
    moved = [collective_time("all_to_all", group, n, cluster) for n in pieces]
    sent = sum(n * (cp - 1) // cp for n in pieces)
    heads = shape.heads // cp
    fwd, bwd = _chain_seconds(shape, heads, shape.seq, shape.seq, cluster)
    saved, working = _chain_memory(shape, heads, shape.seq, shape.seq, shape.seq, kv_heads // cp)
    comm = sum(moved) if cp > 1 else 0.0
    count = 8 if cp > 1 else 0
    return AttentionPrice("all_to_all", cp, None, fwd + comm, bwd + comm, fwd, bwd, comm, comm, sent, sent, count, saved, working)


def _gathered(shape: AttentionShape, cp: int, balance: str | None, cluster: Cluster, group: tuple[int, ...]) -> AttentionPrice:
    size, tokens = dtype_bytes(shape.dtype), shape.seq // cp
    whole = shape.elements(shape.seq, shape.kv) * size  # k (or v) gathered
    gather = collective_time("all_gather", group, whole, cluster)
    scatter = collective_time("reduce_scatter", group, whole, cluster)
    sent = 2 * (whole * (cp - 1) // cp)
    fwd, bwd = _chain_seconds(shape, shape.heads, tokens, shape.seq, cluster)
    saved, working = _chain_memory(shape, shape.heads, tokens, shape.seq, tokens)
    count = 4 if cp > 1 else 0
    return AttentionPrice("all_gather", cp, None, fwd + 2 * gather, bwd + 2 * scatter, fwd, bwd, 2 * gather, 2 * scatter,
                          sent, sent, count, saved, working)  # fmt: skip


def _chain_seconds(shape: AttentionShape, heads: int, queries: int, keys: int, cluster: Cluster) -> tuple[float, float]:
    """The matmul -> scale -> mask -> softmax -> matmul chain for ``heads`` heads of ``queries``
    queries against ``keys`` keys (the mask computed in full: it is added), and its backward."""
    b, d = shape.batch, shape.head_dim
    q, kv, scores = [b, heads, queries, d], [b, heads, keys, d], [b, heads, queries, keys]
    forward = _ops(cluster, shape.dtype, *_core_ops(q, kv, scores, shape.causal))
    backward = _ops(cluster, shape.dtype, ("matmul_grad", [scores, kv, q], [scores, kv], False),
                    ("softmax_grad", [scores, scores], [scores], False), ("scale_grad", [scores], [scores], False),
                    ("matmul_grad", [q, kv, scores], [q, kv], True))  # fmt: skip
    return forward, backward


def _chain_memory(shape: AttentionShape, heads: int, queries: int, keys: int, q_tokens: int, kv_heads: int | None = None) -> tuple[int, int]:
    """The chain's saved q (``q_tokens``), k and v (``keys`` tokens), probabilities
    ``[B, heads, queries, keys]``; its working buffer: the scores before softmax."""
    size = dtype_bytes(shape.dtype)
    kv_heads = shape.kv if kv_heads is None else kv_heads
    scores = shape.batch * heads * queries * keys * size
    saved = (shape.elements(q_tokens, heads) + 2 * shape.elements(keys, kv_heads)) * size + scores
    return saved, scores


def _core_ops(q: list[int], kv: list[int], scores: list[int], causal: bool) -> list[tuple]:
    ops = [("matmul", [q, kv], [scores], True), ("scale", [scores], [scores], False)]
    if causal:
        ops.append(("add", [scores, scores[-2:]], [scores], False))
    return ops + [("softmax", [scores], [scores], False), ("matmul", [scores, kv], [q], False)]


def _ops(cluster: Cluster, dtype: str, *ops: tuple) -> float:
    """Seconds of ``ops`` (name, inputs, outputs, transpose_y) on ``cluster``'s device in
    ``dtype``, each with the device's fixed cost per op."""
    total = 0.0
    for name, inputs, outputs, transpose_y in ops:
        cost, _ = op_cost_or_traffic(name, inputs, outputs, {"transpose_y": transpose_y}, dtype)
        total += cost.time(cluster, dtype) + cluster.device.op_seconds
    return total


_PRICERS = (("all_to_all", _ulysses), ("all_gather", _gathered))  # (the ring: _ring, with its skip_masked)
