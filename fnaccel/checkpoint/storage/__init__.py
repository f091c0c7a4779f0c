"""The storage half of a checkpoint, below the transforms so that they can declare how their
model and optimizer are stored (`layout.py`): the files and their checks, the tree checks
against the live objects (`schema.py`), and the plain and sharded layouts.

Nothing here imports `fnaccel.transforms`; `fa.save` and `fa.load` (`fnaccel.checkpoint.saveload`)
sit above both.
"""
