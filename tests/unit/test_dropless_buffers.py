"""Dropless dispatch buffers found from a program's shapes (autopar/dropless.py): a forward einsum
whose routing operand ``[.., S, E, C]`` sums the tokens away and keeps an expert and a capacity
dim, the capacity the size of the tokens; the router's top-k from the ``topk`` ops of its layer;
what an all_to_all of it says about its padding."""

import pytest

from autopar.dropless import dropless_buffers
from autopar.graph import ProgramGraph
from autopar.testing.models import _static

G, S, E, M = 2, 8, 4, 16


def _program(capacity: int, top_k: int | None):
    """A layer routing ``[G, S, M]`` tokens into ``[E, G, capacity, M]`` with GShard's dispatch
    einsum; its gate picks ``top_k`` experts with one ``topk`` (DeepSeek's way; None: no topk)."""
    paddle, main, startup = _static()

    class Dispatch(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.wg = paddle.nn.Linear(M, E)

        def forward(self, x):
            gates = paddle.nn.functional.softmax(self.wg(x), axis=-1)
            if top_k is not None:
                _, chosen = paddle.topk(gates, k=top_k, axis=-1)
                gates = gates + paddle.nn.functional.one_hot(chosen, E).sum(axis=2)
            mask = paddle.einsum("gse,gsc->gsec", gates, paddle.ones([G, S, capacity]))
            return paddle.einsum("gsec,gsm->egcm", mask, x)

    with paddle.static.program_guard(main, startup):
        Dispatch()(paddle.static.data("x", [G, S, M], "float32"))
    return ProgramGraph(main)


def test_a_worst_case_capacity_is_a_dropless_buffer_with_its_routers_top_k():
    (buffer,) = dropless_buffers(_program(capacity=S, top_k=2))
    assert (buffer.shape, buffer.capacity_dim, buffer.experts, buffer.tokens, buffer.top_k, buffer.hidden) == (
        (E, G, S, M), 2, E, G * S, 2, M
    )
    assert buffer.needed_share == pytest.approx(2 / E)
    padded = E * G * S * M * 4
    said = buffer.over_sending(padded)
    assert f"sends {padded} B per rank, the routed tokens need {padded // 2} B" in said
    assert f"tokens x top_k x hidden: {G * S} x 2 x {M}" in said and "2.0x" in said


def test_a_static_capacity_below_the_tokens_is_none():
    assert dropless_buffers(_program(capacity=S // 2, top_k=2)) == ()


def test_without_a_topk_the_routed_bytes_are_said_unknown():
    (buffer,) = dropless_buffers(_program(capacity=S, top_k=None))
    assert buffer.top_k is None and buffer.needed_share is None
    assert "the router's top-k is not found in the program" in buffer.over_sending(1024)
