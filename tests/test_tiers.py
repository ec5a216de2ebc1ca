"""tests/conftest.py's tiers stay true: the unit tier names existing files that build and
run nothing heavy, and every test gets exactly one tier."""
from __future__ import annotations

import re

from conftest import TESTS, TIERS, UNIT

# what makes a test integration: a compile, a loaded artifact, an engine, a training run
# through the CLI, an oracle model or runtime, MPI workers
HEAVY = re.compile(r"compile_graph\(|load_artifact\(|make_engine\(|\bEngine\(|tvm\.compile\(|\brun_lorac\b|"
                   r"\bLORAC\b|import torch|importorskip\(\"torch|InferenceSession|mpiexec")


def test_unit_files_exist_and_build_nothing_heavy():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert UNIT <= files, f"UNIT names missing files: {sorted(UNIT - files)}"
    heavy = {name: HEAVY.search((TESTS / name).read_text()).group(0) for name in UNIT - {"test_tiers.py"}
             if HEAVY.search((TESTS / name).read_text())}  # (this file names the patterns)
    assert not heavy, f"unit-tier files that compile or train: {heavy}"


def test_each_test_has_one_tier(request):
    assert [t for t in TIERS if request.node.get_closest_marker(t)] == ["unit"]
