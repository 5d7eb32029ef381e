"""The zoo x every strategy: does each compile, run, and equal serial — and at what cost.

For each model of ``autopar.testing.zoo`` (Llama-, GPT-2-, BERT-style decoders / encoders, a
ViT, an MLP-Mixer, annotated as Paddle users annotate them) and each strategy of
``tests/equivalence/test_zoo.py``, printed: compiled / ran; the largest loss and parameter
difference from serial after 3 SGD steps in the simulator; the rounding floor (serial against
serial on a row-permuted batch: fp32 sums in another order); compile and simulate seconds; ops
without an SPMD rule; rank 0's collectives per step and the bytes it sends over them (ring
algorithm; a pipeline's F / B ones run once per micro-batch), against the data-parallel optimum where one is defined (dp, ZeRO: a ring
all_reduce of every gradient; ZeRO's reduce_scatter + all_gather send what it sends).

    .venv/bin/python benchmarks/bench_zoo.py [model ...]
"""

from __future__ import annotations

import sys
import time
import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

import autopar  # noqa: E402
from autopar.cost_model.comm import coefficients  # noqa: E402
from autopar.testing.serial import random_feeds, run_serial  # noqa: E402
from autopar.testing.zoo import bert, gpt2, llama, mixer, vit  # noqa: E402

sys.path.insert(0, "tests/equivalence")
from test_zoo import STRATEGIES  # noqa: E402

MODELS = {
    "llama": (llama, lambda n: llama.Config(n_layers=n), None, 64),
    "gpt2": (gpt2, lambda n: gpt2.Config(n_layer=n), gpt2.feeds, 64),
    "bert": (bert, lambda n: bert.Config(num_hidden_layers=n), bert.feeds, 2),
    "vit": (vit, lambda n: vit.Config(depth=n), None, 5),
    "mixer": (mixer, lambda n: mixer.Config(num_blocks=n), None, 5),
}
DATA_PARALLEL = {"dp", "zero-1", "zero-2", "zero-3"}


def _feeds(seed, config, feeds_of, classes, steps=3):
    return feeds_of(config, 4, 8, steps) if feeds_of is not None else random_feeds(seed.feeds, steps, classes=classes)


def _floor(seed, feeds) -> float:
    """Serial vs serial on the same batches with their rows permuted (fp32 in another order)."""
    first = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    order = np.random.default_rng(1).permutation(next(iter(feeds[0].values())).shape[0])
    permuted = [{k: v[order] for k, v in f.items()} for f in feeds]
    second = run_serial(seed.main, seed.startup, permuted, [seed.loss])
    return max(float(np.max(np.abs(first.parameters[k] - second.parameters[k]))) for k in first.parameters)


def _sent(collective) -> float:
    """Bytes rank 0 sends over ``collective`` (ring algorithm; a recv sends nothing)."""
    kind = collective.kind.value
    if kind in ("send", "recv"):
        return collective.bytes if kind == "send" else 0.0
    return coefficients(kind, len(collective.group), collective.bytes)[1]


def _row(model, strategy):
    import paddle

    module, config_of, feeds_of, classes = MODELS[model]
    mesh, chosen, virtual, annotated = STRATEGIES[strategy]
    config = config_of(2 * virtual)
    seed = module.build(config, batch=4, seq=8, mesh=mesh if annotated else None, virtual=virtual)
    started = time.perf_counter()
    try:
        dist = autopar.compile(seed.main, mesh, startup_program=seed.startup, strategy=chosen)
    except autopar.AutoparError as err:
        return f"{model:6} {strategy:18} not compiled: {str(err)[:90]}"
    compiled = time.perf_counter() - started
    feeds = _feeds(seed, config, feeds_of, classes)
    start = paddle.get_rng_state()
    started = time.perf_counter()
    result = autopar.simulate(dist, feeds, [seed.loss])
    simulated = time.perf_counter() - started
    paddle.set_rng_state(start)
    serial = run_serial(seed.main, seed.startup, feeds, [seed.loss])
    loss_diff = max(abs(float(np.asarray(g[0]) - np.asarray(w[0]))) for g, w in zip(result.fetches, serial.fetches))
    param_diff = max(float(np.max(np.abs(result.parameters[k] - v))) for k, v in serial.parameters.items())
    ops = dist.comm_ops(0)
    moved = sum(_sent(c) for c in ops)
    optimum = ""
    if strategy in DATA_PARALLEL:  # a ring all_reduce of every gradient over the dp group
        gradients = sum(v.size * v.itemsize for v in serial.parameters.values())
        optimum = f"{coefficients('all_reduce', mesh.size, gradients)[1] / 1024:7.1f} KiB"
    unsupported = len(dist.report.unsupported_ops)
    return (
        f"{model:6} {strategy:18} ok  {loss_diff:8.1e} {param_diff:8.1e} {compiled:6.2f} {simulated:6.2f} {unsupported:5d} "
        f"{len(ops):5d} {moved / 1024:8.1f} KiB {optimum}"
    )


def main() -> None:
    chosen = sys.argv[1:] or list(MODELS)
    print("model  strategy           ran loss diff param diff compile  simul  norule  coll  sent/step    dp optimum")
    for model in chosen:
        module, config_of, feeds_of, classes = MODELS[model]
        seed = module.build(config_of(2), batch=4, seq=8)
        floor = _floor(seed, _feeds(seed, config_of(2), feeds_of, classes))
        print(f"{model}: rounding floor (serial vs serial, rows permuted) {floor:.1e}")
        for strategy in STRATEGIES:
            print(_row(model, strategy), flush=True)


if __name__ == "__main__":
    main()
