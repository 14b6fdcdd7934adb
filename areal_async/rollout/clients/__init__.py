"""Inference servers from the rollout side: ``RemoteEngine`` over ``ServerClient``s (``remote``), the SGLang
and vLLM clients, their HTTP plumbing and the per-run server key; also the SGLang contract as data
(``sglang_rules``, ``sglang_lora``, ``weight_group``), which the CPU twin in ``servers`` obeys too."""
