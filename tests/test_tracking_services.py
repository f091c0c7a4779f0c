"""The service trackers, each through its real package in its offline or local mode.

Each test skips, naming the package, where the extra is not installed (CI
installs the `test` extra only; see docs/tracking.md for which are in it).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fnaccel as fa
from fnaccel.tracking import end_training, get_tracker, init_trackers, log

CONFIG = {"lr": 0.1, "optimizer": "sgd"}
IMAGE = np.zeros((8, 8, 3), dtype=np.uint8)


def _run(tmp_path: Path, tracker: str, **init: Any) -> fa.RunState:
    """Opens the tracker, logs two steps (device-style tensors, a string) and returns the state."""
    state = init_trackers(
        fa.init(cpu=True),
        "exp",
        CONFIG,
        log_with=tracker,
        init_kwargs={tracker: init} if init else None,
        logging_dir=tmp_path,
    )
    log(state, {"loss": torch.tensor(0.5), "phase": "warmup"}, step=1)
    log(state, {"loss": torch.tensor(0.25), "acc": {"train": 0.75}}, step=2)
    return state


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb", reason="needs wandb (pip install fnaccel[wandb])")
    monkeypatch.setenv("WANDB_SILENT", "true")
    state = _run(tmp_path, "wandb", mode="offline")
    tracker = get_tracker(state, "wandb")
    tracker.log_images({"sample": IMAGE}, step=2)
    tracker.log_table("preds", columns=["id", "label"], data=[[0, "cat"], [1, "dog"]], step=2)
    run = get_tracker(state, "wandb", unwrap=True)
    assert dict(run.config) == CONFIG
    log(state, {"done": 1}, step=3)  # wandb commits a step's row once the run moves past it
    summary = dict(run.summary)
    assert (summary["loss"], dict(summary["acc"]), summary["phase"]) == (0.25, {"train": 0.75}, "warmup")
    assert summary["sample"]["_type"] == "image-file" and summary["preds"]["_type"] == "table-file"
    end_training(state)
    wandb.teardown()  # the wandb service process ends with the test
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_mlflow_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow", reason="needs mlflow-skinny (pip install fnaccel[mlflow])")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = _run(tmp_path, "mlflow")
    tracker = get_tracker(state, "mlflow")
    tracker.log_images({"sample": IMAGE}, step=2)
    end_training(state)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # read back by a client of its own
    run = client.get_run(tracker.run_id)
    assert run.data.params == {"lr": "0.1", "optimizer": "sgd"} and run.info.status == "FINISHED"
    assert run.data.tags["phase"] == "warmup"
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [
        (1, 0.5),
        (2, 0.25),
    ]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "acc/train")] == [(2, 0.75)]
    artifacts = [a.path for a in client.list_artifacts(tracker.run_id, "images")]
    assert artifacts and all("sample" in a for a in artifacts)
    assert any((tmp_path / "mlartifacts").rglob("*.png"))  # under logging_dir, not the working directory


def test_comet_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comet_ml = pytest.importorskip("comet_ml", reason="needs comet_ml (pip install fnaccel[cometml])")
    from PIL import Image  # comet converts numpy arrays to images only with matplotlib installed

    # no environment logging: it would probe the cloud providers' metadata addresses
    quiet = comet_ml.ExperimentConfig(
        log_code=False,
        log_git_metadata=False,
        log_git_patch=False,
        log_env_details=False,
        log_env_host=False,
        log_env_cpu=False,
        log_env_gpu=False,
        log_env_network=False,
        log_env_disk=False,
        auto_log_co2=False,
        parse_args=False,
        auto_output_logging=False,
    )
    state = _run(tmp_path, "comet_ml", online=False, experiment_config=quiet)
    tracker = get_tracker(state, "comet_ml")
    tracker.log_images({"sample": Image.fromarray(IMAGE)}, step=2)
    tracker.log_table("preds", columns=["id", "label"], data=[[0, "cat"]], step=2)
    end_training(state)
    (archive,) = (tmp_path / "exp").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        names = z.namelist()
        text = "".join(z.read(name).decode() for name in names if name.endswith(".json"))
    for fragment in ('"loss"', "0.25", '"acc/train"', '"lr"', "sgd", '"phase"', "warmup"):
        assert fragment in text, fragment
    assert "sample" in text and "preds.csv" in text  # the image and the table, uploaded as assets
    assert len(set(names) - {"experiment.json", "messages.json"}) >= 2


def test_aim_local_repo(tmp_path: Path) -> None:
    pytest.importorskip("aim", reason="needs aim (pip install fnaccel[aim])")
    from aim.storage.context import Context

    state = _run(tmp_path, "aim")
    tracker = get_tracker(state, "aim")
    tracker.log_images({"sample": IMAGE}, step=2)
    run = tracker.run
    assert run["hparams"] == CONFIG
    loss = run.get_metric("loss", Context({}))
    assert loss.values.values_list() == [0.5, 0.25]
    assert run.get_metric("acc/train", Context({})).values.values_list() == [0.75]
    end_training(state)
    assert (tmp_path / ".aim" / "run_metadata.sqlite").is_file()


def test_clearml_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # ClearML's offline cache
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    clearml = pytest.importorskip("clearml", reason="needs clearml (pip install fnaccel[clearml])")
    state = _run(
        tmp_path,
        "clearml",
        auto_connect_frameworks=False,
        auto_resource_monitoring=False,
        auto_connect_streams=False,
    )
    tracker = get_tracker(state, "clearml")
    tracker.log_images({"sample": IMAGE}, step=2)
    tracker.log_table("preds", columns=["id", "label"], data=[[0, "cat"]], step=2)
    folder = Path(tracker.task.get_offline_mode_folder())
    end_training(state)
    assert clearml.Task.is_offline()
    events = "".join(p.read_text() for p in folder.rglob("*.json*") if p.is_file())
    for fragment in ('"loss"', "0.25", '"train"', "0.75", "sample", "preds"):
        assert fragment in events, fragment


def test_dvclive_local_files(tmp_path: Path) -> None:
    pytest.importorskip("dvclive", reason="needs dvclive (pip install fnaccel[dvclive])")
    import yaml

    state = _run(tmp_path, "dvclive")
    get_tracker(state, "dvclive").log_images({"sample": IMAGE}, step=2)
    end_training(state)
    out = tmp_path / "exp"
    assert yaml.safe_load((out / "params.yaml").read_text()) == {**CONFIG, "phase": "warmup"}
    rows = (out / "plots" / "metrics" / "loss.tsv").read_text().split()
    assert rows == ["step", "loss", "1", "0.5", "2", "0.25"]
    assert (out / "plots" / "metrics" / "acc" / "train.tsv").is_file()
    assert (out / "plots" / "images" / "sample.png").is_file()
    assert "plots/metrics" in (out / "dvc.yaml").read_text()  # beside the run, not at the repository's root


def test_swanlab_offline(tmp_path: Path) -> None:
    pytest.importorskip("swanlab", reason="needs swanlab (pip install fnaccel[swanlab])")
    state = _run(tmp_path, "swanlab", mode="offline")
    get_tracker(state, "swanlab").log_images({"sample": IMAGE}, step=2)
    end_training(state)
    (run_dir,) = tmp_path.glob("run-*")
    config = (run_dir / "files" / "config.yaml").read_text()
    assert "lr" in config and "sgd" in config
    (backup,) = run_dir.glob("*.swanlab")
    data = backup.read_bytes()
    for fragment in (b"loss", b"acc/train", b"phase", b"sample"):
        assert fragment in data, fragment


def test_trackio_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    pytest.importorskip("trackio", reason="needs trackio (pip install fnaccel[trackio])")
    from trackio.sqlite_storage import SQLiteStorage

    state = _run(tmp_path, "trackio", name="run-1")
    tracker = get_tracker(state, "trackio")
    tracker.log_images({"sample": IMAGE}, step=2)
    tracker.log_table("preds", columns=["id", "label"], data=[[0, "cat"]], step=2)
    end_training(state)
    logs = SQLiteStorage.get_logs("exp", "run-1")
    assert [(r["step"], r.get("loss")) for r in logs if "loss" in r] == [(1, 0.5), (2, 0.25)]
    assert any(r.get("acc/train") == 0.75 for r in logs)
    assert any("sample" in r for r in logs) and any("preds" in r for r in logs)
    assert SQLiteStorage.get_run_config("exp", "run-1")["lr"] == 0.1
