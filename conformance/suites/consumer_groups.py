"""Consumer cases: a D of two KV-cache groups. With a sliding window over group 1, D lists there
only the last ``ceil(window / block_size) + 1`` of a prompt's blocks (§10.4.7); a failure fails
the request, not some of its blocks (§10.10.7)."""

from __future__ import annotations

from pdwire.planning import window_blocks

from ..case import Unsupported, expect, expect_equal
from .consumer_env import ConsumerCtx, consumer_case


@consumer_case(
    "consumer/10.4/1",
    "10.4.7",
)
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


@consumer_case(
    "consumer/10.10/5",
    "10.10.7",
)
async def a_failure_fails_every_group(t: ConsumerCtx) -> None:
    """With more than one KV-cache group, a request P lists in err_reqs after it wrote every
    block of every group fails whole, an HTTP error under the default load-failure policy: no
    group's blocks are taken for loaded."""
    fake = await t.fake_p()
    leg = t.start(fake)
    rx = await t.pull(fake)
    assert rx.pull is not None
    d_req = rx.d_req(leg.transfer_id)
    _, groups = rx.pull.req_blocks[d_req]
    fake.write(rx)
    await fake.reply(rx, err=[d_req], err_msg="the fake P failed this request")
    got = await leg.result()
    if len(groups) < 2:
        raise Unsupported("D has one KV-cache group")
    t.expect_failed(got)
