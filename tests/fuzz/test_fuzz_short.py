"""The short fuzz run of ``make test``: every atheris target over its committed corpus plus a
bounded number of new executions, and proof that the runner reports a crash."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from fuzz import runner
from fuzz.targets import TARGETS
from pdwire import DecodeError, decode_response

RUNS: Final = 3000  # new executions per target, at most
SECONDS: Final = 2.0  # ... or this long, whichever comes first


def mutant_decoder(data: bytes) -> None:
    """A decoder with a planted bug: an out-of-range read on maps of three entries whose first
    key is a 6-byte string starting with ``s`` - the kind of slip a hand-written decoder makes."""
    if data[:3] == b"\x83\xa6s":
        raise IndexError("mutant: read past the end of the header")
    with contextlib.suppress(DecodeError):
        decode_response(data)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_short_fuzz_run_finds_no_crash(target: str, tmp_path: Path) -> None:
    result = runner.run(target, runs=RUNS, seconds=SECONDS, artifacts=tmp_path)
    assert not result.crashed, result.log[-4000:]
    assert result.executions > 0, result.log[-2000:]
    assert not list(tmp_path.iterdir())


def test_a_crash_is_reported_with_its_input_and_fails_the_run(tmp_path: Path) -> None:
    cmd = [
        *(sys.executable, "-m", "fuzz", "--target", f"{__file__}:mutant_decoder"),
        *("--runs", "500000", "--seconds", "30", "--artifacts", str(tmp_path)),
    ]
    proc = subprocess.run(cmd, cwd=runner.ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    line, total = proc.stdout.splitlines()
    assert " 1 targets, 1 crashed" in total, proc.stdout
    written = line.partition("CRASH, input written to ")[2]
    assert written and Path(written).parent == tmp_path, line
    assert int(line.split()[1].replace(",", "")) > 0  # executions before the crash
    with pytest.raises(IndexError):
        mutant_decoder(Path(written).read_bytes())
