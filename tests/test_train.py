"""fa.prepare / fa.step against hand-written PyTorch loops (the gold standard)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.train import StepPlan

Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(seed: int = 0, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4))


def make_batches(num: int, size: int = 16, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(num)
    ]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


Opt = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Opt] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def hand_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    batches: list[Batch],
    seed: int,
    accumulate: int = 1,
) -> list[float]:
    """nanoGPT-style reference loop; the RNG is seeded right before it, as fa.init(seed=) does."""
    torch.manual_seed(seed)
    losses = []
    for i, batch in enumerate(batches):
        loss = loss_fn(model, batch)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_equals_a_hand_written_loop_bit_for_bit(name: str) -> None:
    batches = make_batches(12)
    ref = make_model()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    ref_losses = hand_loop(ref, ref_opt, ref_sched, batches, seed=5)

    model = make_model()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    state = fa.prepare(fa.init(seed=5, cpu=True), model, opt, scheduler=sched, loss_fn=loss_fn)
    losses, lrs = [], []
    for batch in batches:
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
        lrs.append(metrics["lr"])
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.equal(p, q)
    assert state.step == 12 and state.micro_step == 12
    assert lrs[2] == lrs[0] and lrs[3] == lrs[0] * 0.5  # the scheduler stepped per update


def test_accumulate_k_equals_the_k_times_batch() -> None:
    big = make_batches(3, size=32)
    small = [(x[i : i + 8], y[i : i + 8]) for x, y in big for i in range(0, 32, 8)]
    ref = make_model(dropout=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for batch in big:
        loss_fn(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, opt, loss_fn=loss_fn, pipeline=fa.compose(fa.accumulate(4))
    )
    updates = []
    for batch in small:
        state, metrics = fa.step(state, batch)
        updates.append("lr" in metrics)
    assert updates == [False, False, False, True] * 3
    assert (state.step, state.micro_step) == (3, 12)
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_clip_grad_norm_reports_the_norm_and_clips() -> None:
    model = make_model(dropout=0.0)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, opt, loss_fn=loss_fn, pipeline=fa.compose(fa.clip_grad_norm(0.01))
    )
    batch = make_batches(1)[0]
    state, metrics = fa.step(state, batch)
    loss_fn(ref, batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert torch.equal(metrics["grad_norm"], expected) and expected > 0.01
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        assert torch.equal(p, q)


def test_fp16_scaler_skips_an_inf_step_and_halves_the_scale() -> None:
    model = make_model(dropout=0.0)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def poisoned(model: nn.Module, batch: Batch) -> torch.Tensor:
        return loss_fn(model, batch) * torch.tensor(float("inf"))

    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        opt,
        scheduler=sched,
        loss_fn=poisoned,
        pipeline=fa.compose(fa.autocast(fa.fp16), fa.ddp(), fa.clip_grad_norm(1e3)),
    )
    assert state.pipeline is not None  # the scaler is added in its canonical place
    assert isinstance(state.pipeline, fa.Pipeline)
    assert state.pipeline.names == ("autocast", "grad_scaler", "ddp", "clip_grad_norm")
    state, metrics = fa.step(state, make_batches(1)[0])
    assert bool(metrics["skipped"]) is True
    assert metrics["scale"].item() == 65536.0 / 2
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1  # scheduler skipped too
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    state = state.replace(loss_fn=loss_fn)
    state, metrics = fa.step(state, make_batches(1)[0])
    assert bool(metrics["skipped"]) is False and sched.last_epoch == 1


def test_bf16_autocast_runs_and_returns_fp32_outputs() -> None:
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, opt, loss_fn=loss_fn, pipeline=fa.compose(fa.autocast(fa.bf16))
    )
    assert model(torch.randn(2, 8)).dtype == torch.float32
    state, metrics = fa.step(state, make_batches(1)[0])
    assert metrics["loss"].dtype == torch.float32


def _run(seed: int, batches: list[Batch]) -> tuple[list[float], list[torch.Tensor]]:
    model = make_model(dropout=0.5)
    state = fa.prepare(
        fa.init(seed=seed, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    losses = []
    for batch in batches:
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_two_runs_interleaved_equal_each_run_alone() -> None:
    batches = make_batches(6)
    alone_a, alone_b = _run(1, batches), _run(2, batches)
    a_model, b_model = make_model(dropout=0.5), make_model(dropout=0.5)
    a = fa.prepare(
        fa.init(seed=1, cpu=True), a_model, torch.optim.SGD(a_model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    b = fa.prepare(
        fa.init(seed=2, cpu=True), b_model, torch.optim.SGD(b_model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    losses_a, losses_b = [], []
    for batch in batches:
        a, metrics = fa.step(a, batch)
        losses_a.append(metrics["loss"].item())
        torch.rand(3)  # a stray draw from the process generator between steps
        b, metrics = fa.step(b, batch)
        losses_b.append(metrics["loss"].item())
    assert losses_a == alone_a[0] and losses_b == alone_b[0]
    assert all(torch.equal(p, q) for p, q in zip(a_model.parameters(), alone_a[1], strict=False))
    assert all(torch.equal(p, q) for p, q in zip(b_model.parameters(), alone_b[1], strict=False))
    assert losses_a != losses_b


def test_the_rng_a_step_captured_is_a_value_later_draws_leave_alone() -> None:
    model = make_model(dropout=0.5)
    state = fa.prepare(
        fa.init(seed=3, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    batches = make_batches(3)
    state, _ = fa.step(state, batches[0])
    captured = state.rng.torch.clone()
    torch.rand(100)  # stray draws from the process generator: the state holds a copy
    assert torch.equal(state.rng.torch, captured)
    after, _ = fa.step(state, batches[1])
    assert torch.equal(state.rng.torch, captured)  # the spent state still reads the same
    assert not torch.equal(after.rng.torch, captured)  # the dropout drew from the run's stream
    after.rng.install(("torch",))  # installing the value does not tie it to the generator
    torch.rand(100)
    assert not torch.equal(torch.get_rng_state(), after.rng.torch)


@pytest.mark.parametrize(
    ("pipeline", "plain_backward", "plain_update"),
    [
        (fa.compose(), True, True),
        (fa.compose(fa.accumulate(2)), False, True),
        (fa.compose(fa.clip_grad_norm(1.0)), True, False),
    ],
)
def test_the_plan_says_when_backward_and_update_are_pytorchs_alone(
    pipeline: Any, plain_backward: bool, plain_update: bool
) -> None:
    model = make_model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=pipeline,
    )
    assert state.plan is not None
    plan = state.plan
    assert isinstance(plan, StepPlan)
    assert (plan.plain_backward, plan.plain_update) == (plain_backward, plain_update)


def test_reusing_a_consumed_state_raises() -> None:
    model = make_model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn
    )
    new, _ = fa.step(state, make_batches(1)[0])
    with pytest.raises(fa.StaleStateError, match=r"consumed by fa.step at step 0 \(micro-step 0\)"):
        fa.step(state, make_batches(1)[0])
    fa.step(new, make_batches(1)[0])


def test_backward_and_apply_gradients_equal_step() -> None:
    batches = make_batches(8)
    ref_model = make_model()
    ref = fa.prepare(
        fa.init(seed=3, cpu=True),
        ref_model,
        torch.optim.AdamW(ref_model.parameters()),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.accumulate(2), fa.clip_grad_norm(0.5)),
    )
    for batch in batches:
        ref, _ = fa.step(ref, batch)

    model = make_model()
    state = fa.prepare(
        fa.init(seed=3, cpu=True),
        model,
        torch.optim.AdamW(model.parameters()),
        pipeline=fa.compose(fa.accumulate(2), fa.clip_grad_norm(0.5)),
    )
    for batch in batches:
        state, loss = fa.with_rng(state, loss_fn, model, batch)
        state = fa.backward(state, loss)
        state, _metrics = fa.apply_gradients(state)
    assert (state.step, state.micro_step) == (ref.step, ref.micro_step) == (4, 8)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters(), strict=False))


def test_bad_pipelines_fail_at_compose_or_prepare() -> None:
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        fa.accumulate(0)
    with pytest.raises(
        ValueError, match=r"autocast\(dtype=torch.float16\) and autocast\(dtype=torch.bfloat16\) both appear"
    ):
        fa.compose(fa.autocast(fa.fp16), fa.autocast(fa.bf16))
    with pytest.raises(ValueError, match="cannot be combined"):
        fa.compose(fa.clip_grad_norm(1.0), fa.clip_grad_value(1.0))
    with pytest.raises(ValueError, match=r"autocast\(dtype=torch.bfloat16\) must come before ddp\(\)"):
        fa.compose(fa.ddp(), fa.autocast(fa.bf16))
    model = make_model()
    with pytest.raises(ValueError, match="is a collective"):
        fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.gather()))
    with pytest.raises(ValueError, match="only makes sense with autocast"):
        fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.grad_scaler()))
    with pytest.raises(ValueError, match="prepare a model and an optimizer first"):
        fa.step(fa.prepare(fa.init(cpu=True), pipeline=fa.compose()), make_batches(1)[0])


def test_autocast_fp16_adds_a_grad_scaler_unless_another_transform_scales_the_loss() -> None:
    """autocast's own check completes the pipeline; a loss scaler of one's own (declaring
    SCALES_LOSS) takes the place of fa.grad_scaler(), as DeepSpeed's does."""
    added = fa.prepare(fa.init(cpu=True), make_model(), pipeline=fa.compose(fa.autocast(fa.fp16)))
    assert repr(added.pipeline) == "compose(autocast(dtype=torch.float16), grad_scaler())"
    own = fa.Transform(
        name="my_scaler", phase=fa.Phase.GRAD_SCALER, capabilities=frozenset({fa.Capability.SCALES_LOSS})
    )
    kept = fa.prepare(fa.init(cpu=True), make_model(), pipeline=fa.compose(fa.autocast(fa.fp16), own))
    assert repr(kept.pipeline) == "compose(autocast(dtype=torch.float16), my_scaler())"


def test_default_loss_fn_uses_scalar_output_or_loss_attribute() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.linear(x).pow(2).mean()}

    model = WithLoss()
    state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))
    state, metrics = fa.step(state, {"x": torch.ones(2, 8)})
    assert metrics["loss"].ndim == 0
    bad = nn.Linear(8, 2)
    state = fa.prepare(fa.init(seed=0, cpu=True), bad, torch.optim.SGD(bad.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="neither a scalar loss nor has a .loss"):
        fa.step(state, torch.ones(2, 8))


def test_a_loss_that_is_not_a_tensor_is_refused_at_the_step() -> None:
    """A model whose ``loss`` is a plain number gets fa.step's TypeError naming the fix,
    not an AttributeError from deep inside the backward."""

    class NumberLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> dict[str, float]:
            return {"loss": float(self.linear(x).detach().sum())}

    model = NumberLoss()
    state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"neither a scalar loss nor has a \.loss tensor; pass loss_fn="):
        fa.step(state, {"x": torch.ones(2, 8)})


def test_default_pipeline_follows_the_launch_precision() -> None:
    state = fa.init(cpu=True, mixed_precision="bf16")
    model = make_model()
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert repr(state.pipeline) == "compose(autocast(dtype=torch.bfloat16))"


def test_default_pipeline_nested_in_compose_adds_a_transform_and_keeps_the_launchs(tmp_path: Any) -> None:
    """The launch asked for fp16 with a dynamo backend: adding accumulate(2) to
    fa.default_pipeline(state) keeps both (accumulate goes before compile), fa.prepare
    says nothing about a dropped precision, and the scaler fp16 needs is added."""
    import warnings

    config = tmp_path / "config.yaml"
    config.write_text("dynamo_config:\n  dynamo_backend: AOT_EAGER\n")
    state = fa.init(seed=0, cpu=True, mixed_precision="fp16", config=str(config))
    launch = fa.default_pipeline(state)
    assert launch.names == ("autocast", "compile")
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=loss_fn,
            pipeline=fa.compose(fa.default_pipeline(state), fa.accumulate(2)),
        )
    assert state.pipeline is not None
    assert isinstance(state.pipeline, fa.Pipeline)
    assert state.pipeline.names == ("autocast", "grad_scaler", "accumulate", "compile")
    assert state.plan is not None and state.plan.micro_steps == 2


def test_compile_matches_eager_bit_for_bit() -> None:
    batches = make_batches(4)
    eager_model, compiled_model = make_model(dropout=0.0), make_model(dropout=0.0)
    eager = fa.prepare(
        fa.init(seed=0, cpu=True),
        eager_model,
        torch.optim.SGD(eager_model.parameters(), lr=0.1),
        loss_fn=loss_fn,
    )
    compiled = fa.prepare(
        fa.init(seed=0, cpu=True),
        compiled_model,
        torch.optim.SGD(compiled_model.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.compile(backend="aot_eager")),
    )
    assert type(compiled.model).__name__ == "OptimizedModule"
    for batch in batches:
        eager, _ = fa.step(eager, batch)
        compiled, _ = fa.step(compiled, batch)
    for p, q in zip(compiled_model.parameters(), eager_model.parameters(), strict=False):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        fa.compile(backend="nope")


def test_profile_writes_a_chrome_trace_per_rank(tmp_path: Any) -> None:
    import json

    model = make_model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.profile(output_trace_dir=str(tmp_path))),
    )
    for batch in make_batches(3):
        state, _ = fa.step(state, batch)
    assert state.resources.get("transform:profile") is state.transform_states["profile"]  # one owner
    fa.shutdown(state)
    fa.shutdown(state)  # idempotent
    trace = json.loads((tmp_path / "profile_0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names  # the steps' linear layers were recorded


def _token_batches(num: int, seed: int = 9) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Sequences of 6 positions whose valid length varies: a token-count loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        x = torch.randn(4, 6, 8, generator=g)
        y = torch.randint(0, 4, (4, 6), generator=g)
        lengths = torch.randint(1, 7, (4,), generator=g)
        mask = torch.arange(6)[None, :] < lengths[:, None]
        out.append((x, y, mask))
    return out


def token_loss_sum(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y, mask = batch
    per_token = nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
    return (per_token * mask).sum(), {"num_items": mask.sum()}


def test_accumulate_normalised_by_items_equals_the_mean_over_all_tokens() -> None:
    batches = _token_batches(6)
    ref = make_model(dropout=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in range(0, 6, 3):  # one update per 3 micro-batches: mean over all their tokens
        group = batches[i : i + 3]
        total = sum(
            loss_sum_tokens[1]["num_items"] for loss_sum_tokens in [token_loss_sum(ref, b) for b in group]
        )
        loss = sum(token_loss_sum(ref, b)[0] for b in group) / total
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = make_model(dropout=0.0)
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        loss_fn=token_loss_sum,
        pipeline=fa.compose(fa.accumulate(3, normalize="items")),
    )
    for batch in batches:
        state, _ = fa.step(state, batch)
    assert state.step == 2
    for p, q in zip(model.parameters(), ref.parameters(), strict=False):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    plain = make_model()
    bad = fa.prepare(
        fa.init(cpu=True),
        plain,
        torch.optim.SGD(plain.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.accumulate(2, normalize="items")),
    )
    with pytest.raises(ValueError, match="num_items"):  # the loss function gave no item count
        fa.step(bad, make_batches(1)[0])


def test_accumulate_by_items_reports_the_windows_per_item_loss_as_a_hand_loop_prints_it(
    tmp_path: Any,
) -> None:
    """metrics["loss"] is the window's loss per item (what a token-normalised hand loop
    prints), not the micro-batch's summed loss; "loss_sum" and "num_items" hold the window's
    sum and item count so far. Device tensors; a save mid-window resumes them."""
    batches = _token_batches(6)
    ref = make_model(dropout=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    printed = []  # (loss per token so far, summed loss so far, tokens so far) after each micro-batch
    for i in range(0, 6, 3):
        window = batches[i : i + 3]
        num_tokens = sum(int(mask.sum()) for _, _, mask in window)
        summed, seen = 0.0, 0
        for x, y, mask in window:
            per_token = nn.functional.cross_entropy(ref(x).transpose(1, 2), y, reduction="none")
            loss_sum = (per_token * mask).sum()
            (loss_sum / num_tokens).backward()
            summed, seen = summed + loss_sum.item(), seen + int(mask.sum())
            printed.append((summed / seen, summed, seen))
        ref_opt.step()
        ref_opt.zero_grad()

    def fresh() -> fa.RunState:
        model = make_model(dropout=0.0)
        return fa.prepare(
            fa.init(seed=0, cpu=True),
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            loss_fn=token_loss_sum,
            pipeline=fa.compose(fa.accumulate(3, normalize="items")),
        )

    state, reported = fresh(), []
    for i, batch in enumerate(batches):
        state, metrics = fa.step(state, batch)
        assert all(isinstance(metrics[key], torch.Tensor) for key in ("loss", "loss_sum", "num_items"))
        reported.append((metrics["loss"].item(), metrics["loss_sum"].item(), metrics["num_items"].item()))
        if i == 3:
            fa.save(state, tmp_path / "mid_window")
    for (loss, loss_sum, num_items), (want_loss, want_sum, want_items) in zip(reported, printed, strict=True):
        assert num_items == want_items
        assert loss == pytest.approx(want_loss, rel=1e-6) and loss_sum == pytest.approx(want_sum, rel=1e-6)
    assert reported[2][0] < 10 < reported[2][1]  # per token, not the window's sum

    resumed = fa.load(fresh(), tmp_path / "mid_window")
    for i, batch in enumerate(batches[4:], start=4):
        resumed, metrics = fa.step(resumed, batch)
        assert (metrics["loss"].item(), metrics["loss_sum"].item(), metrics["num_items"].item()) == reported[
            i
        ]
    with pytest.raises(ValueError, match="saved loss_sum must be a finite number or null, got 'x'"):
        resumed.transform_states["accumulate"].load_state_dict({"total": 3.0, "loss_sum": "x"})


def test_a_model_on_the_meta_device_is_refused_before_anything_moves() -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'weight' is on the meta device.*load_checkpoint_in_model"):
        fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_explicit_pipeline_that_drops_the_launch_precision_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    state = fa.init(seed=0, cpu=True, mixed_precision="bf16")
    with pytest.warns(UserWarning, match="asked for mixed_precision bf16.*the pipeline wins"):
        fa.prepare(state, model, pipeline=fa.compose(fa.clip_grad_norm(1.0)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same precision, or autocast switched off: nothing to say
        off = fa.init(
            seed=0, cpu=True, mixed_precision="bf16", kwargs_handlers=[fa.AutocastKwargs(enabled=False)]
        )
        fa.prepare(off, nn.Linear(2, 2), pipeline=fa.compose(fa.clip_grad_norm(1.0)))
        fa.prepare(
            fa.init(seed=0, cpu=True, mixed_precision="bf16"),
            nn.Linear(2, 2),
            pipeline=fa.compose(fa.autocast(fa.bf16)),
        )
        fa.prepare(fa.init(seed=0, cpu=True), nn.Linear(2, 2), pipeline=fa.compose(fa.autocast(fa.bf16)))


def test_the_launch_warning_asks_what_the_pipeline_declares_not_its_names() -> None:
    """A launch for DeepSpeed is satisfied by any engine (`fa.EngineTransform`), an
    fp16 launch by any transform declaring fp16 `Precision`: no name is looked for."""
    import warnings

    from fnaccel.transforms.declared import Precision

    deepspeed_launch = fa.LaunchConfig(distributed_type="DEEPSPEED")
    with pytest.warns(UserWarning, match="the launch asked for DeepSpeed"):
        fa.prepare(fa.init(seed=0, cpu=True, config=deepspeed_launch), nn.Linear(2, 2), pipeline=fa.compose())
    engine = fa.EngineTransform(
        name="my_engine", prepare_engine=lambda request: (request.model, request.optimizer)
    )
    fp16 = fa.Transform(
        name="my_half",
        settings=Precision(precision=fa.PrecisionType.FP16, dtype=torch.float16),
        capabilities=frozenset({fa.Capability.SCALES_LOSS}),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.prepare(
            fa.init(seed=0, cpu=True, config=deepspeed_launch), nn.Linear(2, 2), pipeline=fa.compose(engine)
        )
        fa.prepare(
            fa.init(seed=0, cpu=True, mixed_precision="fp16"), nn.Linear(2, 2), pipeline=fa.compose(fp16)
        )


def test_autocast_kwargs_enabled_false_leaves_autocast_out() -> None:
    state = fa.init(
        seed=0, cpu=True, mixed_precision="bf16", kwargs_handlers=[fa.AutocastKwargs(enabled=False)]
    )
    assert repr(fa.prepare(state, nn.Linear(2, 2)).pipeline) == "compose()"


def test_an_optimizer_prepared_later_may_hold_parameters_of_its_own() -> None:
    model = nn.Linear(2, 2)
    state = fa.prepare(fa.init(seed=0, cpu=True), model)
    temperature = nn.Parameter(torch.ones(()))
    state = fa.prepare(state, optimizer=torch.optim.SGD([*model.parameters(), temperature], lr=0.1))
    assert state.optimizer is not None  # no fsdp(): nothing replaced the model's parameters


class _CountingSGD(torch.optim.SGD):
    """An optimizer with a zero_grad of its own (counted), which fa.step must call."""

    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).calls += 1
        super().zero_grad(set_to_none=set_to_none)


def test_a_window_starts_with_every_gradient_cleared_as_zero_grad_does() -> None:
    model, extra = make_model(), torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.add_param_group({"params": [extra]})  # a group added after the optimizer was built
    state = fa.prepare(fa.init(seed=0, cpu=True), model, optimizer, loss_fn=loss_fn)
    stale = [torch.full_like(p, 7.0) for p in (*model.parameters(), extra)]
    for p, g in zip((*model.parameters(), extra), stale, strict=False):
        p.grad = g  # what other code left on the parameters
    state, _ = fa.step(state, make_batches(1)[0])
    assert extra.grad is None  # cleared, and this loss does not reach it
    assert all(
        p.grad is not None and not torch.equal(p.grad, g)
        for p, g in zip(model.parameters(), stale, strict=False)
    )

    _CountingSGD.calls = 0
    counted = make_model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        counted,
        _CountingSGD(counted.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.accumulate(2)),
    )
    for batch in make_batches(4):
        state, _ = fa.step(state, batch)
    assert _CountingSGD.calls == 2  # once per accumulation window, its own zero_grad
