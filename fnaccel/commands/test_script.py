"""The installation check that ``fnaccel test`` launches: what works, one line per check.

Runs under ``fnaccel test`` / ``fnaccel launch`` / torchrun, or with plain
``python`` as a world of one. Every rank runs every check
(`fnaccel.commands.test_checks`); the ranks' outcomes are gathered after each,
so a failure on any rank shows in the report the main process prints (and the
failing rank prints its traceback on stderr). Exit status 0 when nothing
failed, 1 otherwise.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import fnaccel as fa
from fnaccel.commands.test_checks import CHECKS, SEED, Check, CheckFailed, CheckSkipped, kwargs_handlers

__all__ = ["CHECKS", "CheckFailed", "CheckResult", "CheckSkipped", "format_report", "main", "run_checks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check's outcome over every rank: ``status`` is "ok", "skipped" or "FAILED"."""

    name: str
    status: str
    detail: str = ""

    def line(self) -> str:
        """The report's line, e.g. ``gather ... ok`` or ``gather ... FAILED: reason``."""
        if self.status == "ok":
            outcome = f"ok ({self.detail})" if self.detail else "ok"
        else:
            outcome = f"{self.status}: {self.detail}"
        return f"  {self.name + ' ':.<26} {outcome}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run_checks(state: fa.RunState, checks: Sequence[tuple[str, Check]] = CHECKS) -> list[CheckResult]:
    """Run each check on this rank and combine every rank's outcome; every rank calls it.

    A check returns a detail for the report, raises `CheckSkipped` when it
    does not apply, or raises anything else to fail. A failing rank prints
    its traceback on stderr; the result names the failing ranks when others passed.
    """
    ctx = state.dist
    results = []
    for name, check in checks:
        try:
            outcome = ("ok", check(state))
        except CheckSkipped as exc:
            outcome = ("skipped", str(exc))
        except Exception as exc:  # the report says which check broke; the traceback goes to stderr
            print(f"[rank {ctx.rank}] check '{name}' failed:\n{traceback.format_exc()}", file=sys.stderr)
            outcome = ("FAILED", _one_line(exc))
        everyone = fa.ops.gather_object(state, [outcome])
        failed = [(rank, detail) for rank, (status, detail) in enumerate(everyone) if status == "FAILED"]
        if not failed:
            results.append(CheckResult(name=name, status=everyone[0][0], detail=everyone[0][1]))
            continue
        reasons = sorted({detail for _, detail in failed})
        # name the ranks only when some passed: "rank 1: ..." points at one machine or device
        ranks = ", ".join(str(rank) for rank, _ in failed)
        where = f"rank {ranks}: " if len(failed) < ctx.num_processes else ""
        results.append(CheckResult(name=name, status="FAILED", detail=where + "; ".join(reasons)))
    return results


def format_report(state: fa.RunState, results: Sequence[CheckResult]) -> str:
    """The report the main process prints: the run, a line per check, a verdict."""
    ctx = state.dist
    failed = sum(r.status == "FAILED" for r in results)
    skipped = sum(r.status == "skipped" for r in results)
    header = (
        f"fnaccel installation check: {ctx.num_processes} process(es), device {ctx.device.type}, "
        f"backend {ctx.backend or 'none'}, mixed precision {state.mixed_precision.value}"
    )
    if failed:
        verdict = f"{failed} of {len(results)} checks FAILED."
    else:
        verdict = f"All {len(results) - skipped} checks passed"
        verdict += f" ({skipped} skipped)." if skipped else "."
    return "\n".join([header, *(r.line() for r in results), verdict])


def main() -> int:
    """Run every check and print the report on the main process; 1 if any failed."""
    try:
        state = fa.init(seed=SEED, kwargs_handlers=kwargs_handlers())
    except fa.FnaccelError as exc:
        print(f"fnaccel test: cannot start the run: {exc}", file=sys.stderr)
        return 1
    try:
        results = run_checks(state)
        if state.dist.is_main_process:
            print(format_report(state, results), flush=True)
    finally:
        fa.shutdown(state)
    return 1 if any(r.status == "FAILED" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
