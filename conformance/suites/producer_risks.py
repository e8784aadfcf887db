"""Producer cases for the known risks of vLLM 0.33 (facts file §10) that no other case family
covers. The others carry ``risk=`` where they are: 1 (producer/10.11/3, producer/7.2/3),
2 (producer/10.11/2), 4 (producer/10.11/5), 5 (producer/10.3/2), 9 (producer/3.6/1),
10 (producer/3.5/1), 11 (producer/10.3/3), 12 (producer/4.1/3); 6, 7 and 8 are a D's and a
proxy's."""

from __future__ import annotations

from ..case import case
from .producer_env import ProducerCtx
from .producer_pairing import control, expect_loaded_slices


@case(
    "producer/10.4/3",
    "10.4.3",
    covers=("7.3-R3", "5.1-R3"),
    risk=3,
)
async def reused_transfer_id_is_served(t: ProducerCtx) -> None:
    """A transfer_id that was served already, used again by a new P request, is that request's:
    its KV is served, and P goes on serving others (vLLM 0.33's record_send_reqs could raise
    KeyError here and silently skip its bookkeeping)."""
    first = await t.load()
    t.expect_loaded(first)
    t.release(first)
    prompt = t.prompt()
    full = await control(t, prompt)
    again = await t.load(prompt=prompt, transfer=first.transfer_id)
    try:
        expect_loaded_slices(t, again, full)
    finally:
        t.release(again)
    other = await t.load()
    t.expect_loaded(other)
    t.release(other)
