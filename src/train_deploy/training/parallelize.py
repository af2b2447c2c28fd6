"""All parallelism is applied here, in one function, in a fixed order."""

from __future__ import annotations

import numpy as np

from train_deploy.training.config import Layout


def build_mesh(layout: Layout):
    """The process mesh: ranks laid out as [pp, dp, mp] (pp only when > 1), mp fastest-varying so
    tensor-parallel peers are neighbours (same node first)."""
    import paddle.distributed as dist

    ranks = np.arange(layout.world_size)
    if layout.pp > 1:
        return dist.ProcessMesh(ranks.reshape(layout.pp, layout.dp, layout.mp).tolist(), dim_names=["pp", "dp", "mp"])
    return dist.ProcessMesh(ranks.reshape(layout.dp, layout.mp).tolist(), dim_names=["dp", "mp"])


def parallelize(model, optimizer, *, layout: Layout, device: str = "cpu", single: str = "auto_parallel"):
    """Shard ``model`` and ``optimizer`` over the mesh; return them with the mesh.

    One process with ``single`` = ``"plain"`` returns them unchanged with no mesh (no distributed tensors;
    ``benchmarks/bench_train.py`` and ``benchmarks/gpu_check.sh`` compare the two).

    Order: (1) tensor parallel, the model's own ``auto_dist_config()['mp_config']`` plan (attention and
    MLP projections column/row-wise, embeddings and LM head by vocabulary); (2) pipeline stages over
    ``llama.layers`` (GPU only, refused earlier on CPU); (3) data parallel with ZeRO sharding of the
    optimizer state, gradients and weights over the dp axis at ``sharding_stage``.
    """
    import paddle.distributed as dist

    if layout.world_size == 1 and single == "plain":
        return model, optimizer, None
    mesh = build_mesh(layout)
    plan = model.auto_dist_config()
    config: dict = {"dp_config": {"sharding_level": layout.sharding_stage}}
    if layout.mp > 1:
        config["mp_config"] = plan["mp_config"]
    if layout.pp > 1:
        config["pp_config"] = plan["pp_config"]
    model, optimizer = dist.parallelize(model, optimizer, mesh=mesh, config=config)
    if layout.sharding_stage and device == "cpu":
        # ZeRO turns partial gradients into dp-shards with reduce-scatter, which Paddle's CPU backend lacks.
        # All-reducing them first (twice the traffic) leaves sharding a local slice: same numbers, CPU-able.
        for param in model.parameters():
            param.register_hook(_all_reduce_partial)
    return model, optimizer, mesh


def _all_reduce_partial(grad):
    import paddle.distributed as dist

    if grad.is_dist() and any(isinstance(p, dist.Partial) for p in grad.placements):
        placements = [dist.Replicate() if isinstance(p, dist.Partial) else p for p in grad.placements]
        return dist.reshard(grad, grad.process_mesh, placements)
    return grad


def data_rank(rank: int, layout: Layout) -> int:
    """This process's index along the data-parallel axis of :func:`build_mesh`'s layout."""
    return (rank // layout.mp) % layout.dp
