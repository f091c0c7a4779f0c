"""NUMA affinity from /sys: a sysfs tree of real files, and this machine's own /sys in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fnaccel.config.numa import numa_node_cpus, parse_cpu_list

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs Linux's sched_setaffinity"
)


def _sysfs(root: Path, nodes: dict[int, str]) -> Path:
    for node, cpulist in nodes.items():
        folder = root / "devices" / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpulist + "\n")
    return root


def test_cpu_lists_parse_and_bad_ones_are_refused() -> None:
    assert parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == set()
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list("0-a")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with CUDA the GPU's node decides")
def test_cpu_processes_take_the_nodes_in_turn(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0-3", 1: "4-7"})
    assert [numa_node_cpus(i, sysfs) for i in range(3)] == [{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 1, 2, 3}]
    assert numa_node_cpus(0, tmp_path / "empty") is None


@pytest.mark.slow
def test_this_machine_pins_a_child_process_to_its_nodes_allowed_cpus() -> None:
    code = (
        "import os\n"
        "from fnaccel.utils import set_numa_affinity, override_numa_affinity\n"
        "from fnaccel.config.numa import numa_node_cpus\n"
        "allowed = os.sched_getaffinity(0)\n"
        "node = numa_node_cpus(0)\n"
        "cpus = set_numa_affinity(0)\n"
        "print(node is None, cpus == (None if node is None or not node & allowed else node & allowed),"
        " cpus is None or os.sched_getaffinity(0) == cpus, override_numa_affinity(0) == cpus)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    no_numa, right_cpus, pinned, same = out.stdout.split()
    assert (right_cpus, pinned, same) == ("True", "True", "True"), out.stdout
    if no_numa == "True":
        pytest.skip("this machine's /sys has no NUMA nodes: only the no-op was shown")


def test_a_negative_index_is_refused() -> None:
    from fnaccel.utils import set_numa_affinity

    with pytest.raises(ValueError, match="local_rank"):
        set_numa_affinity(-1)
