"""How the trainer computes: sequence packing and the packed (lean) forward, chunked-head logprobs,
micro-batches under a token budget, the optimizer and schedules, data-parallel ranks (FSDP2)."""
