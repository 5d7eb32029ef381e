"""A two-layer GPT-style model with Megatron tensor parallelism from weight annotations only.

    python -m autopar.launch --nproc 2 examples/gpt_block.py --mode mp
    python -m autopar.launch --nproc 4 examples/gpt_block.py --mode dp_mp

Only the weights are annotated (qkv / fc1 column-parallel, proj / fc2 row-parallel; with
dp_mp also the batch of token ids): propagation places the attention heads, softmax,
layer_norm, embedding and cross-entropy, and one all_reduce per row-parallel layer appears in
the forward pass. Ends by comparing with the serial run and printing the largest difference.
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

import autopar  # noqa: E402
from autopar.testing.compare import train_and_compare  # noqa: E402
from autopar.testing.models import annotate_megatron, gpt_block_program  # noqa: E402

LAYERS = 2


def build(mode: str):
    # Momentum, not Adam: the key bias's true gradient is 0 and its computed one rounding
    # noise, which Adam would amplify into steps that differ between any two summation orders
    seed = gpt_block_program(batch=4, seq=8, hidden=32, heads=4, vocab=64, layers=LAYERS, optimizer="momentum")
    mesh = autopar.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]) if mode == "dp_mp" else autopar.ProcessMesh([0, 1], ["mp"])
    annotate_megatron(seed, mesh)  # qkv / fc1 column-parallel, proj / fc2 row-parallel
    if mode == "dp_mp":
        autopar.shard_tensor(seed.feeds["ids"], mesh, ["dp", None])
    return seed, autopar.compile(seed.main, mesh, startup_program=seed.startup)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["mp", "dp_mp"], default="mp")
    parser.add_argument("--backend", choices=["auto", "host", "native"], default="auto")
    args = parser.parse_args()
    seed, dist = build(args.mode)
    train_and_compare(seed, dist, backend=args.backend, label=f"gpt_block {args.mode}", tol=1e-4)
