"""The suite's own schedule (tests/conftest.py, tests/worker_lock.py): the modules of a chain
are one unit of xdist's work, and a module holding a worker lock keeps another out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest, worker_lock


def test_a_chains_modules_are_one_unit_and_other_modules_their_own() -> None:
    faults, mutants, self_run, e2e = conftest.CHAINS[1]
    units = {
        conftest.unit_of(f"{faults}test_kill_p.py::test_kill_p_mid_transfer[legacy]"),
        conftest.unit_of(f"{faults}sub/test_y.py::test_y"),
        conftest.unit_of(f"{mutants}::test_every_mutant_is_caught"),
        conftest.unit_of(f"{self_run}::test_self"),
        conftest.unit_of(f"{e2e}::test_the_pair_conformance_suite_passes[legacy]"),
    }
    assert len(units) == 1
    (release_tier,) = conftest.CHAINS[0]
    assert conftest.unit_of(f"{release_tier}::test_x[0.34.0]") not in units
    # a folder stands for each module under it, and only for those
    assert conftest.unit_of("tests/faultsy/test_z.py::test_z") == "tests/faultsy/test_z.py"
    assert conftest.unit_of("tests/unit/test_cli.py::test_help") == "tests/unit/test_cli.py"


def test_the_chains_run_first_in_their_order_then_the_next_modules() -> None:
    chained = [m for chain in conftest.CHAINS for m in chain]
    # a folder's modules keep the order pytest collected them in
    modules = [f"{m}test_b.py" if m.endswith("/") else m for m in chained]
    folder = next(i for i, m in enumerate(chained) if m.endswith("/"))
    modules[folder:folder] = [f"{chained[folder]}test_a.py"]

    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    # the folder's two modules in the order collected, every other path reversed
    others = [m for m in modules if not m.startswith(chained[folder])]
    ours = [m for m in modules if m.startswith(chained[folder])]
    collected = ["tests/unit/test_cli.py", *conftest.NEXT[::-1], *ours, *others[::-1]]
    items = [Item(f"{m}::test") for m in collected]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    expected = [*modules, *conftest.NEXT, "tests/unit/test_cli.py"]
    assert [i.nodeid.split("::")[0] for i in items] == expected


HOLD = """
import sys
from pathlib import Path
from tests import worker_lock
try:
    with worker_lock.hold(Path(sys.argv[1]), float(sys.argv[2])):
        print("held")
except TimeoutError as exc:
    print(exc)
"""


def _other_process(path: Path, wait_s: float) -> str:
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", HOLD, str(path), str(wait_s)],
        cwd=root, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_a_held_lock_keeps_another_process_out_until_released(tmp_path: Path) -> None:
    path = tmp_path / "vllm.lock"
    with worker_lock.hold(path, wait_s=1.0):
        assert _other_process(path, 0.5) == f"another process held the lock {path} for 0.5s"
    assert _other_process(path, 0.5) == "held"


def test_without_xdist_no_lock_is_taken(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with worker_lock.held(tmp_path_factory, "unit"):
        pass
    assert not (tmp_path_factory.getbasetemp().parent / "unit.lock").exists()
