"""One half of a run in its own interpreter (see test_fresh_process.py).

    python _resume_job.py first  CKPT OUT   # train to mid-epoch, save
    python _resume_job.py second CKPT OUT   # load in a new interpreter, finish
OUT receives the losses (JSON) and the final weights (safetensors).
"""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

import fnaccel as fa
from tests.checkpoint.test_resume import PIPELINES, fresh_run, train


def main(part: str, checkpoint: str, out: Path) -> None:
    state, model, _ = fresh_run(fa.init(seed=0, cpu=True), PIPELINES["accumulate3"]())
    if part == "first":
        state, losses = train(state, epochs=2, stop_after=13)
        fa.save(state, checkpoint)
    else:
        state = fa.load(state, checkpoint)
        state, losses = train(state, epochs=2)
    out.with_suffix(".json").write_text(json.dumps(losses))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(out.with_suffix(".safetensors"))
    )


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
