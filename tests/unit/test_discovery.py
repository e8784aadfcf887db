"""What the producer suite and preflight read of a P's KV geometry when it registered no
fingerprint: a Hugging Face config.json and the labels of vLLM's cache-config gauge."""

from __future__ import annotations

from conformance.discovery import cache_info, model_dims

LLAMA = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_size": 256,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
}


def test_a_llama_config_gives_layers_heads_head_size_and_element_bytes() -> None:
    assert model_dims(LLAMA) == (2, 4, 64, 2, "apart")


def test_missing_kv_heads_and_head_dim_are_derived_as_transformers_does() -> None:
    config = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "head_dim")}
    assert model_dims({**config, "torch_dtype": "float32"}) == (2, 4, 64, 4, "apart")


def test_a_multimodal_config_is_read_through_its_text_config() -> None:
    assert model_dims({"architectures": ["X"], "text_config": LLAMA}) == (2, 4, 64, 2, "apart")


def test_an_mla_config_gives_one_latent_head_of_the_rank_and_rope_size() -> None:
    """As vLLM's head size of an MLA model: kv_lora_rank + qk_rope_head_dim (DeepSeek-V3's)."""
    deepseek = {**LLAMA, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_hidden_layers": 61}
    assert model_dims(deepseek) == (61, 1, 576, 2, "mla")
    # a null kv_lora_rank is not MLA (vLLM: ``kv_lora_rank is not None``)
    assert model_dims({**LLAMA, "kv_lora_rank": None}) == (2, 4, 64, 2, "apart")


def test_an_incomplete_config_says_why_not() -> None:
    partial = model_dims({"num_attention_heads": 4, "num_hidden_layers": 2})
    assert isinstance(partial, str) and "no usable 'hidden_size'" in partial


def test_the_cache_config_gauge_gives_its_labels() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0"} 1.0\n'
        'vllm:num_requests_running{engine="0"} 0.0\n'
    )
    info = cache_info(text)
    assert info["block_size"] == "32" and info["cache_dtype"] == "auto"
    assert cache_info('vllm:num_requests_running{engine="0"} 0.0\n') == {}
