"""Older variants of the pull, upgraded to the current model (spec §3.8).

| variant (seen in) | what decoding fills in |
|---|---|
| flat block lists ``(transfer_id, [ids])`` (vLLM 0.16 to 0.19) | ``[[ids]]``: one KV-cache group |
| no ``block_lens`` (to 0.18) / ``kv_block_lens`` (to 0.24) | ``[]``: P uses its own layout |
| no ``registered_*`` layer metadata (vLLM 0.16 to 0.23) | ``[]``: regions pair by position |
| no ``remote_pp_size`` (vLLM 0.16 to 0.29) | ``1`` |
| no ``layout_id`` (vLLM <= 0.32) | ``0``: the layout travels on every pull |

The last three are plain msgspec defaults and need no upgrade; the first two are upgraded here.
"""

from __future__ import annotations

from typing import Any, Final

#: Fields a pull of vLLM 0.16 to 0.24 may lack; each becomes an empty list.
OPTIONAL_IN_OLDER: Final = ("block_lens", "kv_block_lens")
#: The trait of a pull whose block lists are flat: they are wrapped into one group.
FLAT_BLOCK_LISTS: Final = "flat-block-lists"


def _is_flat(blocks: Any) -> bool:
    return isinstance(blocks, list) and bool(blocks) and all(type(b) is int for b in blocks)


def older_variants(obj: Any) -> list[str]:
    """Names of the older-variant traits of a generically decoded pull, for inspection."""
    if not isinstance(obj, dict):
        return []
    found = []
    req_blocks = obj.get("req_blocks")
    if isinstance(req_blocks, dict) and any(
        isinstance(v, list) and len(v) == 2 and _is_flat(v[1]) for v in req_blocks.values()
    ):
        found.append(FLAT_BLOCK_LISTS)
    found += [f"no-{name.replace('_', '-')}" for name in OPTIONAL_IN_OLDER if name not in obj]
    if "registered_layer_names" not in obj:
        found.append("no-layer-metadata")
    if "remote_pp_size" not in obj:
        found.append("no-remote-pp-size")
    if "layout_id" not in obj:
        found.append("no-layout-id")
    return found


def upgrade_pull(obj: Any) -> tuple[dict[str, Any], list[str]] | None:
    """The current form of an older pull and the traits upgraded, or None if there were none."""
    if not isinstance(obj, dict):
        return None
    out = dict(obj)
    traits = []
    req_blocks = obj.get("req_blocks")
    if isinstance(req_blocks, dict):
        upgraded = {}
        for req_id, value in req_blocks.items():
            if isinstance(value, list) and len(value) == 2 and _is_flat(value[1]):
                value = [value[0], [value[1]]]
                if FLAT_BLOCK_LISTS not in traits:
                    traits.append(FLAT_BLOCK_LISTS)
            upgraded[req_id] = value
        out["req_blocks"] = upgraded
    for name in OPTIONAL_IN_OLDER:
        if name not in out:
            out[name] = []
            traits.append(f"no-{name.replace('_', '-')}")
    return (out, traits) if traits else None
