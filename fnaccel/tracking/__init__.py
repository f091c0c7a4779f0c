"""Experiment tracking for the main process: `init_trackers`, `log`, `end_training`.

Accelerate keeps its trackers on the `Accelerator`; here they live in the
run's value (`RunState.trackers`), opened by `init_trackers` on the main
process only, so two runs in one process log to their own places. A JSONL
tracker is built in; TensorBoard, Weights & Biases, MLflow, Comet, Aim,
ClearML, DVCLive, SwanLab and Trackio are optional extras (their real
packages); anything else is an object following `GeneralTracker`, or a class
named with `register_tracker`.

`log` takes metrics as they come out of `fa.step`, device tensors included,
and reads all of them with one device-to-host transfer per device per call
(principle 7: no sync the user did not ask for). Call it every N steps: each
call is a sync you asked for.

- `trackers.py`: the protocol, the JSONL and TensorBoard trackers, and how ``log_with`` names them.
- `hosted.py`, `stores.py`: the services' trackers; `common.py`: what they share.
- `registry.py`: `register_tracker`, a user's class under a name.
- `values.py`: turning the logged values into plain Python in one transfer.
- `run.py`: the functions over the state.
- `throughput.py`: tokens per second and MFU (`count_flops`, `throughput_meter`, `throughput`).
"""

from fnaccel.tracking.hosted import (
    ClearMLTracker,
    CometMLTracker,
    SwanLabTracker,
    TrackioTracker,
    WandBTracker,
)
from fnaccel.tracking.registry import register_tracker
from fnaccel.tracking.run import end_training, get_tracker, init_trackers, log
from fnaccel.tracking.stores import AimTracker, DVCLiveTracker, MLflowTracker
from fnaccel.tracking.trackers import GeneralTracker, JSONLTracker, TensorBoardTracker

__all__ = [
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "end_training",
    "get_tracker",
    "init_trackers",
    "log",
    "register_tracker",
]
