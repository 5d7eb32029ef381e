"""What Paddle's CPU kernels achieve inside training steps, per kernel (stage: calibration of
the CPU profiles; the compute side prices with it: :meth:`~autopar.cost_model.compute.OpCost.time`).
A tool beside ``tools/calibrate.py``, which runs it and writes the rates into the profile's
device; not part of the installed cost model (it runs Paddle's profiler on the test models).

A roofline prices an op by its FLOPs or its bytes at the device's best rates. On this CPU most
of a small model's step goes elsewhere: a ``gelu_grad`` computes its erf per element, a bias
gradient (``add_grad``) reduces with a slow kernel, a ``layer_norm_grad`` makes three passes —
each runs 10-50x below the streamed bandwidth, and a GPT block's step took 2-3x what the
roofline predicted. So the training steps of a few reference models (a GPT block with AdamW,
Llama with Adam, a ViT with momentum, an MLP-Mixer with SGD; sizes unlike the benchmarks') run
under Paddle's profiler, and each kernel's time over its calls gives

- ``seconds per element`` (of an op's largest operand) for every kernel but the products: the
  op then costs at least ``elements * rate`` (:meth:`Device.element_seconds
  <autopar.cost_model.cluster.Device.element_seconds>`);
- the matmul rate these programs' products achieve (``matmul`` and ``matmul_grad``: their FLOPs
  over their time), which small inner dims hold well below a square matmul's.

Each kernel's time is its profiled time less the fixed part every op event holds (the median
``full_int_array``: an op with no work), which ``Device.op_seconds`` prices already.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARMUP, PROFILED = 3, 5  # steps
PRODUCTS = ("matmul", "matmul_grad", "conv2d", "conv2d_grad", "depthwise_conv2d", "depthwise_conv2d_grad")
NO_WORK = "full_int_array"  # its profiled time is the fixed part of an op event
SHAPE_ONLY = ("shape", "shape64")  # they read an operand's shape, not its elements
MIN_ELEMENTS = 1 << 12  # a kernel whose calls average fewer elements: its time is its fixed cost


def reference_programs() -> list[tuple[str, Callable[[], Any], int]]:
    """(name, builder of a SeedProgram, label classes) of the models whose steps are profiled."""
    from autopar.testing.models import gpt_block_program
    from autopar.testing.zoo import llama, mixer, vit

    return [
        ("gpt block", lambda: gpt_block_program(batch=4, seq=64, hidden=96, heads=4, vocab=200, layers=2, optimizer="adamw", seed=3), 200),
        ("llama", lambda: llama.build(llama.Config(vocab_size=200, dim=96, n_layers=2, n_heads=4, n_kv_heads=2), batch=4, seq=64, optimizer="adam"), 200),
        ("vit", lambda: vit.build(vit.Config(img_size=32, patch_size=4, embed_dim=96, depth=2, num_heads=4), batch=8, optimizer="momentum"), 5),
        ("mixer", lambda: mixer.build(mixer.Config(img_size=32, patch_size=4, hidden_dim=96, tokens_mlp_dim=64, channels_mlp_dim=384), batch=8), 5),
    ]  # fmt: skip


def measure_kernel_rates(paddle: Any) -> tuple[dict[str, float], float]:
    """Seconds per element of each kernel (products excluded) and the products' FLOP/s, over
    the profiled steps of :func:`reference_programs`."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    elements: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    fixed: list[float] = []
    for _, build, classes in reference_programs():
        with paddle.utils.unique_name.guard():
            seed = build()
        for name, dur in _profiled_ops(paddle, seed, classes):
            seconds[name] += dur
            calls[name] += 1
            if name == NO_WORK:
                fixed.append(dur)
        for op in seed.main.global_block().ops:
            name, work = _work(op)
            elements[name] += PROFILED * work[0]
            flops[name] += PROFILED * work[1]
    base = statistics.median(fixed) if fixed else 0.0
    spent = {name: max(seconds[name] - calls[name] * base, 0.0) for name in seconds}
    rates = {
        name: spent[name] / elements[name]
        for name in spent
        if name not in (*PRODUCTS, *SHAPE_ONLY) and elements[name] >= calls[name] * MIN_ELEMENTS
    }  # fmt: skip
    products = [name for name in ("matmul", "matmul_grad") if spent.get(name)]
    matmul = sum(flops[n] for n in products) / sum(spent[n] for n in products) if products else 0.0
    return rates, matmul


def _profiled_ops(paddle: Any, seed: Any, classes: int) -> list[tuple[str, float]]:
    """(kernel, seconds) of every op event of ``PROFILED`` training steps (fetching the loss)."""
    import paddle.profiler as profiler

    from autopar.cost_model.compute import base_name
    from autopar.testing.serial import random_feeds

    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(seed.startup)
    feed = random_feeds(seed.feeds, 1, classes=classes)[0]
    for _ in range(WARMUP):
        exe.run(seed.main, feed=feed, fetch_list=[seed.loss])
    with tempfile.TemporaryDirectory() as out:
        prof = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=profiler.export_chrome_tracing(out))
        prof.start()
        for _ in range(PROFILED):
            exe.run(seed.main, feed=feed, fetch_list=[seed.loss])
            prof.step()
        prof.stop()
        traces = sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime)
        events = json.loads(Path(traces[-1]).read_text())["traceEvents"] if traces else []
    return [
        (base_name(e["name"].split("[", 1)[0]), e["dur"] * 1e-6)
        for e in events if e.get("cat") == "Operator" and e.get("name", "").startswith("pd_op.")
    ]  # fmt: skip


def _work(op: Any) -> tuple[str, tuple[float, float]]:
    """An op's kernel name and (elements of its largest operand, FLOPs if a product): what
    pricing counts them by."""
    from autopar.inspect.cost_report import program_op_cost

    cost, _ = program_op_cost(op)
    return cost.kernel, (cost.elements, cost.flops if cost.kernel in ("matmul", "matmul_grad") else 0.0)
