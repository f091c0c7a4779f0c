"""fp8 training: ``fa.autocast(fa.fp8)`` through torchao's float8 linear layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.config.environment import is_torchao_available
from fnaccel.kwargs import FP8RecipeKwargs
from fnaccel.preparation import default_pipeline
from fnaccel.transforms.fp8 import convert_to_fp8, float8_linear_config, keep_first_and_last_linear
from fnaccel.transforms.mixed_precision import fp8

needs_torchao = pytest.mark.skipif(
    not is_torchao_available(), reason="torchao is not installed (pip install 'fnaccel[fp8]')"
)

# fp8's final loss against bf16's after TRAIN_STEPS steps of the same run, measured on CPU:
# 1.2e-3 apart in one process, 1.4e-3 (float8 all-gather) and 1.9e-3 under fa.fsdp() on 2.
LOSS_TOLERANCE = 0.01
TRAIN_STEPS = 12


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, input projection, two MLP blocks, output head (dims multiples of 16)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.proj(self.embed(tokens))))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def token_batches() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8, 17), generator=torch.Generator().manual_seed(1))


def train_lm(
    state: fa.RunState, precision: Any, sharded: bool = False, recipe: FP8RecipeKwargs | None = None
) -> dict[str, Any]:
    """TRAIN_STEPS steps of TinyLM (under fa.fsdp() when ``sharded``); each rank
    takes its share of every batch."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cast = fa.autocast(precision, recipe=recipe) if recipe is not None else fa.autocast(precision)
    parallel = (fa.fsdp(transformer_cls_names_to_wrap=["Block"]),) if sharded else ()
    state = fa.prepare(state, model, optimizer, loss_fn=lm_loss, pipeline=fa.compose(cast, *parallel))
    rank, world = state.dist.rank, state.dist.num_processes
    losses = []
    for i in range(TRAIN_STEPS):
        batch = token_batches()[i % 4]
        state, metrics = fa.step(state, batch.chunk(world)[rank])
        losses.append(float(fa.ops.reduce(state, metrics["loss"].detach())))
    weight = model.blocks[0].up.weight
    local = getattr(weight, "_local_tensor", weight)
    return {
        "losses": losses,
        "layers": {name: type(m).__name__ for name, m in model.named_modules()},
        "weight_class": type(local).__name__,
    }


@needs_torchao
def test_a_float8_layer_computes_the_hand_written_scaled_float8_matmul() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 48), nn.Linear(48, 16))
    state = fa.prepare(fa.init(seed=0, cpu=True), model, pipeline=fa.compose(fa.autocast(fp8)))
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model[1](x)

    def to_float8(t: torch.Tensor) -> torch.Tensor:  # per-tensor dynamic scale, e4m3
        top = torch.finfo(torch.float8_e4m3fn).max
        scale = (top / t.abs().max().double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-top, top).to(torch.float8_e4m3fn).float() / scale

    layer = model[1]
    assert isinstance(layer, nn.Linear)
    hand = (to_float8(x) @ to_float8(layer.weight).T).to(torch.bfloat16) + layer.bias.to(torch.bfloat16)
    torch.testing.assert_close(out, hand, rtol=0, atol=0)
    plain_bf16 = x.to(torch.bfloat16) @ layer.weight.to(torch.bfloat16).T + layer.bias.to(torch.bfloat16)
    assert (out.float() - plain_bf16.float()).abs().max() > 1e-2  # float8 really happened
    assert isinstance(state.pipeline, fa.Pipeline) and state.pipeline.names == ("autocast",)


@pytest.mark.slow
@needs_torchao
def test_fp8_trains_a_small_lm_within_tolerance_of_bf16() -> None:
    bf16 = train_lm(fa.init(seed=0, cpu=True), fa.bf16)
    ours = train_lm(fa.init(seed=0, cpu=True), fp8)
    # first and last linear layers stay in high precision (Accelerate's and torchtitan's default)
    assert ours["layers"]["proj"] == ours["layers"]["head"] == "Linear"
    assert ours["layers"]["blocks.0.up"] == ours["layers"]["blocks.1.down"] == "Float8Linear"
    assert ours["losses"][-1] < ours["losses"][0] - 0.1  # it learns
    assert abs(ours["losses"][-1] - bf16["losses"][-1]) < LOSS_TOLERANCE
    assert ours["losses"] != bf16["losses"]  # and is not bf16 under another name


@pytest.fixture(scope="module")
def bf16_under_fsdp(worlds: Any) -> list[dict[str, Any]]:
    """The bf16 run both recipes below are compared with (the same seeded run: computed once)."""
    result: list[dict[str, Any]] = worlds.get(2).run(train_lm, fa.bf16, True)
    return result


@needs_torchao
@pytest.mark.parametrize("all_gather", [False, True])
def test_fp8_with_fsdp_on_two_processes(
    world2: Any, bf16_under_fsdp: list[dict[str, Any]], all_gather: bool
) -> None:
    recipe = FP8RecipeKwargs(enable_fsdp_float8_all_gather=all_gather)
    ours = world2.run(train_lm, fp8, True, recipe)
    bf16 = bf16_under_fsdp
    assert ours[0]["losses"] == ours[1]["losses"]  # one reduced loss on both ranks
    assert ours[0]["layers"]["blocks.0.up"] == "Float8Linear"
    expected = "WeightWithDynamicFloat8CastTensor" if all_gather else "Tensor"
    assert ours[0]["weight_class"] == expected  # what FSDP2 all-gathers
    assert ours[0]["losses"][-1] < ours[0]["losses"][0] - 0.1
    assert abs(ours[0]["losses"][-1] - bf16[0]["losses"][-1]) < LOSS_TOLERANCE


def resume_lm(state: fa.RunState, sharded: bool, directory: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more, load the save, train the same 2 again;
    then save the consolidated weights."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    parts: list[fa.Transform] = [
        fa.autocast(fp8, recipe=FP8RecipeKwargs(enable_fsdp_float8_all_gather=sharded))
    ]
    parts += [fa.fsdp(transformer_cls_names_to_wrap=["Block"])] if sharded else []
    state = fa.prepare(state, model, optimizer, loss_fn=lm_loss, pipeline=fa.compose(*parts))
    rank, world = state.dist.rank, state.dist.num_processes

    def two_steps(state: fa.RunState) -> tuple[fa.RunState, list[float]]:
        losses = []
        for i in (2, 3):
            state, metrics = fa.step(state, token_batches()[i].chunk(world)[rank])
            losses.append(float(metrics["loss"]))
        return state, losses

    for i in (0, 1):
        state, _ = fa.step(state, token_batches()[i].chunk(world)[rank])
    fa.save(state, f"{directory}/ckpt")
    state, first = two_steps(state)
    state, again = two_steps(fa.load(state, f"{directory}/ckpt"))
    fa.save_model(state, f"{directory}/model")
    return {"first": first, "again": again}


@needs_torchao
def test_fp8_checkpoints_resume_bit_identical(tmp_path: Any, world2: Any) -> None:
    from safetensors.torch import load_file

    alone = resume_lm(fa.init(seed=0, cpu=True), False, str(tmp_path / "alone"))
    assert alone["first"] == alone["again"]
    sharded = world2.run(resume_lm, True, str(tmp_path / "sharded"))  # float8 all-gather's weights
    assert all(rank["first"] == rank["again"] for rank in sharded)
    saved = load_file(tmp_path / "sharded" / "model" / "model.safetensors")
    assert set(saved) == set(TinyLM().state_dict())  # the plain model's names and shapes
    assert all(saved[name].shape == p.shape for name, p in TinyLM().state_dict().items())


def test_default_choice_of_float8_layers() -> None:
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    keep = keep_first_and_last_linear(model)
    # first and last stay high precision; 24 is not a multiple of 16; only a Linear converts
    assert [keep(m, name) for name, m in model.named_children()] == [False, True, False, False, False, False]


@needs_torchao
def test_module_filter_func_overrides_the_default() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    convert_to_fp8(model, FP8RecipeKwargs(module_filter_func=lambda module, fqn: fqn in ("0", "2")))
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Float8Linear"]


@needs_torchao
@pytest.mark.parametrize(
    ("model", "recipe", "message"),
    [
        (
            nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16)),
            FP8RecipeKwargs(module_filter_func=lambda m, fqn: True),
            r"picked '0' \(16 -> 24 features\).*multiples of 16",
        ),
        (
            nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)),
            FP8RecipeKwargs(),
            r"no nn.Linear of Sequential would train in float8.*fa.autocast\(fa.bf16\)",
        ),
    ],
)
def test_bad_layer_choices_are_refused_before_converting(
    model: nn.Module, recipe: FP8RecipeKwargs, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        convert_to_fp8(model, recipe)
    assert all(type(m) is nn.Linear for m in model.children())  # untouched


@needs_torchao
def test_recipe_maps_onto_torchaos_float8_config() -> None:
    from torchao.float8 import ScalingType

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    default = float8_linear_config(FP8RecipeKwargs())  # HYBRID, as torchao's own default
    assert (default.cast_config_weight.target_dtype, default.cast_config_grad_output.target_dtype) == (
        e4m3,
        e5m2,
    )
    assert not default.enable_fsdp_float8_all_gather
    e4m3_only = float8_linear_config(FP8RecipeKwargs(fp8_format="e4m3", enable_fsdp_float8_all_gather=True))
    assert e4m3_only.cast_config_input.target_dtype == e4m3_only.cast_config_grad_output.target_dtype == e4m3
    assert e4m3_only.enable_fsdp_float8_all_gather
    assert float8_linear_config(FP8RecipeKwargs(fp8_format="E5M2")).cast_config_input.target_dtype == e5m2
    wgrad_hp = float8_linear_config(FP8RecipeKwargs(override_linear_precision=(False, False, True)))
    assert wgrad_hp.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert wgrad_hp.cast_config_grad_output_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert wgrad_hp.cast_config_input.scaling_type is ScalingType.DYNAMIC


@needs_torchao
def test_high_precision_weight_gradients_train() -> None:
    recipe = FP8RecipeKwargs(fp8_format="E4M3", override_linear_precision=(False, False, True))
    result = train_lm(fa.init(seed=0, cpu=True), fp8, recipe=recipe)
    assert result["losses"][-1] < result["losses"][0] - 0.1


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (
            FP8RecipeKwargs(backend="te"),
            r"'TE' \(TransformerEngine\) runs fp8 on CUDA GPUs only.*backend='AO'",
        ),
        (FP8RecipeKwargs(backend="msamp"), r"'MSAMP' \(MS-AMP\) runs fp8 on CUDA GPUs only"),
        (FP8RecipeKwargs(amax_history_len=16), "delayed scaling, which torchao does not have"),
        (FP8RecipeKwargs(margin=0), "delayed scaling"),
        (FP8RecipeKwargs(opt_level="O2"), "MS-AMP's"),
        (FP8RecipeKwargs(use_autocast_during_eval=True), "TransformerEngine's switch"),
    ],
)
def test_recipes_this_build_cannot_run_are_refused_with_the_reason(
    recipe: FP8RecipeKwargs, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fa.autocast(fp8, recipe=recipe)


def test_cuda_only_backends_name_what_is_missing_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    with pytest.raises(ValueError, match="this machine has no CUDA device"):
        fa.autocast(fp8, recipe=FP8RecipeKwargs(backend="TE"))


def test_recipe_misuse() -> None:
    with pytest.raises(ValueError, match=r"recipe= configures fp8 training.*fa.autocast\(fa.fp8"):
        fa.autocast(fa.bf16, recipe=FP8RecipeKwargs())
    with pytest.raises(TypeError, match="must be an fa.FP8RecipeKwargs, got dict"):
        fa.autocast(fp8, recipe={"fp8_format": "HYBRID"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="module_filter_func"):
        FP8RecipeKwargs(module_filter_func="blocks")  # type: ignore[arg-type]


@pytest.mark.skipif(is_torchao_available(), reason="checks the message shown without torchao")
def test_fp8_without_torchao_says_what_to_install() -> None:
    with pytest.raises(ImportError, match=r"pip install 'fnaccel\[fp8\]'"):
        fa.autocast(fp8)


@needs_torchao
def test_launch_precision_fp8_builds_the_fp8_pipeline_with_the_recipe() -> None:
    recipe = FP8RecipeKwargs(fp8_format="HYBRID")
    state = fa.init(seed=0, cpu=True, mixed_precision="fp8", kwargs_handlers=[recipe])
    pipeline = default_pipeline(state)
    assert pipeline == fa.compose(fa.autocast(fp8, recipe=recipe))
    assert repr(pipeline) == "compose(autocast(dtype='fp8', recipe=FP8RecipeKwargs(fp8_format='HYBRID')))"


@needs_torchao
def test_a_pipeline_without_fp8_under_an_fp8_launch_is_named() -> None:
    state = fa.init(seed=0, cpu=True, mixed_precision="fp8")
    with pytest.warns(UserWarning, match="asked for mixed_precision fp8 but the pipeline passed in"):
        fa.prepare(state, TinyLM(), pipeline=fa.compose(fa.autocast(fa.bf16)))
