"""Experiment tracking for the main process: `init_trackers`, `log`, `end_training`.

Accelerate keeps its trackers on the `Accelerator`; here they live in the
run's value (`RunState.trackers`), opened by `init_trackers` on the main
process only, so two runs in one process log to their own places. A JSONL
tracker is built in; TensorBoard is the optional extra (``pip install
tensorboard``); anything else is an object following `GeneralTracker`.

`log` takes metrics as they come out of `fa.step`, device tensors included,
and reads all of them with one device-to-host transfer per device per call
(principle 7: no sync the user did not ask for). Call it every N steps: each
call is a sync you asked for.

- `trackers.py`: the protocol, the built-in trackers, and how ``log_with`` names them.
- `values.py`: turning the logged values into plain Python in one transfer.
- `run.py`: the functions over the state.
"""

from fnaccel.tracking.run import end_training, get_tracker, init_trackers, log
from fnaccel.tracking.trackers import GeneralTracker, JSONLTracker, TensorBoardTracker

__all__ = [
    "GeneralTracker",
    "JSONLTracker",
    "TensorBoardTracker",
    "end_training",
    "get_tracker",
    "init_trackers",
    "log",
]
