"""Runs each target under libFuzzer in a subprocess and reads back what it did."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
CORPUS: Final = ROOT / "fuzz" / "corpus"
CRASHES: Final = ROOT / "fuzz" / "crashes"
#: Inputs that once found a bug: always run, never merged away.
REGRESSIONS: Final = ROOT / "fuzz" / "regressions"
MAX_LEN: Final = 8192

_EXECS: Final = re.compile(r"stat::number_of_executed_units:\s*(\d+)")
_DONE: Final = re.compile(r"Done (\d+) runs in")
_STATUS: Final = re.compile(r"^#(\d+)\s", re.MULTILINE)  # the last one, when a crash ends the run
_ARTIFACT: Final = re.compile(r"Test unit written to (\S+)")


@dataclasses.dataclass(frozen=True)
class Result:
    target: str
    executions: int
    new_units: int
    seconds: float
    returncode: int
    artifact: Path | None
    log: str

    @property
    def crashed(self) -> bool:
        return self.returncode != 0 or self.artifact is not None

    def line(self) -> str:
        verdict = "ok" if not self.crashed else f"CRASH, input written to {self.artifact}"
        return (
            f"{self.target:12} {self.executions:>10,} executions {self.new_units:>5} new inputs "
            f"{self.seconds:7.1f} s  {verdict}"
        )


def _worker(target: str, args: list[str], python: str) -> subprocess.CompletedProcess[str]:
    cmd = [python, "-m", "fuzz.worker", target, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, errors="replace")


def _slug(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", target.rpartition(":")[2] or target)


def run(
    target: str,
    *,
    runs: int | None = None,
    seconds: float | None = None,
    corpus: Path | None = CORPUS,
    artifacts: Path = CRASHES,
    timeout: int = 5,
    update_corpus: bool = False,
    python: str = sys.executable,
) -> Result:
    """Fuzz ``target`` for ``runs`` executions or ``seconds``, starting from ``corpus/<target>``.

    New inputs go to a scratch folder; with ``update_corpus`` the old and new inputs are merged
    (``-merge=1``: only those adding coverage are kept) back into ``corpus/<target>``."""
    seeds = corpus / _slug(target) if corpus is not None else None
    artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdwire-fuzz-") as tmp:
        new = Path(tmp) / "new"
        new.mkdir()
        args = [str(new)]
        if seeds is not None and seeds.is_dir():
            args.append(str(seeds))
        if (REGRESSIONS / _slug(target)).is_dir():
            args.append(str(REGRESSIONS / _slug(target)))
        args += [
            f"-timeout={timeout}",
            f"-max_len={MAX_LEN}",
            "-rss_limit_mb=4096",
            "-print_final_stats=1",
            f"-artifact_prefix={artifacts}/{_slug(target)}-",
        ]
        if runs is not None:
            args.append(f"-runs={runs}")
        if seconds is not None:
            args.append(f"-max_total_time={max(1, round(seconds))}")
        started = time.monotonic()
        proc = _worker(target, args, python)
        elapsed = time.monotonic() - started
        log = proc.stdout + proc.stderr
        new_units = sum(1 for _ in new.iterdir())
        found = _EXECS.search(log) or _DONE.search(log)
        status = _STATUS.findall(log)
        artifact = _ARTIFACT.search(log)
        result = Result(
            target=target,
            executions=int(found[1]) if found else int(status[-1]) if status else 0,
            new_units=new_units,
            seconds=elapsed,
            returncode=proc.returncode,
            artifact=Path(artifact[1]) if artifact else None,
            log=log,
        )
        if update_corpus and seeds is not None and not result.crashed:
            merge(target, seeds, [new], python=python)
    return result


def merge(target: str, into: Path, extra: list[Path], *, python: str = sys.executable) -> int:
    """Replace ``into`` by the inputs of ``into`` and ``extra`` that add coverage; their count."""
    with tempfile.TemporaryDirectory(prefix="pdwire-merge-") as tmp:
        fresh = Path(tmp) / "fresh"
        fresh.mkdir()
        sources = [str(d) for d in (into, *extra) if d.is_dir()]
        proc = _worker(target, ["-merge=1", f"-max_len={MAX_LEN}", str(fresh), *sources], python)
        kept = sum(1 for _ in fresh.iterdir())
        if proc.returncode != 0 or (kept == 0 and any(any(Path(d).iterdir()) for d in sources)):
            raise RuntimeError(f"merge of {target} failed:\n{proc.stderr[-2000:]}")
        shutil.rmtree(into, ignore_errors=True)
        shutil.copytree(fresh, into)
        return sum(1 for _ in into.iterdir())
