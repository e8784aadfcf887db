"""How a mutant reaches a process from outside: its environment applies it at start-up, and
a process started to serve switching takes another one, or none, while it runs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mutants import preload

#: Prints the mutant it applies, waits for a line, prints it again.
SHOW = "import sys, mutants; print(mutants._active, flush=True); sys.stdin.readline(); " \
    "print(mutants._active, flush=True)"  # fmt: skip


def serving(code: str, folder: Path) -> subprocess.Popen[str]:
    """A Python process running ``code`` with mutant early-free, serving switching in
    ``folder``."""
    env = preload.environ("early-free", switch=folder)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    proc = serving(SHOW, tmp_path)
    try:
        yield proc, tmp_path
    finally:
        proc.kill()
        proc.wait(10)


def test_the_environment_applies_a_mutant_and_a_switch_changes_it(
    child: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, folder = child
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "early-free"
    assert preload.switch(folder, "v2-to-legacy", timeout=10) == 1
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "v2-to-legacy"


def test_a_switch_to_no_such_mutant_is_refused(child: tuple[subprocess.Popen[str], Path]) -> None:
    proc, folder = child
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "early-free"
    with pytest.raises(RuntimeError, match="no mutant 'nope'"):
        preload.switch(folder, "nope", timeout=10)


def test_a_switch_with_no_process_left_says_so(child: tuple[subprocess.Popen[str], Path]) -> None:
    proc, folder = child
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "early-free"
    proc.kill()
    proc.wait(10)
    with pytest.raises(RuntimeError, match="no process serves"):
        preload.switch(folder, "", timeout=10)
    assert not list(folder.glob("*.sock"))  # the killed process's socket is cleared


def test_a_process_without_the_environment_loads_no_mutant() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, pdwire; print('mutants' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert out.strip() == "False"


#: Forks a child, says so once the child runs, waits for a line, then prints the child's mutant
#: and its own.
FORK = """
import os, sys, mutants
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
if os.fork() == 0:
    os.write(ready_w, b"x")
    os.read(go_r, 1)
    print(mutants._active, flush=True)
    os._exit(0)
os.read(ready_r, 1)
print("forked", flush=True)
sys.stdin.readline()
os.write(go_w, b"x")
os.wait()
print(mutants._active, flush=True)
"""


def test_a_switch_reaches_a_process_forked_from_one_that_serves(tmp_path: Path) -> None:
    """A node's forkserver forks its workers: each serves switching of its own."""
    proc = serving(FORK, tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "forked"
        assert preload.switch(tmp_path, "v2-to-legacy", timeout=10) == 2
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["v2-to-legacy"] * 2
    finally:
        proc.kill()
        proc.wait(10)


#: Forks a child that exits through the interpreter's exit handlers, then waits for a line.
FORK_AND_EXIT = """
import os, sys
if os.fork() == 0:
    sys.exit(0)
os.wait()
print("child gone", flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_that_exits_leaves_its_parent_switchable(tmp_path: Path) -> None:
    proc = serving(FORK_AND_EXIT, tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "child gone"
        assert preload.switch(tmp_path, "v2-to-legacy", timeout=10) == 1
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("tracker", [False, True])
def test_a_resource_tracker_applies_no_mutant(tmp_path: Path, tracker: bool) -> None:
    """multiprocessing's resource tracker, which every node starts, runs none of pdwire's
    code: it loads no mutant and serves no switching; any other process does."""
    # The tracker is told by its command line; this one names the module, and only imports it.
    named = "import multiprocessing.resource_tracker; " if tracker else ""
    code = f"{named}import sys; print('mutants' in sys.modules, flush=True)"
    proc = serving(code, tmp_path)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.strip() == str(not tracker)
