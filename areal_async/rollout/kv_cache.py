"""The embedded engine's preallocated KV cache: keys and values of every layer, columns outermost, so a
decode step writes one column in place and a row gather copies only the filled columns."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel


class KVCache:
    """Keys/values ``k``, ``v``, columns outermost: ``[0, T)`` are filled, ``[T, C)`` are room.

    On CPU (``rows_last``) (C, L, H, D, B): a layer's column is one contiguous (H, D, B) block
    with the rows innermost, so one-query attention reduces over heads, head dims and keys with
    the rows as the contiguous inner loop (``_attend_rows_last``). Elsewhere (C, L, B, H, D): a layer's
    keys are a (B, H, K, D) view with contiguous head dims, as ``scaled_dot_product_attention``
    wants them. Either way ``k[:T]`` is every filled column of every layer (contiguous), so a row
    gather copies only the filled part."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, T: int, rows_last: bool):
        assert k.shape == v.shape and 0 <= T <= k.shape[0], (tuple(k.shape), tuple(v.shape), T)
        self.k, self.v, self.T, self.rows_last = k, v, T, rows_last
        self.rows_dim = 4 if rows_last else 2

    @classmethod
    def empty(cls, model: PreTrainedModel, B: int, capacity: int) -> "KVCache":
        cfg = model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        L, H, rows_last = cfg.num_hidden_layers, cfg.num_key_value_heads, p.device.type == "cpu"
        shape = (capacity, L, H, D, B) if rows_last else (capacity, L, B, H, D)
        # uninitialised: a column is written before anything reads it (reads stop at T)
        k, v = (torch.empty(shape, dtype=p.dtype, device=p.device) for _ in "kv")
        return cls(k, v, 0, rows_last)

    @property
    def room(self) -> int:
        return self.k.shape[0] - self.T

    @property
    def nbytes(self) -> int:
        """Keys and values, every column (filled or room)."""
        return 2 * self.k.numel() * self.k.element_size()

    def merged_nbytes(self, other: "KVCache") -> int:
        """``nbytes`` of ``self.merge(other)``."""
        columns = max(self.T, other.T) + max(self.room, other.room)
        return self.nbytes // self.k.shape[0] // self.n_rows * columns * (self.n_rows + other.n_rows)

    @property
    def n_rows(self) -> int:
        return self.k.shape[self.rows_dim]

    def bhkd(self, kind: str, i: int, stop: int) -> torch.Tensor:
        """Layer i's keys or values of columns ``[0, stop)`` as a (B, H, stop, D) view."""
        return getattr(self, kind)[:stop, i].permute((3, 1, 0, 2) if self.rows_last else (1, 2, 0, 3))

    def write(self, i: int, start: int, k_BThD: torch.Tensor, v_BThD: torch.Tensor) -> None:
        """Layer i's keys and values of T new tokens into columns ``[start, start + T)``."""
        perm = (1, 2, 3, 0) if self.rows_last else (1, 0, 2, 3)
        stop = start + k_BThD.shape[1]
        self.k[start:stop, i] = k_BThD.permute(perm)
        self.v[start:stop, i] = v_BThD.permute(perm)

    def _like(self, k: torch.Tensor, v: torch.Tensor, T: int) -> "KVCache":
        return KVCache(k, v, T, self.rows_last)

    def select(self, idx_B: torch.Tensor, start: int) -> "KVCache":
        """Rows ``idx_B`` (in that order), columns from ``start`` on (a copy of the filled ones)."""
        return self._gather(idx_B, start)

    def repeat_rows(self, rows_B: torch.Tensor) -> "KVCache":
        """Row ``rows_B[i]`` of this cache as row i (a group's prompt cache for each of its samples);
        only the filled columns are copied."""
        return self._gather(rows_B, 0)

    def _gather(self, rows_B: torch.Tensor, start: int) -> "KVCache":
        """Rows ``rows_B`` of columns ``[start, T)`` into new buffers with the same room after them.
        Each buffer is gathered as a (columns x before, rows, after) view: on CPU, with the rows
        innermost, that is several times faster than ``index_select`` on the 5D tensor."""
        d, T = self.rows_dim, self.T - start
        shape = list(self.k.shape)
        shape[0], shape[d] = shape[0] - start, len(rows_B)
        out = []
        for src in (self.k, self.v):
            dst = src.new_empty(shape)
            part = src[start : self.T]  # contiguous: columns are outermost
            before, after = math.prod(part.shape[:d]), math.prod(part.shape[d + 1 :])
            torch.index_select(
                part.view(before, part.shape[d], after), 1, rows_B, out=dst[:T].view(before, len(rows_B), after)
            )
            out.append(dst)
        return self._like(*out, T)

    def merge(self, other: "KVCache") -> "KVCache":
        """Rows of ``self`` then of ``other``, the shorter one left-padded with zeros (masked columns)."""
        T, room, d = max(self.T, other.T), max(self.room, other.room), self.rows_dim
        shape = list(self.k.shape)
        B1 = shape[d]
        shape[0], shape[d] = T + room, B1 + other.n_rows
        out = []
        for kind in "kv":
            x = getattr(self, kind).new_empty(shape)
            for part, start in ((self, 0), (other, B1)):
                rows = x.narrow(d, start, part.n_rows)
                rows[: T - part.T] = 0
                rows[T - part.T : T] = getattr(part, kind)[: part.T]
            out.append(x)
        return self._like(*out, T)
