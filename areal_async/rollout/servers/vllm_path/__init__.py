"""The directory ``vllm_server.py`` puts on the vLLM environment's PYTHONPATH (only ``areal_vllm_auth`` in it)."""
