"""The rollout worker: its service (``service``), workflow episodes, agents and OpenAI endpoint, its record.

Subrooms, lowest floor first: ``engines`` (the ``RolloutEngine`` seam and the embedded ``TorchEngine``),
``clients`` (``RemoteEngine`` and the SGLang/vLLM server clients), ``servers`` (the CPU SGLang twin, the
vLLM launcher). The package roots import nothing: the supervisor reads torch-free modules through them
(``clients.server_auth``), and ``import areal_async.cli`` must not load torch (tests/unit/house/test_import_floors.py).
"""
