"""A P's KV geometry where the P says it without a fingerprint: the model's ``config.json`` when
its ``GET /v1/models`` names a local path (vLLM's ``root``), and the block size of vLLM's
``/metrics`` (the labels of ``vllm:cache_config_info``). Neither says how a layer's K and V lie
(``--kv-layout``): that is the attention backend's choice, which no route of vLLM names."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import httpx

from pdwire.sim.geometry import Geometry

#: vLLM's cache-config gauge, whose labels are the fields of its CacheConfig.
_CACHE_INFO: Final = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL: Final = re.compile(r'(\w+)="([^"]*)"')
#: Bytes per element of the model dtypes of a config.json; any other is taken as 2.
_DTYPE_BYTES: Final = {"float32": 4, "float": 4, "float64": 8}


@dataclasses.dataclass(frozen=True)
class Found:
    """The geometry found (None when some part is missing), where each part came from, and
    what is missing and why."""

    geometry: Geometry | None
    sources: tuple[str, ...] = ()
    missing: str = ""

    def describe(self) -> str:
        g = self.geometry
        if g is None:
            return self.missing
        return (
            f"{g.num_layers} layers, {g.num_kv_heads} KV heads, head size {g.head_dim}, block "
            f"size {g.block_size} (from {' and '.join(self.sources)})"
        )


def model_dims(config: Mapping[str, Any]) -> tuple[int, int, int, int] | str:
    """(layers, KV heads, head size, bytes per element) of a Hugging Face ``config.json``, or
    why not."""
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, Mapping):
        config = text  # a multimodal model's language model
    if "kv_lora_rank" in config:
        return (
            "it is an MLA model (kv_lora_rank): one latent region per layer, a layout the "
            "fake D does not lay out"
        )
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    try:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return int(config["num_hidden_layers"]), kv_heads, head, _DTYPE_BYTES.get(dtype, 2)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return f"its config.json has no usable {exc}"


def cache_info(metrics: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` in its Prometheus text ({} if none)."""
    m = _CACHE_INFO.search(metrics)
    return dict(_LABEL.findall(m.group(1))) if m else {}


async def discover(http: httpx.AsyncClient, api: str, timeout: float = 10.0) -> Found:
    """What P's API at ``api`` says of its KV geometry."""

    async def get(route: str) -> httpx.Response | None:
        try:
            return await http.get(f"{api}{route}", timeout=timeout)
        except httpx.HTTPError:
            return None

    models, metrics = await asyncio.gather(get("/v1/models"), get("/metrics"))
    try:
        body = models.json() if models is not None else None
    except ValueError:
        body = None
    return found_in(api, body, metrics.text if metrics is not None else "")


def found_in(api: str, models: Any, metrics: str) -> Found:
    """The geometry that P's ``GET /v1/models`` body ``models`` and ``/metrics`` text say."""
    try:
        entry = models["data"][0]
        root = str(entry.get("root") or entry["id"])
    except (KeyError, IndexError, TypeError, AttributeError):
        return Found(None, missing=f"GET {api}/v1/models names no model")
    config_path = Path(root) / "config.json"
    try:
        dims = model_dims(json.loads(config_path.read_text()))
    except (OSError, ValueError) as exc:
        why = f"the model {root!r} is not a local path with a config.json here ({exc})"
        return Found(None, missing=why)
    if isinstance(dims, str):
        return Found(None, missing=f"the model at {root}: {dims}")
    info = cache_info(metrics)
    if not info.get("block_size", "").isdigit():
        return Found(None, missing=f"GET {api}/metrics has no vllm:cache_config_info block_size")
    layers, kv_heads, head, elem = dims
    if info.get("cache_dtype", "auto").startswith("fp8"):
        elem = 1
    geometry = Geometry(layers, kv_heads, head, int(info["block_size"]), dtype_bytes=elem)
    return Found(geometry, (str(config_path), f"{api}/metrics"))
