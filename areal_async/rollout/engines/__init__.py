"""Rollout engines: the ``RolloutEngine`` seam (``engine``) and the embedded ``TorchEngine`` with its parts
(KV cache and budget, the decoders, sampling). Imports nothing from the other rollout subrooms."""
