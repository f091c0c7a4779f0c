"""fa.sp (Ulysses sequence parallelism) on 2 and 4 gloo processes against one process.

A small causal transformer (tests/transforms/_sp_fns.py: embeddings, 2 blocks of
causal SDPA with 4 heads, an LM head) trains on rows with right padding and
labels -100, one sp=4 part of every batch holding no real token. Its gradients
with fa.sp equal one process on the whole sequence within 1e-6 relative: a
per-rank mean (what a naive split computes) misses by far more, so the
comparison catches it. The 4-rank cases share one World.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from tests.transforms import _sp_fns as fns


@pytest.fixture
def world4(worlds: Any) -> Any:
    return worlds.get(4)


def _per_step(results: list[dict[str, Any]], accumulate: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    """Each update's batches, one per data-parallel rank (the sp rank 0 of each group), as read."""
    readers = [r for r in results if r["sp"] == 0]
    num_steps = len(readers[0]["batches"]) // accumulate
    return [
        [b for r in readers for b in r["batches"][s * accumulate : (s + 1) * accumulate]]
        for s in range(num_steps)
    ]


def _assert_like(results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    for rank, result in enumerate(results):
        assert len(result["grads"]) == len(expected["grads"])
        for step, (got, want) in enumerate(zip(result["grads"], expected["grads"], strict=True)):
            for name, value in want.items():
                torch.testing.assert_close(
                    got[name],
                    value,
                    rtol=1e-6,
                    atol=1e-7,
                    msg=f"rank {rank} step {step} {name}: {{}}".format,
                )
        for name, value in expected["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-6, atol=1e-7)


def _same_batch_per_group(results: list[dict[str, Any]], sp_size: int) -> None:
    for start in range(0, len(results), sp_size):
        group = results[start : start + sp_size]
        for other in group[1:]:
            for a, b in zip(group[0]["batches"], other["batches"], strict=True):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_per_rank_mean_differs_from_the_global_token_mean() -> None:
    """The difference the equality tests catch: the same batches, the loss averaged per
    sequence part (what each rank computes alone) instead of over all real tokens."""
    batches = [[fns.Tokens()[i] for i in range(2)]]
    stacked = [[{k: torch.stack([b[k] for b in batches[0]]) for k in batches[0][0]}]]
    right = fns.reference(stacked, clip=False)["grads"][0]
    naive = fns.reference(stacked, clip=False, naive_parts=2)["grads"][0]
    worst = max(float((naive[n] - right[n]).norm() / right[n].norm()) for n in right)
    assert worst > 1e-2  # ten thousand times the tolerance
    with_empty_part = fns.reference(stacked, clip=False, naive_parts=4)["losses"][0]
    assert torch.isnan(with_empty_part)  # a part of padding only: 0 / 0


def test_sp2_equals_one_process_on_the_whole_sequence(world2: Any) -> None:
    results = world2.run(fns.train, {"sp_size": 2}, 3)
    _same_batch_per_group(results, 2)
    expected = fns.reference(_per_step(results), clip=False)
    _assert_like(results, expected)
    for result in results:  # the reported loss is the whole batch's, on each rank
        torch.testing.assert_close(
            torch.stack(result["losses"]), torch.stack(expected["losses"]), rtol=1e-6, atol=0
        )
    # evaluation runs the whole sequence on every rank (the batch is not split): every sample once
    model = fns.make_model()
    model.load_state_dict(expected["weights"])
    tokens = fns.Tokens()
    with torch.no_grad():
        whole = fns.per_row_loss(
            model,
            {k: torch.stack([tokens[i][k] for i in range(len(tokens))]) for k in ("input_ids", "labels")},
        )
    for result in results:
        torch.testing.assert_close(result["evaluated"], whole, rtol=1e-5, atol=1e-5)


def test_sp2_trains_a_transformers_llama_like_one_process(world2: Any) -> None:
    """Its own SDPA attention (grouped key/value heads), positions passed in, no mask."""
    pytest.importorskip("transformers")
    results = world2.run(fns.train, {"sp_size": 2}, 2, llama=True)
    _assert_like(results, fns.reference(_per_step(results), clip=False, llama=True))


def test_sp2_resumes_bit_for_bit_and_on_another_sp_size(world2: Any, tmp_path: Path) -> None:
    """Saved at step 2 of 4 on sp 2; resumed there (bit for bit), on one process (sp 1),
    saved at step 3, and that resumed on sp 2 again: the same batches, the same weights."""
    results = world2.run(fns.train, {"sp_size": 2}, 4, checkpoint=str(tmp_path / "ckpt"))
    for result in results:
        for name, value in result["weights"].items():
            assert torch.equal(result["resumed"][name], value), name
    on_one = fns.resume(None, {}, str(tmp_path / "ckpt"), 4, save_at=3, save_to=str(tmp_path / "one"))
    back_on_two = world2.run(fns.resume, {"sp_size": 2}, str(tmp_path / "one"), 4)
    for weights in (on_one, *back_on_two):
        for name, value in results[0]["weights"].items():
            torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7)


def test_sp4_with_packed_sequences_and_a_users_attention_equals_one_process(world4: Any) -> None:
    """Positions restart inside a part (two documents per row); one part has no real token;
    the attention is the user's own function, marked with ulysses_attention."""
    results = world4.run(fns.train, {"sp_size": 4}, 2, packed=True, clip=True, custom=True)
    _same_batch_per_group(results, 4)
    assert {tuple(b["position_ids"][0, :8].tolist()) for b in results[0]["batches"]} == {
        (0, 1, 2, 3, 4, 5, 6, 0)
    }
    _assert_like(results, fns.reference(_per_step(results), clip=True, custom=True))


def test_sp2_by_ddp2_with_accumulation_and_clipping_equals_one_process(world4: Any) -> None:
    results = world4.run(fns.train, {"dp_shard_size": 2, "sp_size": 2}, 2, ddp=True, accumulate=2, clip=True)
    _same_batch_per_group(results, 2)
    assert not torch.equal(results[0]["batches"][0]["input_ids"], results[2]["batches"][0]["input_ids"])
    per_step = _per_step(results, accumulate=2)
    assert [len(batches) for batches in per_step] == [4, 4]  # 2 data-parallel ranks x 2 micro-batches
    _assert_like(results, fns.reference(per_step, clip=True))


def test_sp2_by_fsdp2_equals_one_process(world4: Any) -> None:
    """fa.fsdp() shards over the data-parallel ranks; each sp group's ranks hold the same shards."""
    results = world4.run(fns.train, {"dp_shard_size": 2, "sp_size": 2}, 2, fsdp=True, clip=True)
    _same_batch_per_group(results, 2)
    _assert_like(results, fns.reference(_per_step(results), clip=True))


def test_refusals_name_the_cause_and_the_fix(world2: Any) -> None:
    heads, length, mask, manual, missing, items, own_forward, recompute = world2.run(fns.refusals)[0]
    assert "heads divisible by sp_size=2" in heads
    assert "sequence length 15 is not divisible by sp_size=2" in length and "pad" in length
    assert "attn_mask" in mask and "sliding window" in mask
    assert "called no torch.nn.functional.scaled_dot_product_attention" in manual
    assert "sp_size=2" in missing and "fa.sp()" in missing
    assert "normalize='items'" in items
    assert "did not split" in own_forward and "fa.step(state, batch)" in own_forward
    assert "gradient_checkpointing_enable()" in recompute and "gradient_checkpointing_disable()" in recompute


def test_sp_checks_its_arguments_and_combinations() -> None:
    assert repr(fa.sp()) == "sp()"
    assert repr(fa.sp(labels="targets")) == "sp(labels='targets')"
    with pytest.raises(ValueError, match="seq_dim must be a non-negative int"):
        fa.sp(seq_dim=-1)
    with pytest.raises(TypeError, match="labels must be"):
        fa.sp(labels=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_activations"):
        fa.compose(fa.sp(), fa.checkpoint_activations())


def test_sp_in_a_world_of_one_is_the_plain_step() -> None:
    state = fa.init(cpu=True, seed=0)
    try:
        model = fns.make_model()
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=fns.LR),
            loss_fn=lambda m, b: fns.loss_fn(m, fns.with_positions(b)),
            pipeline=fa.sp(),
        )
        batch = {k: torch.stack([fns.Tokens()[i][k] for i in range(2)]) for k in ("input_ids", "labels")}
        state, _ = fa.step(state, batch)
        expected = fns.reference([[batch]], clip=False)["weights"]
        for name, value in state.model.named_parameters():
            assert torch.equal(value, expected[name]), name
    finally:
        fa.shutdown(state)


def test_sp_size_is_a_mesh_dimension_read_from_accelerates_keys_and_the_launch_flag() -> None:
    from fnaccel.commands.launch import launch_environment, resolve
    from fnaccel.commands.main import build_parser
    from fnaccel.dist import DistContext, data_parallel

    layout = fa.ParallelismConfig(sp_size=2).resolved(4)
    assert layout.dp_shard_size == 2 and layout.sizes["sp"] == 2
    assert [layout.coordinates(rank)["sp"] for rank in range(4)] == [0, 1, 0, 1]
    # the two ranks of an sp group are one data-parallel rank: they read one batch
    assert [data_parallel(DistContext(num_processes=4, rank=r, parallelism=layout)) for r in range(4)] == [
        (0, 2),
        (0, 2),
        (1, 2),
        (1, 2),
    ]
    config = fa.ParallelismConfig.from_config({"parallelism_config_sp_size": "2"})
    assert config.sp_size == 2 and fa.ParallelismConfig.from_config(config.to_config()) == config
    with pytest.raises(ValueError, match="sp_size must be a positive int"):
        fa.ParallelismConfig(sp_size=0)
    with pytest.raises(fa.ConfigError, match="sp_size=2 x tp_size=1 = 2, but the run has 1 processes"):
        fa.init(cpu=True, parallelism=fa.ParallelismConfig(dp_shard_size=1, sp_size=2))
    args = build_parser().parse_args(
        ["launch", "--cpu", "--num_processes", "4", "--parallelism_config_sp_size", "2", "train.py"]
    )
    launched = resolve(args)
    assert launched.parallelism_config == {"parallelism_config_sp_size": 2}
    assert launch_environment(args, launched)["FNACCEL_PARALLELISM_CONFIG_SP_SIZE"] == "2"
