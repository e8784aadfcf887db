"""Consumer case: a KV-cache group with a sliding window (§10.4.7). D lists in that group only
the last ``ceil(window / block_size) + 1`` of a prompt's blocks."""

from __future__ import annotations

from pdwire.planning import window_blocks

from ..case import Unsupported, expect, expect_equal
from .consumer_env import ConsumerCtx, consumer_case


@consumer_case("consumer/10.4/1", "10.4.7", caught_by=("d-window-unclipped",))
async def window_group_lists_its_last_blocks(t: ConsumerCtx) -> None:
    """With a sliding window over its KV-cache group 1, D's pull lists every block of the
    prompt in group 0 and only the last ceil(window / block_size) + 1 of them in group 1; D
    decodes once they are written."""
    window = t.options.sliding_window
    if window is None:
        raise Unsupported(
            "D's sliding window is unknown (give --sliding-window when its KV-cache group 1 "
            "has one)"
        )
    fake = await t.fake_p()
    # long enough that D keeps fewer blocks in group 1 than in group 0 (blocks of <= 16 tokens)
    leg = t.start(fake, prompt=t.prompt(2 * window + 33))
    rx = await t.pull(fake)
    assert rx.pull is not None
    _, groups = rx.pull.req_blocks[rx.d_req(leg.transfer_id)]
    await fake.serve(rx)
    got = await leg.result()
    block_size = t.block_size(rx)
    if block_size is None:
        raise Unsupported("D's block size is unknown (no fingerprint, no --block-size)")
    kept = window_blocks(window, block_size)
    prompt_blocks = -(-len(leg.prompt) // block_size)
    if prompt_blocks <= kept:
        raise Unsupported(f"a prompt of {len(leg.prompt)} tokens fills D's window")
    expect_equal(len(groups), 2, "block lists (one per KV-cache group)")
    expect_equal(len(groups[0]), prompt_blocks, "blocks of group 0 (full attention)")
    expect(
        len(groups[1]) == kept,
        f"group 1 lists {len(groups[1])} blocks for a prompt of {prompt_blocks}: with a "
        f"window of {window} tokens in blocks of {block_size}, D lists the last {kept}",
    )
    t.expect_decoded(got)
