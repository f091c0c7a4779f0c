"""The device mesh (`fa.ParallelismConfig`) and the transforms over it: `fa.tp`,
`fa.fsdp` as FSDP + TP and as HSDP, `fa.checkpoint_activations`.

The acceptance tests train on real gloo processes and compare with one process
of plain PyTorch on the global batch: TP on 2 ranks (1e-6), FSDP + TP and HSDP
on a 2x2 mesh (1e-5), each with global-norm clipping, `fa.evaluate`, and a
sharded checkpoint's round trip. The 4-rank tests share one world.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.dist import DistContext, data_parallel, data_parallel_context, mesh_dim
from tests.transforms import _mesh_fns as fns


@pytest.fixture
def world4(worlds: Any) -> Any:
    return worlds.get(4)


def assert_trained_like_reference(
    results: list[dict[str, Any]], global_batch: int, num_steps: int, atol: float
) -> None:
    weights, norms, outputs = fns.reference(global_batch, num_steps)
    for rank, seen in enumerate(results):
        assert seen["weights"].keys() == weights.keys()
        for name, expected in weights.items():
            torch.testing.assert_close(
                seen["weights"][name], expected, atol=atol, rtol=0, msg=f"rank {rank} {name}"
            )
            assert torch.equal(seen["reloaded"][name], seen["weights"][name]), f"rank {rank} {name} reloaded"
        torch.testing.assert_close(torch.tensor(seen["norms"]), torch.tensor(norms), atol=atol, rtol=0)
        assert max(norms) > fns.MAX_NORM  # clipping was active: the global norm mattered
        torch.testing.assert_close(seen["outputs"], outputs, atol=atol, rtol=0)  # every sample once, in order


# --------------------------------------------------------------------- acceptance


def test_tp_on_two_ranks_equals_the_unsharded_model(world2: Any, tmp_path: Path) -> None:
    results = world2.run(fns.train_on_mesh, {"tp_size": 2}, "tp", 6, 4, str(tmp_path / "tp"))
    assert_trained_like_reference(results, global_batch=4, num_steps=6, atol=1e-6)
    assert results[0]["batches"] == results[1]["batches"]  # one tp group reads one batch
    assert results[0]["kinds"] == ["DTensor", "Parameter"]  # the plan's layers are sharded, the rest not
    assert [r["tp_size"] for r in results] == [2, 2]  # fa.utils.get_model_tp_size reads it from the mesh
    # a second run on the same layout in the same processes gets its own groups (torch's DTensor
    # caches would otherwise hand it the first run's, gone with fa.shutdown)
    again = world2.run(fns.train_on_mesh, {"tp_size": 2}, "tp", 2, 4, str(tmp_path / "tp_again"))
    assert_trained_like_reference(again, global_batch=4, num_steps=2, atol=1e-6)


def test_fsdp_plus_tp_on_a_2x2_mesh_equals_one_process(world4: Any, tmp_path: Path) -> None:
    """With activation checkpointing between them (tp, checkpoint_activations, fsdp)."""
    results = world4.run(
        fns.train_on_mesh, {"dp_shard_size": 2, "tp_size": 2}, "fsdp+tp", 5, 4, str(tmp_path / "fsdp_tp")
    )
    assert_trained_like_reference(results, global_batch=8, num_steps=5, atol=1e-5)
    batches = [r["batches"] for r in results]
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    assert all(r["kinds"] == ["DTensor"] for r in results)


def test_hsdp_on_a_2x2_mesh_equals_one_process(world4: Any, tmp_path: Path) -> None:
    results = world4.run(
        fns.train_on_mesh, {"dp_replicate_size": 2, "dp_shard_size": 2}, "hsdp", 5, 2, str(tmp_path / "hsdp")
    )
    assert_trained_like_reference(results, global_batch=8, num_steps=5, atol=1e-5)
    assert len({str(r["batches"]) for r in results}) == 4  # four data-parallel ranks, four shards


# --------------------------------------------------------------------- the mesh and its accessors


def test_the_mesh_names_its_dimensions_and_the_accessors_agree(world4: Any) -> None:
    results = world4.run(fns.mesh_facts, {"dp_replicate_size": 2, "tp_size": 2})
    assert [r["names"] for r in results] == [("dp_replicate", "tp")] * 4  # dp_shard 1: left out
    assert [r["dp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert results[0]["dims"] == {
        "pp": None,
        "dp_replicate": [0, 2],
        "dp_shard": None,
        "cp": None,
        "tp": [0, 1],
        "dp": [0, 2],
    }
    assert results[3]["dims"]["tp"] == [2, 3] and results[3]["dims"]["dp"] == [1, 3]
    assert all(r["dp_sum"] == 2.0 for r in results)  # reduced over the data-parallel group only
    # from_process counts the group's ranks: its rank 1 is global rank 2 (group 0, 2) or 3 (group 1, 3)
    assert [r["from_second"] for r in results] == [[2.0, 2.0], [3.0, 3.0], [2.0, 2.0], [3.0, 3.0]]
    assert [r["objects"] for r in results] == [[2], [3], [2], [3]]


def test_invalid_meshes_and_tp_without_a_plan_fail_with_the_fix(world4: Any) -> None:
    no_plan, no_shard, ddp_tp = world4.run(fns.refusals)[0]
    assert "tp_size=2 but" in no_plan and "add fa.tp(" in no_plan
    assert "dp_shard_size 1" in no_shard and "fa.ddp()" in no_shard
    assert "use fa.fsdp() with fa.tp()" in ddp_tp


def test_sizes_that_do_not_multiply_to_the_world_fail_at_init() -> None:
    with pytest.raises(fa.ConfigError, match=r"tp_size=2 = 2, but the run has 1 processes.*multiply to 1"):
        fa.init(cpu=True, parallelism=fa.ParallelismConfig(dp_shard_size=1, tp_size=2))
    with pytest.raises(fa.ConfigError, match="does not divide the 1 processes"):
        fa.init(cpu=True, parallelism=fa.ParallelismConfig(tp_size=2))
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        fa.ParallelismConfig(tp_size=0)
    with pytest.raises(TypeError, match="fa.ParallelismConfig"):
        fa.init(cpu=True, parallelism={"tp_size": 1})  # type: ignore[arg-type]


def test_context_parallel_is_accepted_in_config_and_refused_on_cpu_with_the_reason() -> None:
    config = fa.ParallelismConfig.from_config(
        {"parallelism_config_cp_size": 1, "parallelism_config_cp_comm_strategy": "alltoall"}
    )
    assert config.cp_comm_strategy == "alltoall"
    with pytest.raises(fa.ConfigError, match="_scaled_dot_product_flash_attention_for_cpu.*set cp_size=1"):
        fa.init(cpu=True, parallelism=fa.ParallelismConfig(cp_size=2))


def test_a_world_of_one_has_no_mesh_and_is_its_own_data_parallel_group() -> None:
    state = fa.init(cpu=True)
    assert state.dist.mesh is None and mesh_dim(state.dist, "tp") is None
    assert data_parallel(state.dist) == (0, 1) and data_parallel_context(state.dist) is state.dist
    ctx = DistContext(num_processes=4, rank=3, parallelism=fa.ParallelismConfig(tp_size=2).resolved(4))
    assert data_parallel(ctx) == (1, 2)
    assert (data_parallel_context(ctx).rank, data_parallel_context(ctx).num_processes) == (1, 2)
    with pytest.raises(ValueError, match="unknown dimension 'model'"):
        mesh_dim(state.dist, "model")


def test_the_config_section_reads_accelerates_keys_and_refuses_others() -> None:
    section = {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": "2",
        "parallelism_config_tp_size": 1,
        "parallelism_config_cp_size": 1,
    }
    config = fa.ParallelismConfig.from_config(section)
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 2)
    assert fa.ParallelismConfig.from_config(config.to_config()) == config
    with pytest.raises(fa.ConfigError, match="unknown key 'tp_size'"):
        fa.ParallelismConfig.from_config({"tp_size": 2})
    with pytest.raises(fa.ConfigError, match="'parallelism_config_tp_size' must be a positive integer"):
        fa.ParallelismConfig.from_config({"parallelism_config_tp_size": 1.5})


# --------------------------------------------------------------------- activation checkpointing


def _saved_bytes_and_grads(pipeline: fa.Pipeline) -> tuple[int, dict[str, torch.Tensor], float]:
    model = fns.make_model()
    state = fa.prepare(
        fa.init(cpu=True, seed=0),
        model,
        torch.optim.SGD(model.parameters(), lr=fns.LR),
        pipeline=pipeline,
        loss_fn=fns.loss_fn,
    )
    x, y = fns.data().tensors
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fns.loss_fn(state.model, (x, y))
    loss.backward()
    return saved[0], {n: p.grad.clone() for n, p in model.named_parameters()}, float(loss.detach())


@pytest.mark.parametrize(
    "classes", [(), ("Block",), (fns.Block,)], ids=["every-block", "by-name", "by-class"]
)
def test_activation_checkpointing_changes_no_result_and_keeps_fewer_activations(
    classes: tuple[Any, ...],
) -> None:
    plain_bytes, plain_grads, plain_loss = _saved_bytes_and_grads(fa.compose())
    bytes_, grads, loss = _saved_bytes_and_grads(fa.compose(fa.checkpoint_activations(*classes)))
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    assert bytes_ < 0.6 * plain_bytes, (bytes_, plain_bytes)  # the blocks' activations are recomputed


def test_checkpointing_a_class_the_model_lacks_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no module of class Block"):
        fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.checkpoint_activations("Block")))
    with pytest.raises(ValueError, match="has none; name the blocks' class"):
        fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.checkpoint_activations()))


# --------------------------------------------------------------------- compose


def test_compose_puts_tp_before_checkpointing_before_fsdp() -> None:
    tp = fa.tp(fns.tp_plan())
    assert fa.compose(tp, fa.checkpoint_activations(), fa.fsdp()).names == (
        "tp",
        "checkpoint_activations",
        "fsdp",
    )
    with pytest.raises(
        ValueError, match=r"tp\(plan=\['blocks.\*.up', 'blocks.\*.down'\]\) must come before fsdp"
    ):
        fa.compose(fa.fsdp(), tp)
    with pytest.raises(
        ValueError, match=r"cannot be combined; ddp\(\) replicates whole parameters; use fa.fsdp\(\)"
    ):
        fa.compose(tp, fa.ddp())


def test_a_tp_plan_must_hold_parallel_styles_and_name_real_modules() -> None:
    with pytest.raises(TypeError, match="not a torch ParallelStyle"):
        fa.tp({"blocks.0.up": "colwise"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="non-empty dict"):
        fa.tp({})
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ValueError, match=r"'blocks.\*.gate', which is no submodule"):
        fa.prepare(
            fa.init(cpu=True),
            fns.make_model(),
            pipeline=fa.compose(fa.tp({"blocks.*.gate": ColwiseParallel()})),
        )
