"""vLLM parts built offline, on CPU, the way vLLM's own connector tests build them: a
``VllmConfig`` of a local tiny ``config.json`` (no weights, no tokenizer), a hand-built
``KVCacheConfig``, a real ``Scheduler`` whose connector is ``PdwireConnector``, requests built
directly, and fake ``ModelRunnerOutput``s that stand in for the workers' reports."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from reference_connector.vllm.connector import PdwireConnector
from reference_connector.vllm.metadata import PdwireConnectorMetadata

BLOCK_SIZE: Final = 16
NUM_BLOCKS: Final = 100
HEAD_DIM: Final = 64
EOS: Final = 2
MODULE: Final = "reference_connector.vllm.connector"

TINY_LLAMA: Final = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "eos_token_id": EOS,
    "torch_dtype": "float32",
}


def model_dir(root: Path) -> Path:
    path = root / "tiny-llama-config"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def vllm_config(
    model: Path,
    role: str,
    policy: str = "fail",
    *,
    engine_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), tokenizer=str(model), skip_tokenizer_init=True, dtype="float32"
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdwireConnector",
            kv_connector_module_path=MODULE,
            kv_role=role,  # type: ignore[arg-type]
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
            kv_connector_extra_config={"mooncake_protocol": "tcp", **(extra or {})},
            engine_id=engine_id,
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(layers: list[str], num_kv_heads: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(
        BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=HEAD_DIM, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def scheduler(config: VllmConfig) -> Scheduler:
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(["layer"]),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)
init_none_hash(sha256)


def request(
    prompt_tokens: int, params: dict[str, Any] | None, max_tokens: int = 16, first: int = 10
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    sampling.update_from_generation_config({}, EOS)
    if params is not None:
        sampling.extra_args = {"kv_transfer_params": dict(params)}
    return Request(
        request_id=f"req-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=list(range(first, first + prompt_tokens)),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=_HASHER,
    )


def decode_params(transfer_id: str = "xfer-1") -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p-engine",
        "remote_bootstrap_addr": "http://127.0.0.1:8998",
        "transfer_id": transfer_id,
    }


def prefill_params(transfer_id: str = "xfer-1") -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def output(
    reqs: Iterable[Request],
    *,
    token: int = 7,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    """What the workers report after a step: one sampled token per running request, and the
    connector's transfer results."""
    ids = [r.request_id for r in reqs]
    kv = KVConnectorOutput(
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving or set(),
        invalid_block_ids=invalid_block_ids or set(),
    )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        kv_connector_output=kv,
    )


def connector(s: Scheduler) -> PdwireConnector:
    assert isinstance(s.connector, PdwireConnector)
    return s.connector


def metadata(out: Any) -> PdwireConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, PdwireConnectorMetadata)
    return meta


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_empty(s: Scheduler) -> None:
    """Nothing left: no request, every block but the null block free with no reference."""
    assert not s.requests and not s.running and len(s.waiting) == 0
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
