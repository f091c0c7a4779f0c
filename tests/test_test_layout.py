"""Tests mirror the package: where a module's tests are is read from its path.

``fnaccel/<dir>/<module>.py`` is tested in ``tests/<dir>/test_<module>.py``, or in
``tests/<dir>/test_<module>_<aspect>.py`` when one file would mix unrelated
setups (``commands/launch.py``: ``test_launch_env.py``, ``test_launch_failures.py``).
A package's ``__init__.py`` is covered by its test folder. A root module whose
names ``fnaccel.utils`` exports may be tested under ``tests/utils/`` instead, as
Accelerate's utils tests are. Any other module is listed below with where it is
tested and why not at its mirrored path; an entry that no longer applies fails
too, so the lists only shrink.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, TESTS = ROOT / "fnaccel", ROOT / "tests"

# module -> (where it is tested, why there). Internals reached only through one public entry point
# are tested through that entry, which is what a user calls and what the guarantees are stated for.
COVERED_ELSEWHERE: dict[str, tuple[str, str]] = {
    "__init__.py": (
        "tests/test_exported_members.py",
        "the facade: its names are checked against docs/api.md, every test calls them",
    ),
    "__main__.py": ("tests/test_runtime.py", "`python -m fnaccel` is one line; tests launch through it"),
    "_errors.py": (
        "tests/ops/test_collectives.py",
        "error classes without behaviour; each area's tests assert the ones it raises",
    ),
    "_lazy.py": (
        "tests/test_exported_members.py",
        "the facades' loading on first use and their type stubs, checked against their tables",
    ),
    "atomic.py": ("tests/checkpoint/test_crash.py", "fa.save's commit step: SIGKILL mid-save keeps the last"),
    "protocols.py": ("tests/test_state.py", "two Protocols (no code) the state names its pipeline by; mypy"),
    "checkpoint/saveload.py": (
        "tests/checkpoint/test_resume.py",
        "fa.save / fa.load: every checkpoint test's entry",
    ),
    "checkpoint/headers.py": (
        "tests/checkpoint/storage/test_files.py",
        "the tensor file format, with storage/files.py",
    ),
    "checkpoint/storage/weightfiles.py": (
        "tests/modeling/test_weights.py",
        "the weights files fa.save_model writes and load_checkpoint_in_model reads; also test_loading.py",
    ),
    "modeling/placement.py": (
        "tests/checkpoint/test_sharded.py",
        "is_sharded needs fsdp() on several processes",
    ),
    "checkpoint/storage/parts.py": (
        "tests/checkpoint/test_hostile.py",
        "the parts as stored, checked against the live ones: each refusal of fa.load; also test_hooks.py",
    ),
    "checkpoint/storage/plain.py": (
        "tests/checkpoint/test_resume.py",
        "the plain layout: every replicated resume",
    ),
    "checkpoint/storage/sharded.py": (
        "tests/checkpoint/test_reshard.py",
        "the sharded layout needs fsdp() on several processes; also test_sharded.py",
    ),
    "checkpoint/extras.py": ("tests/checkpoint/test_registered.py", "registered objects' state"),
    "checkpoint/manifest.py": (
        "tests/checkpoint/test_integrity.py",
        "checked by corrupting real checkpoints",
    ),
    "checkpoint/storage/shardindex.py": (
        "tests/checkpoint/test_sharded.py",
        "the DCP index, also read by merge",
    ),
    "checkpoint/summary.py": ("tests/debug/test_diff.py", "what `fnaccel checkpoint` prints and diffs"),
    "checkpoint/storage/dcpstore.py": (
        "tests/checkpoint/test_sharded.py",
        "the sharded layout's DCP storage; also test_consolidate.py",
    ),
    "commands/launch_flags.py": ("tests/commands/test_cli_errors.py", "the flags of `fnaccel launch`"),
    "commands/launch_worker.py": (
        "tests/commands/test_launch_lifetime.py",
        "workers end with their launcher",
    ),
    "commands/merge.py": (
        "tests/checkpoint/test_consolidate.py",
        "parses and prints; its tests share checkpoint/consolidate.py's 2-process fixture",
    ),
    "commands/main.py": ("tests/commands/test_cli_errors.py", "the parser every command goes through"),
    "commands/test_checks.py": ("tests/commands/test_test_command.py", "the checks `fnaccel test` runs"),
    "commands/test_script.py": ("tests/commands/test_test_command.py", "the script `fnaccel test` launches"),
    "config/launch.py": (
        "tests/commands/test_config.py",
        "the config file `fnaccel config` writes and launch reads; also test_accelerate_files.py",
    ),
    "transforms/plugins/sections.py": (
        "tests/transforms/plugins/test_fsdp.py",
        "the key refusals every plugin shares, checked through FSDP's",
    ),
    "data/eval_batches.py": ("tests/test_evaluation.py", "fa.eval_batches, beside fa.evaluate"),
    "data/iterable.py": ("tests/data/test_prepared.py", "iterable datasets split across ranks"),
    "data/sharding.py": ("tests/data/test_sampler.py", "how batches are split across ranks"),
    "debug/divergence.py": ("tests/debug/test_two_runs_tools.py", "find_divergence on two real runs"),
    "debug/resume.py": ("tests/debug/test_two_runs_tools.py", "verify_resume on two real runs"),
    "debug/items.py": ("tests/debug/test_diff.py", "the tensors `fnaccel checkpoint diff` compares"),
    "dist.py": ("tests/transforms/test_mesh.py", "data-parallel rank and mesh groups need a mesh"),
    "modeling/attach.py": ("tests/modeling/test_hooks.py", "attaching the hooks of hooks.py"),
    "modeling/layerwise_casting.py": ("tests/modeling/test_big_modeling.py", "a big_modeling entry point"),
    "modeling/memory_budget.py": ("tests/modeling/test_device_map.py", "the budgets a device map fills"),
    "ops/_flags.py": ("tests/ops/test_collectives.py", "the collectives' agreement, private to ops/"),
    "ops/_shapes.py": ("tests/ops/test_collectives.py", "the collectives' shape header, private to ops/"),
    "ops/objects.py": ("tests/ops/test_collectives.py", "object collectives beside the tensor ones"),
    "config/parallelism.py": (
        "tests/transforms/test_mesh.py",
        "ParallelismConfig builds the mesh tested there",
    ),
    "preparation.py": ("tests/test_train.py", "fa.prepare, tested with the step it prepares for"),
    "seeding.py": ("tests/test_rng.py", "seeding writes the RNG state rng.py holds"),
}

# Tests that exist under a name or folder other than the mirrored one. The structural refactor of
# issue 27 regroups these modules; their tests move with it (moving them first would move them twice).
NOT_YET_MIRRORED: dict[str, tuple[str, str]] = {
    **{
        f"tracking/{m}.py": ("tests/test_tracking.py", "tracking's tests sit at tests/ root: tests/tracking/")
        for m in ("common", "registry", "run", "trackers", "values")
    },
    "tracking/hosted.py": (
        "tests/test_tracking_services.py",
        "at tests/ root: tests/tracking/test_hosted.py",
    ),
    "tracking/stores.py": (
        "tests/test_tracking_services.py",
        "at tests/ root: tests/tracking/test_stores.py",
    ),
    "tracking/progress.py": ("tests/test_progress.py", "at tests/ root: tests/tracking/test_progress.py"),
    "tracking/throughput.py": ("tests/test_tracking_throughput.py", "tests/tracking/test_throughput.py"),
    "transforms/accumulate.py": (
        "tests/test_train.py",
        "in the step's tests: tests/transforms/test_accumulate.py",
    ),
    "transforms/compile.py": ("tests/test_train.py", "in the step's tests: tests/transforms/test_compile.py"),
    "transforms/profile.py": ("tests/test_train.py", "in the step's tests: tests/transforms/test_profile.py"),
    "transforms/mixed_precision.py": ("tests/test_train.py", "in the step's tests and test_fp8.py"),
    "transforms/parallel.py": (
        "tests/test_train_dist.py",
        "fa.ddp / fa.fsdp: tests/transforms/test_parallel.py",
    ),
    "transforms/collective_steps.py": (
        "tests/ops/test_collectives.py",
        "the collective transforms, with ops/",
    ),
    "transforms/tensor_parallel.py": (
        "tests/transforms/test_mesh.py",
        "fa.tp: tests/transforms/test_tensor_parallel.py",
    ),
    "transforms/pipelining.py": ("tests/transforms/test_pp.py", "named after fa.pp: test_pipelining.py"),
}


def modules(package: Path = PACKAGE) -> list[str]:
    return sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))


def mirrored(module: str, package: Path = PACKAGE, tests: Path = TESTS) -> bool:
    """Whether ``module`` (a path under the package) has tests at its mirrored path."""
    *folders, name = Path(module).parts
    stem = name.removesuffix(".py")
    here = tests.joinpath(*folders)
    if stem == "__init__":
        return bool(folders) and any(here.glob("test_*.py"))
    homes = [here] if folders else [here, tests / "utils"]
    return any((home / f"test_{stem}.py").exists() or any(home.glob(f"test_{stem}_*.py")) for home in homes)


def problems(
    package: Path = PACKAGE, tests: Path = TESTS, listed: dict[str, tuple[str, str]] | None = None
) -> list[str]:
    listed = {**COVERED_ELSEWHERE, **NOT_YET_MIRRORED} if listed is None else listed
    found = []
    present = modules(package)
    for module in present:
        if not mirrored(module, package, tests) and module not in listed:
            *folders, name = Path(module).parts
            found.append(
                f"{package.name}/{module} has no tests at tests/{'/'.join([*folders, ''])}"
                f"test_{name}: write them there, or list it with where and why"
            )
    for module, (where, why) in listed.items():
        if module not in present:
            found.append(f"{module} is listed but no longer exists: remove its entry")
        elif mirrored(module, package, tests):
            found.append(f"{module} now has mirrored tests: remove its entry")
        if not (tests.parent / where).exists():
            found.append(f"{module}'s entry names {where}, which does not exist")
        if not why.strip():
            found.append(f"{module}'s entry says not why its tests are elsewhere")
    return found


def test_every_module_has_tests_at_its_mirrored_path_or_says_where() -> None:
    found = problems()
    assert not found, "\n".join(found)


def test_the_check_fails_on_a_module_without_tests_and_on_a_stale_entry(tmp_path: Path) -> None:
    package, tests = tmp_path / "fnaccel", tmp_path / "tests"
    for path in (
        "__init__.py",
        "state.py",
        "ops/__init__.py",
        "ops/tree.py",
        "ops/gone_home.py",
        "kwargs.py",
    ):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text("")
    for path in ("test_state.py", "ops/test_tree_ranks.py", "utils/test_kwargs.py", "test_api.py"):
        (tests / path).parent.mkdir(parents=True, exist_ok=True)
        (tests / path).write_text("")
    listed = {
        "__init__.py": ("tests/test_api.py", "the facade"),
        "state.py": ("tests/test_api.py", "stale: state has its own tests now"),
        "removed.py": ("tests/test_api.py", "stale: the module is gone"),
    }
    assert problems(package, tests, listed) == [
        "fnaccel/ops/gone_home.py has no tests at tests/ops/test_gone_home.py: write them there, "
        "or list it with where and why",
        "state.py now has mirrored tests: remove its entry",
        "removed.py is listed but no longer exists: remove its entry",
    ]


@pytest.mark.parametrize("entries", [COVERED_ELSEWHERE, NOT_YET_MIRRORED], ids=["elsewhere", "not_yet"])
def test_each_entry_says_why_in_one_short_line(entries: dict[str, tuple[str, str]]) -> None:
    long = [module for module, (_, why) in entries.items() if len(why) > 100 or "\n" in why]
    assert not long, long


GUARDED = """
import multiprocessing, os, subprocess, sys

import pytest

LAUNCH = [sys.executable, "-c", "", "fnaccel", "launch"]  # a launcher's command line, that exits at once


@pytest.fixture
def world2():  # the real fixture's name, without its processes
    return None


def test_unmarked_launch():
    subprocess.run(LAUNCH, check=True)


def test_unmarked_process():
    process = multiprocessing.get_context("fork").Process(target=os.getpid)
    process.start()
    process.join()


def test_unmarked_plain_subprocess():
    subprocess.run([sys.executable, "-c", ""], check=True)


@pytest.mark.multiprocess
def test_marked_launch():
    subprocess.run(LAUNCH, check=True)


def test_marked_by_its_fixture(world2):
    subprocess.run(LAUNCH, check=True)
"""


@pytest.mark.slow
def test_an_unmarked_test_starting_a_group_fails_and_the_fast_loop_skips_marked_ones(tmp_path: Path) -> None:
    """What tests/conftest.py does for the ``multiprocess`` marker, on a planted test file run as
    `pytest -m "not multiprocess"` is (the guard and the marker come from the real conftest)."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(TESTS / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "multiprocess_marker_is_set = suite.multiprocess_marker_is_set\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_planted.py").write_text(GUARDED)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = multiprocess: starts a process group\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-m",
            "not multiprocess",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    assert done.returncode == 1, out
    # the two marked tests (one by its world fixture) are deselected; the unmarked ones run, and
    # those that started a group fail at teardown
    assert "3 passed, 2 deselected, 2 errors" in out, out
    assert "this test started the command [" in out, out
    assert "'fnaccel', 'launch'] but is not marked: add @pytest.mark.multiprocess" in out, out
    assert "this test started a process running posix.getpid but is not marked" in out, out
    assert "ERROR test_planted.py::test_unmarked_plain_subprocess" not in out, out
