"""The fused ops Llama-style models are written with: swiglu, rms_norm,
fused_rms_norm_quant, fused_rotary_position_embedding, flash_attn, and their grads (stage:
propagate). Shown for x [B, S, H] and q / k / v [B, S, heads, D]:

    swiglu           abc,abc -> abc     (x, y): silu(x) * y, any split
                     ab1 -> ab1         (x, None): x holds both halves along its last dim
    rms_norm         ab1,1 -> ab1,ab    (x, scale -> out, invvar): normalized dims whole
    fused_rms_norm_quant  ab1,11,ab1,1,1 -> ab1,ab1,ab
                                        (x, bias, residual, norm_weight, norm_bias -> out,
                                        residual_out, inv_var); dims from begin_norm_axis
                                        whole; bias whole: the kernel adds its first row's
                                        worth of elements to every row (and ignores it
                                        without a residual), whatever its shape
    fused_rotary_position_embedding  bsh1,bsh1,bsh1,1s11,1s11 -> bsh1,bsh1,bsh1
                                        (q, k, v, sin, cos, position_ids): batch, sequence
                                        and heads split, head_dim whole. The kernel reads
                                        sin / cos at the local sequence index, so the
                                        sequence splits only with the tables split alike
                                        ([1, S, 1, D] tables); with position_ids
                                        (``bs,1111 -> ...``) it gathers whole tables by the
                                        ids, which split alike; without tables it is whole
    flash_attn       b1h1,b1h1,b1h1,1,bh11 -> b1h1,bh11,bh1,1
                                        (q, k, v, fixed_seed_offset, attn_mask -> out,
                                        softmax, softmax_lse, seed_offset): batch and heads
                                        split, sequences whole (a causal mask is aligned to
                                        the local query and key rows)
    *_grad           the forward letters; parameters' gradients (scale, norm_weight) are
                     pending sums over the mesh dims of the leading letters

A tensor that broadcasts along the batch or the heads (a [1, S, 1, D] sin table, a
[1, 1, S, S] mask) is whole there. Key / value heads are split with the query's only when
they are as many (grouped-query attention pairs query head i with key head i // group).
flash_attn with a training dropout draws its mask per rank over the local shape, which no
split can make equal to the serial run: it runs whole. None of these ops is linear in its
inputs (x complete); the grads are linear in the incoming gradients.

Paddle 3.3.1's CPU build has kernels for swiglu and fused_rms_norm_quant (forward only)
alone: rms_norm, fused_rotary_position_embedding and flash_attn do not build on CPU (and
``paddle.nn.functional.flash_attention`` falls back to matmul + softmax there). Their rules
serve GPU programs; they are checked numerically against numpy references of the kernels
(``tests/property/test_rules_fused.py``). Their operand orders are the PHI signatures
Paddle's own SPMD rules for these ops take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.dist_attr import DistAttr
from autopar.spmd.base import RuleContext, RuleResult, SpmdRule, TensorSpec, einsum_backward, einsum_forward
from autopar.spmd.equations import EinsumRule, EquationGradRule
from autopar.spmd.letters import broadcast_letters, equation
from autopar.spmd.operands import letters, spread
from autopar.spmd.registry import declare, register, register_rule

Names = Sequence[str | None]


def solve(
    names: Names, outs: Names, inputs: Sequence[TensorSpec | None], ctx: RuleContext, *,
    outputs: Sequence[TensorSpec | None] | None = None,
) -> RuleResult:  # fmt: skip
    """The equation over the present operands (absent ones, or ``names[i]`` None, stay None /
    whole); ``outs[j]`` None: an absent result, which an equation string cannot state (the
    forward ops below whose results come and go use this instead of an EinsumRule). With
    ``outputs`` the backward inference."""
    kept = [i for i, s in enumerate(inputs) if s is not None and names[i] is not None]
    made = [j for j, o in enumerate(outs) if o is not None]
    eq = equation([names[i] for i in kept], [outs[j] for j in made])
    specs = [inputs[i] for i in kept]
    if outputs is not None:
        result = einsum_backward(eq, specs, [outputs[j] for j in made], ctx)
    else:
        result = einsum_forward(eq, specs, ctx)
    produced = dict(zip(made, result.outputs))
    return dataclasses.replace(spread(result, kept, inputs, ctx), outputs=tuple(produced.get(j) for j in range(len(outs))))


def _like(spec: TensorSpec | None, of: TensorSpec, names: str) -> str | None:
    """Letters of ``spec`` broadcasting against ``of`` (letters ``names``): a dim of equal size
    keeps the letter, any other is whole."""
    if spec is None:
        return None
    offset = of.ndim - spec.ndim
    if offset < 0:
        return "1" * spec.ndim
    return "".join(
        names[offset + i] if size == of.shape[offset + i] and size > 1 else "1" for i, size in enumerate(spec.shape)
    )  # fmt: skip


# ---- swiglu -----------------------------------------------------------------------------


def _swiglu_letters(inputs: Sequence[TensorSpec | None]) -> tuple[list[str | None], str]:
    x, y = inputs[0], inputs[1]
    if y is None:  # out = silu(x[..., :n]) * x[..., n:]
        names = letters(x.ndim, whole=[x.ndim - 1] if x.ndim else [])
        return [names, None], names
    (xs, ys), out = broadcast_letters([x.shape, y.shape])
    return [xs, ys], out


def _swiglu(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(x, y) -> out``: ``abc,abc -> abc``; ``(x, None)``: ``ab1 -> ab1``."""
    names, out = _swiglu_letters(inputs)
    return equation([n for n in names if n is not None], [out])


def _swiglu_grad_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> list[str | None]:
    """``(x, y, out_grad) -> (x_grad, y_grad)``."""
    names, out = _swiglu_letters(inputs)
    return [*names, out]


register_rule(EinsumRule(_swiglu), "swiglu")
register_rule(EquationGradRule(_swiglu_grad_letters, grad=2, results=(0, 1), shape_only=()), "swiglu_grad")


# ---- rms_norm ---------------------------------------------------------------------------


def _norm_letters(x: TensorSpec, begin: int) -> tuple[str, str]:
    """x's letters (dims from ``begin`` whole) and the statistics' (the leading dims)."""
    begin = min(max(begin, 0), x.ndim)
    return letters(x.ndim, whole=range(begin, x.ndim)), letters(begin)


def _rms_norm_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """rms_norm's x, statistics and scale letters: ``normalized_shape`` gives the trailing
    dims normalized together (the last one when absent)."""
    x, scale = inputs[0], inputs[1]
    normalized = attrs.get("normalized_shape")
    count = len(normalized) if isinstance(normalized, (list, tuple)) and normalized else 1
    names, lead = _norm_letters(x, x.ndim - count)
    return names, lead, None if scale is None else "1" * scale.ndim


def _rms_norm(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> str:
    """``(x, scale) -> (out, invvar)``: ``ab1,1 -> ab1,ab``."""
    x, lead, scale = _rms_norm_letters(inputs, attrs)
    return equation([x] + ([scale] if scale is not None else []), [x, lead])


def _rms_norm_grad_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> list[str | None]:
    """``(x, scale, invvar, out_grad) -> (x_grad, scale_grad)``."""
    x, lead, scale = _rms_norm_letters(inputs, attrs)
    return [x, scale, lead, x]


register_rule(EinsumRule(_rms_norm), "rms_norm")
register_rule(EquationGradRule(_rms_norm_grad_letters, grad=3, results=(0, 1), shape_only=()), "rms_norm_grad")


def _fused_rms_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> tuple[list[str | None], str, str]:
    """fused_rms_norm_quant's operand letters, x's and the statistics'."""
    x = inputs[0]
    names, lead = _norm_letters(x, int(attrs.get("begin_norm_axis", x.ndim - 1)) % max(x.ndim, 1))
    residual = _like(inputs[2], x, names)
    whole = [None if s is None else "1" * s.ndim for s in (inputs[1], *inputs[3:5])]  # bias: one row's worth, read by every row
    return [names, whole[0], residual, *whole[1:]], names, lead


@register("fused_rms_norm_quant")
class FusedRmsNormQuantRule(SpmdRule):
    """``(x, bias, residual, norm_weight, norm_bias) -> (out, residual_out, inv_var)``
    (``paddle.incubate.nn.functional.fused_rms_norm``); residual_out only with a residual
    (not data: an absent result)."""

    def infer_forward(self, inputs, attrs, ctx):
        names, x, lead = _fused_rms_letters(inputs, attrs)
        return solve(names, [x, x if inputs[2] is not None else None, lead], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names, x, lead = _fused_rms_letters(inputs, attrs)
        return solve(names, [x, x if inputs[2] is not None else None, lead], inputs, ctx, outputs=outputs)


# ---- rotary position embedding ----------------------------------------------------------


def _rope_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], first: int) -> list[str | None]:
    """Letters of (q, k, v, sin, cos, position_ids) — or of a grad's (sin, cos, position_ids,
    out_q_grad, ...) with ``first`` the position of q's (see the module docstring)."""
    q = inputs[first]
    sin, cos, position = inputs[3 - first], inputs[4 - first], inputs[5 - first]
    batch, seq = (1, 0) if attrs.get("time_major", False) else (0, 1)
    by_ids = position is not None and position.ndim == 2 and tuple(position.shape) == (q.shape[batch], q.shape[seq])
    rows = sin is not None and sin.ndim == q.ndim and sin.shape[seq] == q.shape[seq]
    split_seq = by_ids or (position is None and rows)
    names = "".join({batch: "b", seq: "s" if split_seq else "1", 2: "h"}.get(d, "1") for d in range(q.ndim))
    if position is not None:  # the tables are gathered by position id: whole
        tables = [None if t is None else "1" * t.ndim for t in (sin, cos)]
        ids = "bs" if by_ids else "1" * position.ndim
    else:
        tables = [None if t is None else (_like(t, q, names) if t.ndim == q.ndim else "1" * t.ndim) for t in (sin, cos)]
        ids = None
    heads = [None if t is None else (names if t.ndim == q.ndim else "1" * t.ndim) for t in inputs[first : first + 3]]
    return [*heads, *tables, ids] if first == 0 else [*tables, ids, *heads]


@register("fused_rotary_position_embedding")
class FusedRopeRule(SpmdRule):
    """``(q, k, v, sin, cos, position_ids) -> (out_q, out_k, out_v)`` (not data: out_k / out_v
    are absent without k / v)."""

    def infer_forward(self, inputs, attrs, ctx):
        names = _rope_letters(inputs, attrs, 0)
        return solve(names, names[:3], inputs, ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names = _rope_letters(inputs, attrs, 0)
        return solve(names, names[:3], inputs, ctx, outputs=outputs)


def _rope_grad_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> list[str | None]:
    """``(sin, cos, position_ids, out_q_grad, out_k_grad, out_v_grad) -> (q_grad, k_grad, v_grad)``."""
    return _rope_letters(inputs, attrs, 3)


register_rule(
    EquationGradRule(_rope_grad_letters, grad=(3, 4, 5), results=(3, 4, 5), shape_only=()), "fused_rotary_position_embedding_grad"
)


# ---- flash attention --------------------------------------------------------------------


def _attention_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any], mask: int) -> tuple[str, str, str, str]:
    """q's letters, k's and v's, attn_mask's (at ``mask``) and the per-(batch, head) letters
    of softmax_lse; everything whole under a training dropout."""
    q, k = inputs[0], inputs[1]
    if float(attrs.get("dropout", 0.0)) > 0 and not attrs.get("is_test", False):
        return "1" * q.ndim, "1" * k.ndim, "1" * (inputs[mask].ndim if inputs[mask] is not None else 0), "11"
    heads = "h" if k.shape[2] == q.shape[2] else "1"
    query = "b1" + heads + "1"
    keys = "b1" + heads + "1"
    masked = inputs[mask]
    mask_names = "" if masked is None else _like(masked, TensorSpec((q.shape[0], q.shape[2], q.shape[1], k.shape[1])), "b" + heads + "11")
    return query, keys, mask_names, "b" + heads


@register("flash_attn")
class FlashAttnRule(SpmdRule):
    """``(q, k, v, fixed_seed_offset, attn_mask) -> (out, softmax, softmax_lse, seed_offset)``
    (not data: the seed / offset result is whole whatever the batch split)."""

    def _names(self, inputs, attrs) -> tuple[list[str | None], list[str]]:
        query, keys, mask, bh = _attention_letters(inputs, attrs, 4)
        seed = None if inputs[3] is None else "1" * inputs[3].ndim
        return [query, keys, keys, seed, mask or None], [query, bh + "11", bh + "1", None]

    def infer_forward(self, inputs, attrs, ctx):
        names, outs = self._names(inputs, attrs)
        return _with_seed(solve(names, outs, inputs, ctx), ctx)

    def infer_backward(self, inputs, outputs, attrs, ctx):
        names, outs = self._names(inputs, attrs)
        return _with_seed(solve(names, outs, inputs, ctx, outputs=outputs), ctx)


def _with_seed(result: RuleResult, ctx: RuleContext) -> RuleResult:
    """The seed / offset pair every rank draws alike: whole (not a pending sum of the batch)."""
    return dataclasses.replace(result, outputs=(*result.outputs[:3], DistAttr.replicated(ctx.mesh, 1)))


def _flash_attn_grad_letters(inputs: Sequence[TensorSpec | None], attrs: Mapping[str, Any]) -> list[str | None]:
    """``(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad) -> (q_grad, k_grad, v_grad)``."""
    query, keys, mask, bh = _attention_letters(inputs, attrs, 6)
    seed = None if inputs[5] is None else "1" * inputs[5].ndim
    return [query, keys, keys, query, bh + "1", seed, mask or None, query]


register_rule(EquationGradRule(_flash_attn_grad_letters, grad=7, results=(0, 1, 2), shape_only=()), "flash_attn_grad")

# what other stages know of these ops (autopar.spmd.registry.TRAIT_MEANINGS)
declare("flash_attn", "fused_rotary_position_embedding", "swiglu", keeps_split=True)
declare("rms_norm", normalizing=True, sequence_local=True)
