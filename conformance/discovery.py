"""A P's KV geometry where the P says it without a fingerprint: the model's ``config.json`` when
its ``GET /v1/models`` names a local path (vLLM's ``root``), and the block size of vLLM's
``/metrics`` (the labels of ``vllm:cache_config_info``). Neither says how a layer's K and V lie
(``--kv-layout``), the attention backend's choice, which no route of vLLM names; an MLA model's
config says its single latent region per layer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

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
        layout = "" if g.kv_layout == "apart" else f", KV layout {g.kv_layout}"
        return (
            f"{g.num_layers} layers, {g.num_kv_heads} KV heads, head size {g.head_dim}, block "
            f"size {g.block_size}{layout} (from {' and '.join(self.sources)})"
        )


class Dims(NamedTuple):
    """What a model's ``config.json`` says of its KV cache."""

    layers: int
    kv_heads: int
    head_size: int
    elem_bytes: int
    kv_layout: str = "apart"  # "mla" for a model whose config has a kv_lora_rank


def model_dims(config: Mapping[str, Any]) -> Dims | str:
    """The KV dimensions of a Hugging Face ``config.json``, or why not. An MLA model (vLLM: a
    ``kv_lora_rank`` that is not null) caches one latent vector per token, of ``kv_lora_rank +
    qk_rope_head_dim`` elements: one KV "head" of that size."""
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, Mapping):
        config = text  # a multimodal model's language model
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    elem = _DTYPE_BYTES.get(dtype, 2)
    try:
        layers = int(config["num_hidden_layers"])
        if config.get("kv_lora_rank") is not None:
            latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
            return Dims(layers, 1, latent, elem, "mla")
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return Dims(layers, kv_heads, head, elem)
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
    elem = 1 if info.get("cache_dtype", "auto").startswith("fp8") else dims.elem_bytes
    geometry = Geometry(
        dims.layers,
        dims.kv_heads,
        dims.head_size,
        int(info["block_size"]),
        dtype_bytes=elem,
        kv_layout=dims.kv_layout,
    )
    return Found(geometry, (str(config_path), f"{api}/metrics"))
