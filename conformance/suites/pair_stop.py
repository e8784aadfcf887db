"""Pair cases: a transfer P will not send (§7.2.1, §10.11). When the only token P generates is a
stop token, P frees its blocks and sends nothing; vLLM 0.33 then leaves D waiting for its ready
wait (480 s, risk 1 of the facts file). pdwire/2 answers every pull for it at once."""

from __future__ import annotations

from pdwire.error_strings import WILL_NOT_SEND

from ..case import Unsupported, case, expect
from ..peers.observer import REAL
from .pair_env import PROMPTS, Exchange, PairCtx


async def _stop_body(t: PairCtx, prompt: str) -> dict[str, object]:
    """A request whose first generated token is one of its stop_token_ids."""
    probe = await t.local(t.body(prompt, max_tokens=1, return_token_ids=True))
    if not probe.token_ids:
        raise Unsupported("D does not return the generated token ids (return_token_ids)")
    body = t.body(prompt, stop_token_ids=[probe.token_ids[0]])
    local = await t.local(body)
    if local.finish_reason != "stop" or local.text:
        raise Unsupported(
            f"D does not stop on stop_token_ids (finish_reason {local.finish_reason!r}, "
            f"text {local.text!r})"
        )
    return body


async def _check_answers(t: PairCtx, x: Exchange, bound: float) -> None:
    # A D may pull for the transfer again after its answer (vLLM's D sends a release-only pull
    # under a new id when its load failed, note of §10.11): each pull seen gets its bound too.
    await t.observer.quiet()
    await t.observer.ended([rec for rec, _ in t.pulls(x)], bound)
    for rec, d_req in t.pulls(x):
        expect(rec.terminal_at is not None, f"P worker {rec.worker} never ended the pull")
        assert rec.terminal_at is not None
        waited = rec.terminal_at - max(rec.t, x.p.done_at)
        expect(
            waited <= bound,
            f"P worker {rec.worker} answered the pull for a transfer it will not send "
            f"{waited:.2f}s after it knew (bound {bound}s)",
        )
        reply = next(
            (r.msg for r in rec.replies if r.msg and d_req in (r.msg.err_reqs or [])), None
        )
        expect(
            reply is not None and reply.status.name in ("FINISH", "CONTINUE"),
            f"P worker {rec.worker} did not list the request in err_reqs of a FINISH or "
            f"CONTINUE: {[r.msg.status.name for r in rec.replies if r.msg]}",
        )
        assert reply is not None
        expect(
            WILL_NOT_SEND in (reply.err_msg or ""),
            f"err_msg {reply.err_msg!r} lacks {WILL_NOT_SEND!r}",
        )
        agreed = "will-not-send" in rec.caps and "will-not-send" in reply.pdwire_caps
        if agreed:
            code = (reply.err_codes or {}).get(d_req, reply.err_code)
            expect(code == "WILL_NOT_SEND", f"with will-not-send agreed, the code is {code!r}")


@case(
    "pair/10.11/1",
    "10.11.1",
    covers=("7.2-R5", "7.2-R6", "7.2-R7", "7.1-R3", "9.3-R3", "7.2-R3"),
    risk=1,
)
async def stop_token_first_is_answered_at_once(t: PairCtx) -> None:
    """When the only token P generates is a stop token, P answers every pull for the transfer at
    once (in err_reqs, "Prefill will not send KV for this request."), to a pdwire/2 D and to a
    D that speaks legacy, and D answers within a bound; an HTTP 200 has D's local text."""
    if t.env.p_version < 2:
        raise Unsupported("P is legacy: vLLM 0.33 holds D until its ready wait expires")
    body = await _stop_body(t, PROMPTS[1])
    local = await t.local(body)
    bound = t.options.answer_bound
    # D may answer by computing the prompt itself: its bound adds the time it takes to do that.
    d_bound = bound + local.elapsed
    legacy = await t.new_view(legacy=True)
    for view in (REAL, legacy):
        x = await t.exchange(body, view=view)
        expect(x.p.ok, f"P's leg failed: {x.p.describe()}")
        waited = x.d.done_at - x.p.done_at
        expect(
            waited <= d_bound,
            f"D answered {waited:.2f}s after P ({view} view): more than {bound}s beyond the "
            f"{local.elapsed:.2f}s it takes to answer the request alone, for a transfer P will "
            "not send",
        )
        await _check_answers(t, x, bound)
        if x.d.ok:
            t.expect_same_text(x, local)
    t.expect_clean("7.2-R3", "3.4-R14")
