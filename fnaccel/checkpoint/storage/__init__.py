"""The storage half of a checkpoint, below the transforms so that they can declare how their
model and optimizer are stored (`layout.py`): the files and their checks (`files.py`), the
run's parts as tensors and JSON, each checked against its live counterpart (`parts.py`), and
the plain and sharded layouts (`plain.py`, which also chooses one; `sharded.py`).

Nothing here imports `fnaccel.transforms`; `fa.save` and `fa.load` (`fnaccel.checkpoint.saveload`)
sit above both.
"""
