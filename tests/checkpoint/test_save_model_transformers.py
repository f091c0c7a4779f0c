"""`fa.save_model` of a transformers model loads with `from_pretrained`: the model's
config (and generation config) is written beside the weights, by the main process.

Tiny models built from configs in the test (no download); trained one step on 2
real gloo processes under DDP, `fa.fsdp()` and ZeRO-3, then reloaded in this process
and compared logit for logit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the test extra has it)"
)

VOCAB, SEQ = 100, 16


def make_model(kind: str) -> Any:
    """A tiny model of ``kind``, its initial weights from the process generator seeded here."""
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            num_labels=3,
        )
        return transformers.BertForSequenceClassification(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def model_class(kind: str) -> Any:
    return transformers.BertForSequenceClassification if kind == "bert" else transformers.GPT2LMHeadModel


def batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    labels = torch.randint(0, 3, (4,), generator=g) if kind == "bert" else ids
    return {"input_ids": ids, "labels": labels}


def hf_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


ENGINES: dict[str, Callable[[], fa.Transform]] = {
    "ddp": fa.ddp,
    "fsdp": fa.fsdp,
    "zero3": lambda: fa.deepspeed(zero_stage=3),
}


def train_and_save(state: fa.RunState, kind: str, engine: str, path: str) -> torch.Tensor | None:
    """One step on each rank's own batch, `fa.save_model`, and the trained model's logits
    on a probe batch (returned by the main process)."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipeline = fa.compose(ENGINES[engine]())
    state = fa.prepare(state, model, optimizer, pipeline=pipeline, loss_fn=hf_loss)
    state, _ = fa.step(state, batch(kind, seed=state.dist.rank))
    fa.save_model(state, path)
    model.eval()  # sharded (fsdp, ZeRO-3), the forward is a collective: every rank runs it
    with torch.no_grad():
        logits = model(input_ids=batch(kind, seed=99)["input_ids"]).logits
    return logits if state.dist.is_main_process else None


CASES = [("bert", "ddp"), ("bert", "fsdp"), ("gpt2", "ddp"), ("gpt2", "fsdp"), ("gpt2", "zero3")]


@pytest.mark.parametrize(("kind", "engine"), CASES, ids=["-".join(case) for case in CASES])
def test_from_pretrained_loads_fa_save_model_bit_identically(
    world2: Any, tmp_path: Path, kind: str, engine: str
) -> None:
    if engine == "zero3":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the test extra has it)")
    trained, other = world2.run(train_and_save, kind, engine, str(tmp_path))
    assert other is None
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors"} <= files
    assert ("generation_config.json" in files) == (kind == "gpt2")  # BERT cannot generate
    assert not [name for name in files if name.startswith(".")]  # no staging left behind
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [model_class(kind).__name__]

    loaded = model_class(kind).from_pretrained(tmp_path)
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=batch(kind, seed=99)["input_ids"]).logits
    assert torch.equal(logits, trained)
    assert not torch.equal(trained, _untrained_logits(kind))  # the step did change the weights


def _untrained_logits(kind: str) -> torch.Tensor:
    model = make_model(kind).eval()
    with torch.no_grad():
        return model(input_ids=batch(kind, seed=99)["input_ids"]).logits


def test_one_process_save_model_writes_the_config_and_keeps_other_files(tmp_path: Path) -> None:
    """In one process too; a second save replaces the config and leaves a user's file alone."""
    (tmp_path / "tokenizer.json").write_text("{}")
    model = make_model("gpt2")
    state = fa.prepare(fa.init(cpu=True), model)
    fa.save_model(state, tmp_path)
    model.config.n_layer_note = "second save"  # an extra key, as a user may set on a config
    fa.save_model(state, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["n_layer_note"] == "second save"
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    ids = batch("gpt2", seed=1)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


class _JsonOnlyConfig:
    """A config that only serialises itself (no save_pretrained): the duck-typed fallback."""

    def to_json_string(self) -> str:
        return '{"model_type": "custom"}\n'


def test_a_config_with_only_to_json_string_is_written_as_config_json(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    model.config = _JsonOnlyConfig()  # type: ignore[assignment]
    fa.save_model(fa.prepare(fa.init(cpu=True), model), tmp_path)
    assert (tmp_path / "config.json").read_text() == '{"model_type": "custom"}\n'
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
