"""The embedded engine's preallocated KV cache: keys and values of every layer in one buffer per kind, so a
decode step writes one column in place and a row gather copies only the filled columns."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

# layout -> (the buffers' dimensions in order, where C = capacity (columns), L = layers, H = kv heads,
# D = head dim, B = rows); ``KVCache`` reads its dims from these names
LAYOUTS = {
    "rows_last": "CLHDB",  # CPU, small head dims: one-query attention with the rows innermost
    "heads": "LBHCD",  # CPU, head dims >= HEADS_MIN_HEAD_DIM: a (row, head)'s keys are one (C, D) block
    "columns": "CLBHD",  # elsewhere (GPU): a layer's keys a (B, H, K, D) view, D contiguous
}
HEADS_MIN_HEAD_DIM = 64


def default_layout(model: PreTrainedModel) -> str:
    """The layout ``KVCache.empty`` uses for ``model`` on its device when none is asked for.

    On CPU the one-query attention of a decode step reads every cached key of every row: with small
    head dims (the tiny models: 8-16) many rows of few keys are fastest as elementwise products with
    the rows innermost (``rows_last``); from head dim 64 (real models) a batched matmul over each
    (row, head)'s contiguous keys is 2-4x faster at 16-192 keys (``heads``; measured at SmolLM2's
    9/3 heads of 64, rows 8-64; at head dim 32 the two cross over near 64 keys)."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        return "columns"
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return "heads" if D >= HEADS_MIN_HEAD_DIM else "rows_last"


class KVCache:
    """Keys/values ``k``, ``v``: columns ``[0, T)`` are filled, ``[T, C)`` are room; the dims' order is the
    ``layout``'s (``LAYOUTS``).

    ``rows_last`` (C, L, H, D, B): a layer's column is one contiguous (H, D, B) block with the rows
    innermost, so one-query attention reduces over heads, head dims and keys with the rows as the
    contiguous inner loop (``kv_decoder._attend_rows_last``). ``heads`` (L, B, H, C, D): a (layer, row,
    head)'s keys are one contiguous (C, D) block, so a layer's keys are a (B * H, K, D) view that batched
    matmuls read as they are (``kv_decoder._attend_heads``); a decode step writes B x H strided rows of D.
    ``columns`` (C, L, B, H, D): a layer's keys are a (B, H, K, D) view with contiguous head dims, as
    ``scaled_dot_product_attention`` wants them. In every layout a row gather copies only the filled
    columns."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, T: int, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {sorted(LAYOUTS)}")
        dims = LAYOUTS[layout]
        self.col_dim, self.rows_dim, self.layer_dim = dims.index("C"), dims.index("B"), dims.index("L")
        assert k.shape == v.shape and 0 <= T <= k.shape[self.col_dim], (tuple(k.shape), tuple(v.shape), T)
        self.k, self.v, self.T, self.layout = k, v, T, layout

    @property
    def rows_last(self) -> bool:
        return self.layout == "rows_last"

    @classmethod
    def empty(cls, model: PreTrainedModel, B: int, capacity: int, layout: str | None = None) -> "KVCache":
        cfg = model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        layout = layout or default_layout(model)
        sizes = dict(C=capacity, L=cfg.num_hidden_layers, H=cfg.num_key_value_heads, D=D, B=B)
        shape = tuple(sizes[d] for d in LAYOUTS[layout])
        # uninitialised: a column is written before anything reads it (reads stop at T)
        k, v = (torch.empty(shape, dtype=p.dtype, device=p.device) for _ in "kv")
        return cls(k, v, 0, layout)

    @property
    def capacity(self) -> int:
        return self.k.shape[self.col_dim]

    @property
    def room(self) -> int:
        return self.capacity - self.T

    @property
    def nbytes(self) -> int:
        """Keys and values, every column (filled or room)."""
        return 2 * self.k.numel() * self.k.element_size()

    def merged_nbytes(self, other: "KVCache") -> int:
        """``nbytes`` of ``self.merge(other)``."""
        columns = max(self.T, other.T) + max(self.room, other.room)
        return self.nbytes // self.capacity // self.n_rows * columns * (self.n_rows + other.n_rows)

    @property
    def n_rows(self) -> int:
        return self.k.shape[self.rows_dim]

    def columns(self, kind: str, start: int, stop: int) -> torch.Tensor:
        """Keys or values of columns ``[start, stop)`` of every layer and row (a view, the layout's dims)."""
        return getattr(self, kind).narrow(self.col_dim, start, stop - start)

    def layer(self, kind: str, i: int, stop: int) -> torch.Tensor:
        """Layer i's keys or values of columns ``[0, stop)``: a view in the layout's order without L."""
        return self.columns(kind, 0, stop).select(self.layer_dim, i)

    def bhkd(self, kind: str, i: int, stop: int) -> torch.Tensor:
        """Layer i's keys or values of columns ``[0, stop)`` as a (B, H, stop, D) view."""
        x = self.layer(kind, i, stop)  # the layout's dims without L
        if self.layout == "rows_last":  # (K, H, D, B)
            return x.permute(3, 1, 0, 2)
        return x if self.layout == "heads" else x.permute(1, 2, 0, 3)  # (B, H, K, D) / (K, B, H, D)

    def write(self, i: int, start: int, k_BThD: torch.Tensor, v_BThD: torch.Tensor) -> None:
        """Layer i's keys and values of T new tokens into columns ``[start, start + T)``."""
        stop = start + k_BThD.shape[1]
        for kind, x in (("k", k_BThD), ("v", v_BThD)):
            self.bhkd(kind, i, stop)[:, :, start:] = x.transpose(1, 2)

    def _like(self, k: torch.Tensor, v: torch.Tensor, T: int) -> "KVCache":
        return KVCache(k, v, T, self.layout)

    def select(self, idx_B: torch.Tensor, start: int) -> "KVCache":
        """Rows ``idx_B`` (in that order), columns from ``start`` on (a copy of the filled ones)."""
        return self._gather(idx_B, start)

    def repeat_rows(self, rows_B: torch.Tensor) -> "KVCache":
        """Row ``rows_B[i]`` of this cache as row i (a group's prompt cache for each of its samples);
        only the filled columns are copied."""
        return self._gather(rows_B, 0)

    def _gather(self, rows_B: torch.Tensor, start: int) -> "KVCache":
        """Rows ``rows_B`` of columns ``[start, T)`` into new buffers with the same room after them.
        With the columns outermost each buffer is gathered as a (columns x before, rows, after) view: on
        CPU, with the rows innermost, that is several times faster than ``index_select`` on the 5D
        tensor. ``heads``: the filled columns of the selected rows, then one copy into the new buffers."""
        c, d, T = self.col_dim, self.rows_dim, self.T - start
        shape = list(self.k.shape)
        shape[c], shape[d] = shape[c] - start, len(rows_B)
        out = []
        for kind in "kv":
            src = self.columns(kind, start, self.T)
            dst = src.new_empty(shape)
            if c == 0:  # contiguous: columns are outermost
                before, after = math.prod(src.shape[:d]), math.prod(src.shape[d + 1 :])
                view = dst[:T].view(before, len(rows_B), after)
                torch.index_select(src.view(before, src.shape[d], after), 1, rows_B, out=view)
            else:
                dst.narrow(c, 0, T).copy_(src.index_select(d, rows_B))
            out.append(dst)
        return self._like(*out, T)

    def merge(self, other: "KVCache") -> "KVCache":
        """Rows of ``self`` then of ``other``, the shorter one left-padded with zeros (masked columns)."""
        T, room, c, d = max(self.T, other.T), max(self.room, other.room), self.col_dim, self.rows_dim
        shape = list(self.k.shape)
        B1 = shape[d]
        shape[c], shape[d] = T + room, B1 + other.n_rows
        out = []
        for kind in "kv":
            x = getattr(self, kind).new_empty(shape)
            for part, start in ((self, 0), (other, B1)):
                rows = x.narrow(d, start, part.n_rows)
                rows.narrow(c, 0, T - part.T).zero_()
                rows.narrow(c, T - part.T, part.T).copy_(part.columns(kind, 0, part.T))
            out.append(x)
        return self._like(*out, T)
