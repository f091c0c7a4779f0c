"""The hooks: each on the kind of transform that has it, and their order described in one place.

`fnaccel.transforms.contract` holds one Protocol per hook and the one description
of the order a run meets them; every other module refers to it instead of
repeating it (the order was described in four places, and drifted).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import fnaccel as fa
from fnaccel.transforms import contract

PACKAGE = Path(fa.__file__).parent
KINDS = (fa.Transform, fa.StepTransform, fa.ParallelismTransform, fa.EngineTransform, fa.PrecisionTransform)


def hook_fields() -> dict[str, str]:
    """``{hook: the kind that declares it}``, read from the kinds' fields typed by a hook Protocol."""
    found = {}
    for kind in KINDS:
        own = set(kind.__annotations__)  # the fields this kind adds (a dataclass's own annotations)
        for f in dataclasses.fields(kind):
            protocol = str(f.type).split(" | ")[0]
            if f.name in own and protocol.endswith("Fn"):
                found[f.name] = kind.__name__
    return found


def test_every_hook_is_in_the_one_description_of_the_order() -> None:
    described = contract.__doc__ or ""
    found = hook_fields()
    assert {"check", "prepare_model", "scale_loss", "set_sync", "prepare_engine"} <= set(found), found
    missing = [name for name in found if not re.search(rf"^\s+{name}\b|\b{name} hooks?\b", described, re.M)]
    assert not missing, missing


@pytest.mark.parametrize(("hook", "kind"), sorted(hook_fields().items()))
def test_each_hooks_protocol_names_the_kind_that_carries_it(hook: str, kind: str) -> None:
    field_type = next(f.type for f in dataclasses.fields(getattr(fa, kind)) if f.name == hook)
    protocol = getattr(contract, str(field_type).split(" | ")[0])
    assert (protocol.__doc__ or "").startswith(f"``{kind}.{hook}``"), protocol.__doc__


def test_no_other_module_describes_the_order() -> None:
    """A line chaining two hooks with ``->`` outside contract.py is a second description of the order."""
    names = "|".join(hook_fields())
    chained = re.compile(rf"\b({names})\b[^\n]*->[^\n]*\b({names})\b")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "contract.py" and path.parent.name == "transforms":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and chained.search(node.value):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_a_hook_belongs_to_its_kind_only() -> None:
    """`Transform` grows by subtype: a plain transform takes no gradient or parallelism hook."""
    for hook in ("scale_loss", "before_update", "set_sync", "forward_backward", "layout", "mesh_dims"):
        with pytest.raises(TypeError, match=hook):
            fa.Transform(name="mine", **{hook: None})
    for hook in ("set_sync", "split_batch", "layout"):
        with pytest.raises(TypeError, match=hook):
            fa.StepTransform(name="mine", **{hook: None})
    assert isinstance(fa.ddp(), fa.ParallelismTransform) and isinstance(
        fa.deepspeed(), fa.ParallelismTransform
    )
    assert isinstance(fa.clip_grad_norm(1.0), fa.StepTransform)
    assert isinstance(fa.autocast(fa.bf16), fa.PrecisionTransform)
