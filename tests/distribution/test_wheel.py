"""What ships is the product: the sdist built from this tree, the wheel built from that sdist,
and the wheel installed into fresh venvs (no extra, ``runtime``, ``node``) where each command
runs as a user would run it, away from the repository.

The venvs install offline, from wheels cached in ``.cache/wheels``: the first run (or one after
the dependencies changed) fills the cache from the package index, later runs download nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
import venv
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from pdwire import vectors
from pdwire.extras import COMMANDS
from pdwire.schema import schemas

ROOT: Final = Path(__file__).resolve().parents[2]
CACHE: Final = ROOT / ".cache" / "wheels"
BUILD_TIMEOUT: Final = 120
INSTALL_TIMEOUT: Final = 600
COMMAND_TIMEOUT: Final = 60
RUN_TIMEOUT: Final = 240
#: What the wheel may hold at its top level, besides its .dist-info.
PACKAGES: Final = {"pdwire", "conformance", "reference_connector"}
#: A deployment small enough to start and verify in seconds.
SMALL_RUN: Final = (
    *("--requests", "1", "--prompt-tokens", "32", "--max-tokens", "4", "--raw-repeats", "1"),
    *("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"),
)

#: Addresses the proxy never reaches: it stops before it starts.
PROXY_ARGS: Final = ("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9")

pytestmark = pytest.mark.packaging

Install = Callable[[str], Path]


@dataclasses.dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist of a copy of the tree (so that no build output lands in the repository), and
    the wheel built from the unpacked sdist, as a package index would build it."""
    tmp = tmp_path_factory.mktemp("build")
    src, dist, unpacked = tmp / "src", tmp / "dist", tmp / "unpacked"
    _copy_tree(ROOT, src)
    sdist = dist / _build(src, "build_sdist", dist)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    [top] = unpacked.iterdir()
    return Built(sdist, dist / _build(top, "build_wheel", dist))


@pytest.fixture(scope="module")
def install(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    """A fresh venv (no system site-packages) with the wheel and the given extra installed;
    removed after the module (the node's is over 1 GB)."""
    made: dict[str, Path] = {}

    def venv_with(extra: str) -> Path:
        if extra not in made:
            path = tmp_path_factory.mktemp(f"venv-{extra or 'no-extra'}")
            venv.create(path, with_pip=False, symlinks=True)
            _install(path, f"{built.wheel}[{extra}]" if extra else str(built.wheel))
            made[extra] = path
        return made[extra]

    yield venv_with
    for path in made.values():
        shutil.rmtree(path)


def test_the_wheel_holds_the_packages_and_nothing_else(built: Built) -> None:
    """No tests, fuzz targets, docs or spec text: only the three import packages."""
    tops = {name.split("/")[0] for name in _wheel_names(built)}
    assert {t for t in tops if not t.endswith(".dist-info")} == PACKAGES


def test_the_wheel_holds_no_mutants(built: Built) -> None:
    """The deliberately broken testees are test machinery; they reach a testee from outside."""
    assert [name for name in _wheel_names(built) if "mutants" in name] == []


def test_the_vectors_and_schemas_ship_in_the_sdist_and_the_wheel(built: Built) -> None:
    expected = {
        *(f"vectors/{v.name}{s}" for v in vectors.all_vectors() for s in (".json", ".msgpack")),
        *(f"schemas/{name}" for name in schemas()),
    }
    with zipfile.ZipFile(built.wheel) as whl:
        shipped = {
            n.removeprefix("pdwire/data/"): whl.read(n)
            for n in whl.namelist()
            if n.startswith("pdwire/data/")
        }
    assert set(shipped) == expected
    for name, data in shipped.items():
        assert data == (ROOT / "pdwire" / "data" / name).read_bytes(), name
    with tarfile.open(built.sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f"pdwire/data/{name}" for name in expected} <= in_sdist


def test_with_no_extra(install: Install, tmp_path: Path) -> None:
    """msgspec, numpy and pydantic only: the wire tools work, and every other command's help
    names its extra, and the command itself says in one line what to install."""
    env = install("")
    done = _pdwire(env, "--help")
    assert done.returncode == 0, done.stderr
    for command, extras in COMMANDS.items():
        assert f"pdwire[{','.join(extras)}]" in done.stdout, command
    _check_the_packaged_vectors_and_schemas(env, tmp_path)
    for command in COMMANDS:
        done = _pdwire(env, command, "--help")
        assert done.returncode == 0, done.stderr
        assert _install_hint(COMMANDS[command]) in " ".join(done.stdout.split()), command
    _assert_hint(_pdwire(env, "bootstrap"), "bootstrap", "fastapi")
    _assert_hint(_pdwire(env, "proxy", *PROXY_ARGS), "proxy", "httpx")
    _assert_hint(_pdwire(env, "conformance", "list"), "conformance", "pyzmq")
    _assert_hint(_pdwire(env, "node", "--role", "decode"), "node", "torch")
    _assert_hint(_pdwire(env, "run"), "run", "torch")


def test_with_runtime(install: Install) -> None:
    """The bootstrap server serves; the node, run and the harness name what they lack."""
    env = install("runtime")
    _check_bootstrap_serves(env)
    for command, args in (("node", ("--role", "decode")), ("run", ())):
        done = _pdwire(env, command, *args)
        _assert_hint(done, command, "torch")
        assert "mooncake-transfer-engine-non-cuda" in done.stderr
        assert "fastapi" not in done.stderr
    _assert_hint(_pdwire(env, "conformance", "list"), "conformance", "mooncake")


def test_with_the_node_extra(install: Install) -> None:
    """torch (CPU) and the Mooncake transfer engine without vLLM: a whole P/D deployment runs
    and D verifies every byte it was sent."""
    env = install("node")
    done = _pdwire(env, "node", "--help")
    assert done.returncode == 0, done.stderr
    done = _pdwire(env, "run", *SMALL_RUN, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert " ".join(done.stdout.split()).count("verified 1") == 1, done.stdout
    done = _pdwire(env, "conformance", "list")
    assert done.returncode == 0 and "producer/" in done.stdout, done.stderr


def _check_the_packaged_vectors_and_schemas(env: Path, tmp_path: Path) -> None:
    """``vectors check`` reads the vectors in the installed package; ``--dir`` reads others."""
    count = len(vectors.all_vectors())
    done = _pdwire(env, "vectors", "check")
    assert done.returncode == 0 and done.stdout.endswith(f"{count} passed, 0 failed\n"), done
    where = _python(env, "from pdwire import vectors; print(vectors.packaged())").strip()
    assert Path(where).is_relative_to(env), where
    done = _pdwire(env, "decode", str(Path(where) / "response-legacy-finish.msgpack"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status_name"] == "FINISH"
    other = tmp_path / "other-vectors"
    assert _pdwire(env, "vectors", "write", "--dir", str(other)).returncode == 0
    (other / "pull-legacy-minimal.msgpack").write_bytes(b"\xc1")
    done = _pdwire(env, "vectors", "check", "--dir", str(other))
    assert done.returncode == 1 and "FAIL pull-legacy-minimal" in done.stdout, done
    _python(
        env,
        "from pdwire.schema import packaged, schemas\n"
        "assert {e.name: e.read_text() for e in packaged().iterdir()} == schemas()",
    )


def _check_bootstrap_serves(env: Path) -> None:
    proc = subprocess.Popen(
        [str(env / "bin" / "pdwire"), "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=env,
        env=_user_env(),
    )
    try:
        banner = _first_line(proc, COMMAND_TIMEOUT)
        assert banner.startswith("bootstrap server (pdwire/2) at http://127.0.0.1:"), banner
        url = banner.split(" at ")[1].strip()
        with urllib.request.urlopen(f"{url}/health", timeout=COMMAND_TIMEOUT) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=COMMAND_TIMEOUT)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=COMMAND_TIMEOUT)


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([proc.stdout], [], [], left)[0]:
            return proc.stdout.readline()
    raise AssertionError(f"no output within {timeout} s")


def _assert_hint(done: subprocess.CompletedProcess[str], command: str, absent: str) -> None:
    """One line on stderr that names what is missing and the extra that brings it; exit 2."""
    line = done.stderr.strip()
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr + done.stdout and "\n" not in line, done.stderr
    assert line.startswith(f"pdwire {command}: not installed: "), line
    assert absent in line.split(": ")[2] and line.endswith(_install_hint(COMMANDS[command])), line


def _install_hint(extras: tuple[str, ...]) -> str:
    return f"pip install 'pdwire[{','.join(extras)}]'"


def _pdwire(
    env: Path, *args: str, timeout: float = COMMAND_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(env / "bin" / "pdwire"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=env,
        env=_user_env(),
    )


def _python(env: Path, code: str) -> str:
    done = subprocess.run(
        [str(env / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        cwd=env,
        env=_user_env(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _user_env() -> dict[str, str]:
    """This environment, less what would let the venv import from the repository, and with
    Python writing the bytecode of what it imports, as it does by default."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _copy_tree(root: Path, dest: Path) -> None:
    """The files git would commit: tracked or new, not ignored (no venv, cache or build)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
        timeout=COMMAND_TIMEOUT,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source, target = root / name, dest / name
        if not os.path.lexists(source):  # deleted, not yet committed
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            target.write_bytes(source.read_bytes())


def _build(source: Path, hook: str, dist: Path) -> str:
    """Call the build backend's hook in ``source`` (setuptools, as installed here: offline)."""
    code = (
        "import sys\nfrom setuptools import build_meta\n"
        "print(getattr(build_meta, sys.argv[1])(sys.argv[2]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, hook, str(dist)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        env=_user_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _install(env: Path, requirement: str) -> None:
    """Install from the cache only; on a miss (a cold cache, or dependencies that changed),
    download into the cache from the package index once and install again."""
    pip = [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python")]
    # No bytecode at install: the commands write that of what they import (``_user_env``).
    offline = [*pip, "install", "--no-compile", "--no-index", "--find-links", str(CACHE)]
    offline.append(requirement)
    done = _pip(offline, isolated=True)
    if done.returncode != 0:
        CACHE.mkdir(parents=True, exist_ok=True)
        fill = _pip([*pip, "download", "--dest", str(CACHE), requirement], isolated=False)
        assert fill.returncode == 0, fill.stdout[-3000:]
        for own in CACHE.glob("pdwire-*"):  # the wheel under test is installed from its path
            own.unlink()
        done = _pip(offline, isolated=True)
    assert done.returncode == 0, done.stdout[-3000:]


def _pip(command: list[str], isolated: bool) -> subprocess.CompletedProcess[str]:
    """pip, with this machine's configuration (index, mirrors) only when downloading."""
    env = _user_env()
    if isolated:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=INSTALL_TIMEOUT,
        env=env,
    )


def _wheel_names(built: Built) -> list[str]:
    with zipfile.ZipFile(built.wheel) as whl:
        return whl.namelist()
