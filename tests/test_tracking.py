"""Tracking: what `log` writes, when it reads the device, and where."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.tracking import (
    GeneralTracker,
    JSONLTracker,
    end_training,
    get_tracker,
    init_trackers,
    log,
)
from fnaccel.tracking.values import _to_cpu_at_once, read_values

_READS = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.numpy,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__bool__,
        torch.Tensor.__index__,
    }
)


def _counting_tensor_class(counted: frozenset[Any] = _READS) -> tuple[type[torch.Tensor], list[str]]:
    """A tensor class that records every read of its values into host memory (every call of ``counted``)."""
    reads: list[str] = []

    class Counted(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in counted:
                reads.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    return Counted, reads


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _as_rank(state: fa.RunState, rank: int) -> fa.RunState:
    return state.replace(dist=dataclasses.replace(state.dist, rank=rank, num_processes=2))


def test_jsonl_holds_what_was_logged_at_its_step(tmp_path: Path) -> None:
    state = fa.init(cpu=True, project_dir=tmp_path)
    state = init_trackers(state, "exp", {"lr": 0.1, "path": tmp_path, "layers": [2, 3]})
    loss = torch.tensor(0.5)
    log(state, {"loss": loss, "count": torch.tensor(7), "ok": torch.tensor(True)})
    loss.add_(1.0)  # the line is a snapshot taken at the call
    state = state.replace(step=5)
    log(state, {"loss": loss, "lr": 1e-3, "phase": "warm", "group": {"a": torch.tensor(2.0)}})
    log(state, {"loss": 0.25}, step=9)
    end_training(state)

    lines = _lines(tmp_path / "exp" / "metrics.jsonl")
    for line in lines:
        assert isinstance(line.pop("time"), float)
    assert lines == [
        {"step": 0, "values": {"loss": 0.5, "count": 7, "ok": True}},
        {"step": 5, "values": {"loss": 1.5, "lr": 1e-3, "phase": "warm", "group": {"a": 2.0}}},
        {"step": 9, "values": {"loss": 0.25}},
    ]
    assert isinstance(lines[0]["values"]["count"], int)
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config == {"lr": 0.1, "path": str(tmp_path), "layers": [2, 3]}


def test_log_reads_every_tensor_with_one_transfer(tmp_path: Path) -> None:
    Counted, reads = _counting_tensor_class()
    state = init_trackers(fa.init(cpu=True), "exp", logging_dir=tmp_path)
    values = {
        "loss": torch.tensor(1.25).as_subclass(Counted),
        "half": torch.tensor([0.5], dtype=torch.bfloat16).as_subclass(Counted),
        "steps": torch.tensor(3).as_subclass(Counted),
        "nested": {"norm": torch.tensor(2.0, requires_grad=True).as_subclass(Counted)},
    }
    log(state, values)
    assert reads == ["tolist"]
    log(state, values)
    assert reads == ["tolist", "tolist"]  # one per call, whatever the number of tensors
    end_training(state)
    first = _lines(tmp_path / "exp" / "metrics.jsonl")[0]["values"]
    assert (first["loss"], first["half"], first["steps"], first["nested"]) == (1.25, 0.5, 3, {"norm": 2.0})


_ODD_VALUES = (2**40 + 1, True, -7, 0.1, 1 / 3, 1 / 3)
_ODD_DTYPES = (torch.int64, torch.bool, torch.int8, torch.bfloat16, torch.float16, torch.float32)


def test_values_can_cross_to_the_host_as_bytes_in_one_transfer() -> None:
    # MPS has no float64, so there the values cross before the upcast, this way; checked on the CPU
    Counted, moves = _counting_tensor_class(_READS | {torch.Tensor.cpu, torch.Tensor.to})
    tensors = [
        torch.tensor(v, dtype=d).as_subclass(Counted) for v, d in zip(_ODD_VALUES, _ODD_DTYPES, strict=False)
    ]
    host = _to_cpu_at_once(tensors)
    assert moves == ["cpu"]
    assert [(t.dtype, t.shape) for t in host] == [(d, torch.Size([])) for d in _ODD_DTYPES]
    assert all(
        torch.equal(h.as_subclass(torch.Tensor), t.as_subclass(torch.Tensor))
        for h, t in zip(host, tensors, strict=False)
    )


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an MPS device")
def test_values_on_mps_are_read_exactly() -> None:
    tensors = {
        f"v{i}": torch.tensor(v, dtype=d)
        for i, (v, d) in enumerate(zip(_ODD_VALUES, _ODD_DTYPES, strict=False))
    }
    assert read_values({k: t.to("mps") for k, t in tensors.items()}) == read_values(tensors)


def test_other_processes_open_nothing_and_read_nothing(tmp_path: Path) -> None:
    Counted, reads = _counting_tensor_class()
    state = init_trackers(_as_rank(fa.init(cpu=True), 1), "exp", logging_dir=tmp_path)
    assert state.trackers == ()
    log(state, {"loss": torch.tensor(1.0).as_subclass(Counted)})
    assert reads == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="main process only"):
        get_tracker(state, "jsonl")
    end_training(state)


def _log_on_every_rank(state: fa.RunState, directory: str) -> int:
    state = init_trackers(state, "dist", {"world": state.dist.num_processes}, logging_dir=directory)
    log(state, {"rank": state.dist.rank, "loss": torch.tensor(float(state.dist.rank))}, step=1)
    end_training(state)
    return len(state.trackers)


def test_only_the_main_process_writes_in_a_real_world(world2: Any, tmp_path: Path) -> None:
    assert world2.run(_log_on_every_rank, str(tmp_path)) == [1, 0]
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == ["config.json", "metrics.jsonl"]
    (line,) = _lines(tmp_path / "dist" / "metrics.jsonl")
    assert (line["values"], line["step"]) == ({"rank": 0, "loss": 0.0}, 1)


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    state = fa.init(cpu=True, project_dir=tmp_path)
    state = init_trackers(
        state,
        "tb",
        {"lr": 0.1, "name": "mlp"},
        log_with="tensorboard",
        init_kwargs={"tensorboard": {"flush_secs": 5}},
    )
    assert isinstance(get_tracker(state, "tensorboard", unwrap=True), SummaryWriter)
    for step in (1, 2):
        log(
            state.replace(step=step),
            {
                "loss": torch.tensor(1.0 / step),
                "note": f"step {step}",
                "acc": {"train": 0.5 * step, "test": 0.25 * step},
            },
        )
    end_training(state)

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5)]
    assert "note/text_summary" in events.Tags()["tensors"]
    test_acc = EventAccumulator(str(tmp_path / "tb" / "acc_test"))
    test_acc.Reload()
    assert [(e.step, e.value) for e in test_acc.Scalars("acc")] == [(1, 0.25), (2, 0.5)]


# what transformers' run_clm_no_trainer and run_glue_no_trainer log each epoch (Accelerate takes them)
_CLM = {
    "perplexity": 15.2,
    "eval_loss": torch.tensor(2.72),
    "train_loss": torch.tensor(2.9),
    "epoch": 0,
    "step": 12,
}
_GLUE = {"accuracy": 0.6505, "train_loss": torch.tensor(0.61), "epoch": 1, "step": 26}


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {
        tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_the_transformers_scripts_dicts_are_logged_step_included(tmp_path: Path) -> None:
    """``step`` is a value like any other (the scripts log ``completed_steps`` under it): the
    JSONL line keeps it apart from the logging step, and TensorBoard records it as the
    scalar ``step``, as Accelerate's own TensorBoard tracker does with the same dicts."""
    from accelerate.tracking import TensorBoardTracker as AccelerateTensorBoard

    state = init_trackers(fa.init(cpu=True), "run", log_with=["jsonl", "tensorboard"], logging_dir=tmp_path)
    log(state.replace(step=3), _CLM)
    log(state, _GLUE, step=7)
    end_training(state)

    lines = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [(line["step"], line["values"]) for line in lines] == [
        (
            3,
            {
                "perplexity": 15.2,
                "eval_loss": pytest.approx(2.72),
                "train_loss": pytest.approx(2.9),
                "epoch": 0,
                "step": 12,
            },
        ),
        (7, {"accuracy": 0.6505, "train_loss": pytest.approx(0.61), "epoch": 1, "step": 26}),
    ]
    theirs = AccelerateTensorBoard("run", tmp_path / "accelerate")
    theirs.start()  # what Accelerator.init_trackers calls
    theirs.log({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in _CLM.items()}, step=3)
    theirs.log({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in _GLUE.items()}, step=7)
    theirs.finish()
    ours = _scalars(tmp_path / "run")
    assert ours["step"] == [(3, 12.0), (7, 26.0)] and ours["accuracy"] == [(7, 0.6505)]
    assert ours == _scalars(tmp_path / "accelerate" / "run")


_SERVICES = ("wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")


def test_all_means_every_installed_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in _SERVICES:  # as if not installed: "all" would open them too (online, for most)
        monkeypatch.setitem(sys.modules, module, None)
    state = init_trackers(fa.init(cpu=True), "exp", log_with="all", logging_dir=tmp_path)
    assert [t.name for t in state.trackers] == ["jsonl", "tensorboard"]
    end_training(state)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    state = init_trackers(state, "exp2", log_with=fa.utils.LoggerType.ALL, logging_dir=tmp_path)
    assert [t.name for t in state.trackers] == ["jsonl"]
    end_training(state)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        init_trackers(state, "exp3", log_with="tensorboard", logging_dir=tmp_path)


@pytest.mark.parametrize(
    ("log_with", "error", "match"),
    [
        ("jsnol", ValueError, "'jsnol' is not a tracker; use one of 'jsonl', 'tensorboard', 'wandb'.*'all'"),
        (["jsonl", "JSONL"], ValueError, "'jsonl' twice"),
        ([], ValueError, "log_with is empty"),
        ([3], TypeError, "tracker names or GeneralTracker objects, got int"),
    ],
)
def test_bad_tracker_names_say_what_to_do(
    tmp_path: Path, log_with: Any, error: type[Exception], match: str
) -> None:
    for rank in (0, 1):  # every rank rejects them alike, so none is left waiting
        with pytest.raises(error, match=match):
            init_trackers(_as_rank(fa.init(cpu=True), rank), "exp", log_with=log_with, logging_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_misuse_is_reported(tmp_path: Path) -> None:
    state = fa.init(cpu=True)
    with pytest.raises(ValueError, match="no directory to write to"):
        init_trackers(state, "exp")
    with pytest.raises(ValueError, match="init_kwargs has keys \\['tensorboard'\\]"):
        init_trackers(state, "exp", logging_dir=tmp_path, init_kwargs={"tensorboard": {}})
    with pytest.raises(TypeError, match="vars\\(args\\)"):
        init_trackers(state, "exp", config=[("lr", 1)], logging_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="call state = fa.init_trackers"):
        log(state, {"loss": 1.0})

    state = init_trackers(state, "exp", logging_dir=tmp_path)
    with pytest.raises(TypeError, match="'a/b' is a tensor of shape \\(2,\\).*\\.mean\\(\\)"):
        log(state, {"a": {"b": torch.ones(2)}})
    with pytest.raises(TypeError, match="'x' is of type object; log numbers, strings"):
        log(state, {"x": object()})
    with pytest.raises(TypeError, match="step must be an int"):
        log(state, {"x": 1.0}, step=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tracker named 'tensorboard'.*\\['jsonl'\\]"):
        get_tracker(state, "tensorboard")
    end_training(state)
    with pytest.raises(ValueError, match="was closed"):
        log(state, {"x": 1.0})
    assert (tmp_path / "exp" / "metrics.jsonl").read_text() == ""


class ListTracker:
    """A user's own tracker: keeps what it is given."""

    name = "memory"

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = 0

    @property
    def tracker(self) -> list[tuple[int, dict[str, Any]]]:
        return self.logged

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.config = dict(values)

    def log(self, values: Mapping[str, Any], step: int) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished += 1


def test_a_user_tracker_gets_plain_values(tmp_path: Path) -> None:
    mine = ListTracker()
    assert isinstance(mine, GeneralTracker)
    state = init_trackers(
        fa.init(cpu=True), "exp", {"lr": 0.1}, log_with=[mine, "jsonl"], logging_dir=tmp_path
    )
    log(state, {"loss": torch.tensor(0.5)}, step=2)
    assert mine.config == {"lr": 0.1} and mine.logged == [(2, {"loss": 0.5})]
    assert get_tracker(state, "memory") is mine and get_tracker(state, "memory", unwrap=True) is mine.logged
    # a second init_trackers replaces the trackers, closing the old ones
    old_jsonl = get_tracker(state, "jsonl")
    assert isinstance(old_jsonl, JSONLTracker)
    state = init_trackers(state, "exp", log_with=ListTracker(), logging_dir=tmp_path)
    assert mine.finished == 1 and old_jsonl.tracker.closed
    end_training(state)


class JSONLinesTracker(ListTracker):
    """A user's tracker as commonly written: it serialises what it gets, and adds its own key."""

    name = "lines"

    def log(self, values: Mapping[str, Any], step: int) -> None:
        values["source"] = self.name  # type: ignore[index]  # Accelerate's trackers get a dict
        self.logged.append((step, json.loads(json.dumps(values))))


def test_each_user_tracker_gets_its_own_plain_dict(tmp_path: Path) -> None:
    """Accelerate hands a tracker a dict; `json.dumps(values)` failed on the read-only view fa.log
    passed ("Object of type mappingproxy is not JSON serializable"). One tracker's edits must not
    reach the next one."""
    first, second = JSONLinesTracker(), ListTracker()
    state = init_trackers(fa.init(cpu=True), "exp", log_with=[first, second], logging_dir=tmp_path)
    log(state, {"loss": torch.tensor(0.5)}, step=1)
    assert first.logged == [(1, {"loss": 0.5, "source": "lines"})]
    assert second.logged == [(1, {"loss": 0.5})]
    end_training(state)


def test_only_a_user_tracker_needs_no_directory() -> None:
    state = init_trackers(fa.init(cpu=True), "exp", log_with=ListTracker())
    log(state, {"x": 1})
    assert state.trackers[0].tracker == [(0, {"x": 1})]


def test_the_logging_directory_follows_the_project(tmp_path: Path) -> None:
    project = fa.ProjectConfiguration(project_dir=str(tmp_path / "proj"), logging_dir=str(tmp_path / "logs"))
    state = init_trackers(fa.init(cpu=True, kwargs_handlers=[project]), "a")
    assert get_tracker(state, "jsonl").path == tmp_path / "logs" / "a" / "metrics.jsonl"
    end_training(state)
    state = init_trackers(fa.init(cpu=True, project_dir=tmp_path), "b", logging_dir="logs")
    assert get_tracker(state, "jsonl").path == tmp_path / "logs" / "b" / "metrics.jsonl"
    end_training(state)


def test_trackers_travel_with_the_run(tmp_path: Path) -> None:
    state = init_trackers(fa.init(cpu=True), "exp", logging_dir=tmp_path)
    successor = state.advance("a test", step=1)
    assert successor.trackers is state.trackers
    log(successor, {"x": 1.0})
    end_training(successor)
    assert _lines(tmp_path / "exp" / "metrics.jsonl")[0]["step"] == 1


def test_a_resumed_run_adds_to_its_config_and_metrics(tmp_path: Path) -> None:
    first = init_trackers(fa.init(cpu=True), "exp", {"lr": 0.1, "epochs": 3}, logging_dir=tmp_path)
    log(first, {"loss": 1.0}, step=1)
    end_training(first)
    # the resumed run: a new process, the same project; it changes one value and adds one
    resumed = init_trackers(
        fa.init(cpu=True), "exp", {"lr": 0.05, "resumed_from": "ckpt"}, logging_dir=tmp_path
    )
    log(resumed, {"loss": 0.5}, step=2)
    end_training(resumed)
    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert config == {"lr": 0.05, "epochs": 3, "resumed_from": "ckpt"}
    assert [(line["step"], line["values"]) for line in _lines(tmp_path / "exp" / "metrics.jsonl")] == [
        (1, {"loss": 1.0}),
        (2, {"loss": 0.5}),
    ]
    (tmp_path / "exp" / "config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="config.json is not valid JSON.*repair or remove it"):
        init_trackers(fa.init(cpu=True), "exp", {"lr": 0.1}, logging_dir=tmp_path)


class DirectoryTracker(ListTracker):
    """A user's tracker class, made per run by init_trackers from the registered name."""

    name = "mine"

    def __init__(self, run_name: str, logging_dir: str, *, label: str = "") -> None:
        super().__init__()
        self.where = (run_name, Path(logging_dir), label)


def test_a_registered_class_is_named_like_a_built_in_tracker(tmp_path: Path) -> None:
    from fnaccel.tracking import register_tracker

    base = fa.init(cpu=True)
    state = register_tracker(base, "mine", DirectoryTracker)
    state = init_trackers(
        state,
        "exp",
        {"lr": 0.1},
        log_with=["mine", "jsonl"],
        logging_dir=tmp_path,
        init_kwargs={"mine": {"label": "a"}},
    )
    log(state, {"loss": torch.tensor(0.5)}, step=4)
    mine = get_tracker(state, "mine")
    assert isinstance(mine, DirectoryTracker) and mine.where == ("exp", tmp_path, "a")
    assert mine.config == {"lr": 0.1} and mine.logged == [(4, {"loss": 0.5})]
    end_training(state)
    with pytest.raises(ValueError, match="'mine' is not a tracker"):  # the state from before has no such name
        init_trackers(base, "exp", log_with="mine", logging_dir=tmp_path)
    with pytest.raises(ValueError, match="'wandb' is a built-in tracker's name"):
        register_tracker(base, "wandb", DirectoryTracker)
    with pytest.raises(TypeError, match="takes a class.*pass an object in log_with"):
        register_tracker(base, "mine", DirectoryTracker("x", "y"))  # type: ignore[arg-type]


def test_register_tracker_class_takes_the_name_from_the_class(tmp_path: Path) -> None:
    """Accelerate 1.15's register_tracker_class(tracker_class), the state first."""
    from fnaccel.utils import register_tracker_class

    class Named(DirectoryTracker):
        name = "named"

    base = fa.init(cpu=True)
    state = init_trackers(register_tracker_class(base, Named), "exp", log_with="named", logging_dir=tmp_path)
    log(state, {"loss": 1.0}, step=1)
    assert isinstance(get_tracker(state, "named"), Named) and get_tracker(state, "named").logged == [
        (1, {"loss": 1.0})
    ]
    end_training(state)

    class Nameless:
        pass

    with pytest.raises(TypeError, match="Nameless has no string class attribute 'name'.*register_tracker"):
        register_tracker_class(base, Nameless)
    with pytest.raises(TypeError, match="takes a class"):
        register_tracker_class(base, Named("x", "y"))  # type: ignore[arg-type]


def test_a_tracker_without_its_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "swanlab", None)
    for rank in (0, 1):  # every rank, before any opens a file
        with pytest.raises(ImportError, match="pip install swanlab \\(or fnaccel\\[swanlab\\]\\)"):
            init_trackers(_as_rank(fa.init(cpu=True), rank), "exp", log_with="swanlab", logging_dir=tmp_path)
