"""Programs written the way users write them, with the ops that broke the host runtime
before (RNNs, ``paddle.to_tensor`` constants, collectives reading feeds). Shared by the
simulator tests and the multi-process backend-agreement test."""

from __future__ import annotations

from typing import Any

import numpy as np


def build(case: str, train: bool = True) -> tuple[Any, Any, dict[str, Any], Any, list[tuple[Any, list]]]:
    """main, startup, feeds (name -> Value), loss, annotations [(value, dims_mapping on mesh ("d",))]."""
    import paddle

    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 5
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [4, 6], "float32")
        feeds = {"x": x}
        if case in ("gru", "lstm"):
            seq = paddle.static.data("seq", [4, 5, 6], "float32")
            feeds["seq"] = seq
            rnn = paddle.nn.GRU(6, 8) if case == "gru" else paddle.nn.LSTM(6, 8)
            y, _ = rnn(seq)
            head = paddle.nn.Linear(6, 8)
            loss = paddle.mean(y * 0.1) + paddle.mean(head(x))
            annotations = [(x, ["d", None]), (seq, ["d", None, None])]
        elif case == "constant":  # a to_tensor constant read after the row-parallel all-reduce
            layer = paddle.nn.Linear(6, 8)
            weights = paddle.to_tensor(np.linspace(-1, 1, 8).astype("float32"))
            loss = paddle.mean(layer(x) * weights)
            annotations = [(layer.weight, ["d", None])]
        elif case == "feed_collective":  # softmax over a split feed axis: the feed itself is gathered
            layer = paddle.nn.Linear(6, 6)
            loss = paddle.mean(layer(paddle.nn.functional.softmax(x, axis=1)))
            annotations = [(x, [None, "d"])]
        else:
            raise ValueError(f"unknown case {case!r}")
        if train:
            paddle.optimizer.SGD(0.1).minimize(loss)
    return main, startup, feeds, loss, annotations


def feeds_for(feeds: dict[str, Any], steps: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{name: rng.standard_normal(list(v.shape)).astype("float32") for name, v in feeds.items()} for _ in range(steps)]
