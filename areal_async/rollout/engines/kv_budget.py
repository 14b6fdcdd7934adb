"""The embedded engine's KV cache budget (``rollout.kv_cache_mb``): what a group costs, and refusal.

``KVCache`` preallocates every column a row can reach: a cohort of ``rows`` rows whose longest
prompt is ``T`` tokens and whose longest ``max_new_tokens`` is ``room`` holds

    bytes = rows x (T + room) x 2 (keys, values) x layers x kv_heads x head_dim x dtype size

(``bytes_per_position`` is the product after ``rows x (T + room)``). At Qwen2.5-0.5B's shape
(24 layers, 2 KV heads of 64, bf16) a position costs 12 KiB: a group of 16 samples of 512 + 8,192
tokens is 1.6 GiB, and ``max_batch_groups`` such groups would be what the engine allocated,
unbounded, before this budget existed.

With a budget (bytes > 0) the engine
- refuses a request that could not run even alone (``check_group``: the message says how many
  bytes it needs and which keys move it), so no request can wait forever;
- admits queued groups only while the live caches plus the new cohort (with its transient
  prompt-only prefill cache) stay within the budget (``admissible``); the rest wait for rows to
  finish, so between two engine steps the live KV caches never exceed the budget;
- merges a new cohort into a running one only when the merged copy fits beside both.
Not bounded by it: within one step, a compaction (rows dropped) or a recompute after a weight
update copies one cohort's cache, so the peak inside a step can reach twice the budget.
0 keeps the old behaviour (no bound)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MIB = 1 << 20
TODO = (
    "raise rollout.kv_cache_mb, or lower gconfig.n_samples, gconfig.max_new_tokens or the prompt length "
    "(train_dataset.max_prompt_len)"
)


def bytes_per_position(config, dtype_size: int) -> int:
    """Keys and values of one token in every layer: 2 x layers x kv_heads x head_dim x dtype size."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_size


@dataclass(frozen=True)
class KVBudget:
    per_position: int  # bytes_per_position of the engine's model
    limit: int  # bytes; 0 = no bound

    def cohort_bytes(self, rows: int, columns: int) -> int:
        return rows * columns * self.per_position

    def new_cohort_bytes(self, prompts: Sequence[int], samples: Sequence[int], rooms: Sequence[int]) -> int:
        """A new cohort of these groups (prompt lengths, samples, max_new_tokens) and its prefill cache
        (one row a group, alive until its rows are repeated for the samples)."""
        columns = max(prompts) + max(rooms)
        return self.cohort_bytes(len(prompts) + sum(samples), columns)

    def check_group(self, group_id: str, prompt_len: int, n: int, max_new_tokens: int) -> None:
        """A group that does not fit an empty engine is refused: it could never start."""
        problem = self.refusal(prompt_len, n, max_new_tokens)
        if problem:
            raise ValueError(f"GenRequest {group_id!r}: {problem}; {TODO}")

    def refusal(self, prompt_len: int, n: int, max_new_tokens: int) -> str:
        """Why such a group cannot fit an empty engine ('' when it can)."""
        need = self.new_cohort_bytes([prompt_len], [n], [max_new_tokens])
        if not self.limit or need <= self.limit:
            return ""
        return (
            f"its KV cache needs {need / MIB:.1f} MiB (({n} samples + 1 prefill row) x ({prompt_len} prompt + "
            f"{max_new_tokens} new tokens) x {self.per_position} bytes a position) > rollout.kv_cache_mb="
            f"{self.limit / MIB:.3g}"
        )

    def admissible(self, used: int, groups: Sequence[tuple[int, int, int]]) -> int:
        """How many of ``groups`` ((prompt_len, n, max_new_tokens), in queue order) start now beside
        ``used`` live bytes: the longest prefix whose new cohort fits (all of them without a bound)."""
        if not self.limit:
            return len(groups)
        k = 0
        while k < len(groups):
            prompts, samples, rooms = zip(*groups[: k + 1])
            if used + self.new_cohort_bytes(prompts, samples, rooms) > self.limit:
                break
            k += 1
        return k

    def can_merge(self, used: int, merged: int) -> bool:
        """The merged copy is allocated while both cohorts it is made from are alive."""
        return not self.limit or used + merged <= self.limit
