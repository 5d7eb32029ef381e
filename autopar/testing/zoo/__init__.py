"""Model zoo: public reference architectures written the way their users write them (layers
nested, tables and masks built in the graph) and annotated the way Paddle's semi-auto users
annotate them (placement lists per mesh dim, parameters on their stage's sub-mesh,
``reshard`` between stages). Used by the tests and ``benchmarks/bench_zoo.py``.

Each module has a ``Config``, ``build(config, batch, mesh=None, ...) -> SeedProgram`` and the
annotations a user would write, chosen by the mesh's dim names: ``dp`` splits the batch, ``mp``
gives Megatron tensor parallelism, ``pp`` places consecutive layers on ``mesh[i]``. ``build``
makes the model with ``network(config, stages)`` and its loss with ``compute_loss(config,
*outputs, *labels)`` (feeds ``INPUTS`` to the model, ``LABELS`` to the loss): the same two make
the model in dynamic mode for Paddle's own semi-auto engine (``benchmarks/bench_vs_paddle.py``).

The mixture-of-experts models also read an ``ep`` mesh dim and return the logits with the
routers' auxiliary loss: ``moe`` (our own, GShard / fairscale gating, experts stacked or on
sub-meshes) and ``qwen2_moe`` (ported from PaddleNLP's non-auto Qwen2-MoE block, top-2 gating
and ``MoELayer`` in their authors' spelling, the gate per rank in ``autopar.local_map``).
"""
