"""The connector's scheduler half: which requests load (D) or send (P) their KV, and when their
blocks may be freed. It keeps no protocol state: it tells the workers what the scheduler decided,
in ``PdwireConnectorMetadata``, and the workers' agents speak the protocol.

D (``do_remote_prefill``): the prompt's KV is loaded asynchronously (the request waits in
``WAITING_FOR_REMOTE_KVS``), into the blocks that hold no cached prefix; a request that ends
before it was scheduled only asks P to release (an empty pull), as vLLM does; one that ends while
loading is aborted. P (``do_remote_decode``): a request that reached its length cap keeps its
blocks until every D worker pulled them (``delay_free``); one that ended otherwise (a stop token
as its only token, an abort) frees them at once and P tells D at once that nothing will come.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final

from vllm.v1.request import RequestStatus

from pdwire.events import RequestQueued

from .metadata import Load, NoSend, PdwireConnectorMetadata, Send

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: The keys D needs in ``kv_transfer_params`` (§5.2).
DECODE_KEYS: Final = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
#: How many transfer_ids D remembers having pulled for.
REMEMBERED: Final = 4096


def _deadline(request: Request, params: dict[str, Any]) -> float | None:
    """5.2-R4: ``deadline_ms`` counts from when D received the request."""
    ms = params.get("deadline_ms")
    if isinstance(ms, bool) or not isinstance(ms, int) or ms < 1:
        return None
    return request.arrival_time + ms / 1000


class PdwireScheduler:
    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, lease: float | None = None
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.produces = transfer.is_kv_producer
        self.consumes = transfer.is_kv_consumer
        self._lease = lease
        self._kv_cache_config = kv_cache_config
        self._pending = PdwireConnectorMetadata()
        self._loading: set[str] = set()  # D: loads asked for and not reported yet
        self._pulled: OrderedDict[str, None] = OrderedDict()  # D: transfer_ids pulled for
        self._transfer_of: dict[str, str] = {}  # P: request id -> transfer_id, until freed
        self._owner: dict[str, str] = {}  # P: transfer_id -> the request that holds it
        self._duplicates: set[str] = set()  # P: requests whose transfer_id another one holds

    # -- D --------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """With a lease, D renews P's hold on the request's KV from its arrival, also while it
        waits in the queue (6.4-R6); the workers' sessions stop when its load settles."""
        params = request.kv_transfer_params
        if not (self._lease and self.consumes and params and params.get("do_remote_prefill")):
            return
        if all(params.get(k) for k in DECODE_KEYS):
            self._pending.queued.append(
                RequestQueued(
                    request.request_id,
                    str(params["transfer_id"]),
                    str(params["remote_engine_id"]),
                    str(params["remote_bootstrap_addr"]),
                )
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.consumes and params and params.get("do_remote_prefill")):
            return 0, False
        if not all(params.get(k) for k in DECODE_KEYS):
            return 0, False  # computed here (update_state_after_alloc says why)
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _load(self, request: Request, params: dict[str, Any], blocks: list[list[int]]) -> None:
        params["do_remote_prefill"] = False  # one transfer per request
        if not all(params.get(k) for k in DECODE_KEYS):
            logger.warning(
                "request %s: kv_transfer_params %s lack one of %s; it is computed here",
                request.request_id,
                params,
                list(DECODE_KEYS),
            )
            return
        transfer_id = str(params["transfer_id"])
        if not any(blocks) and transfer_id in self._pulled:
            # vLLM's API server resubmits a D request that ended in an error as a request that
            # never started; P settled the transfer with the first pull already.
            return
        self._pending.loads.append(
            Load(
                d_req_id=request.request_id,
                transfer_id=transfer_id,
                engine_id=str(params["remote_engine_id"]),
                bootstrap_addr=str(params["remote_bootstrap_addr"]),
                blocks=blocks,
                deadline=_deadline(request, params),
            )
        )
        self._pulled[transfer_id] = None
        if len(self._pulled) > REMEMBERED:
            self._pulled.popitem(last=False)
        if any(blocks):
            self._loading.add(request.request_id)

    # -- P --------------------------------------------------------------------------------

    def _start_send(self, request: Request, params: dict[str, Any]) -> None:
        req_id = request.request_id
        transfer_id = params.get("transfer_id")
        if not transfer_id:
            logger.warning("request %s: do_remote_decode without a transfer_id", req_id)
            return
        if req_id in self._transfer_of or req_id in self._duplicates:
            return  # scheduled again (after a preemption): already known
        owner = self._owner.get(str(transfer_id))
        if owner is not None:
            logger.warning(
                "request %s: transfer_id %s is held by request %s; its KV is not sent",
                req_id,
                transfer_id,
                owner,
            )
            self._duplicates.add(req_id)
            return
        self._owner[str(transfer_id)] = req_id
        self._transfer_of[req_id] = str(transfer_id)
        self._pending.sends.append(Send(str(transfer_id), req_id))

    def _release(self, req_id: str) -> None:
        transfer_id = self._transfer_of.pop(req_id, None)
        if transfer_id is not None and self._owner.get(transfer_id) == req_id:
            del self._owner[transfer_id]

    # -- the hooks ------------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.consumes and params.get("do_remote_prefill"):
            # No external tokens (the whole prompt but its last token was cached here): only
            # tell P to release.
            ids = (
                [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
                if num_external_tokens > 0
                else []
            )
            if ids:
                ids = list(self._kv_cache_config.select_transfer_block_ids(ids))
            self._load(request, params, ids)
        elif self.produces and params.get("do_remote_decode"):
            self._start_send(request, params)

    def build_connector_meta(self) -> PdwireConnectorMetadata:
        meta, self._pending = self._pending, PdwireConnectorMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Whether the request's blocks stay allocated until a worker reports them sent."""
        params = request.kv_transfer_params
        if not params:
            return False
        req_id = request.request_id
        if self.consumes and params.get("do_remote_prefill"):
            self._load(request, params, [])  # ended before it was scheduled
            return False
        if req_id in self._loading:
            self._loading.discard(req_id)
            self._pending.aborts.append(req_id)
            return False
        if not (self.produces and params.get("do_remote_decode")):
            return False
        if req_id in self._duplicates:
            self._duplicates.discard(req_id)
            return False
        transfer_id = self._transfer_of.get(req_id) or params.get("transfer_id")
        if not transfer_id or self._owner.get(str(transfer_id), req_id) != req_id:
            return False
        if request.status == RequestStatus.FINISHED_LENGTH_CAPPED and block_ids:
            self._transfer_of.setdefault(req_id, str(transfer_id))
            self._pending.sends.append(Send(str(transfer_id), req_id, [list(block_ids)]))
            return True
        self._release(req_id)
        self._pending.no_sends.append(NoSend(str(transfer_id), req_id, request.status.name))
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_sending or ():
            self._release(req_id)
        for req_id in output.finished_recving or ():
            self._loading.discard(req_id)
