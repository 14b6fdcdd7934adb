"""Inference servers this project starts: the CPU SGLang twin (``sglang_server``, ``sglang_http``) over the
embedded engine, and the vLLM launcher (``vllm_server``, with ``vllm_path`` for vLLM's own environment)."""
