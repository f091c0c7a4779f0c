"""What a transform declares: each capability declared by a transform and asked where behaviour is decided."""

from __future__ import annotations

import ast
from pathlib import Path

import fnaccel as fa
from fnaccel.transforms.declared import Capability

PACKAGE = Path(fa.__file__).parent


def test_no_capability_restates_a_hook_or_the_engine() -> None:
    """Removed: RUNS_FORWARD_BACKWARD (a forward_backward hook says it), SAME_BATCH_ACROSS_RANKS
    (one asker, now fa.pp's own check), OWNS_OPTIMIZER_STEP (`Pipeline.engine` says it),
    TENSOR_PARALLEL (asked by nothing once fa.tp declares its checkpoint layout; its
    ``mesh_dims`` says it). What is left is declared by a transform and asked by the core."""
    assert set(Capability.__members__) == {
        "AVERAGES_GRADIENTS",
        "SHARDS_PARAMETERS",
        "SPLITS_MODEL",
        "SCALES_LOSS",
        "CLIPS_GRADIENTS",
    }
    declared: set[str] = set()
    asked: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_declarations = {
            id(node)
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            for kw in call.keywords
            if kw.arg == "capabilities"
            for node in ast.walk(kw.value)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value).endswith("Capability"):
                (declared if id(node) in in_declarations else asked).add(node.attr)
    members = set(Capability.__members__)
    assert members <= declared, members - declared  # each is declared by a transform of fnaccel's
    assert members <= asked, members - asked  # and asked (or taken over) where behaviour is decided
