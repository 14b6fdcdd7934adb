"""Micro-batch allocation under a token budget (the sequences' lengths only: no tensors).

``allocate_micro_batches``: first-fit-decreasing gives a feasible count; Karmarkar-Karp (largest
differencing) balances token sums at the smallest count from ceil(total/budget) up where its
result fits, else FFD's bins are balanced by local moves and swaps; past ``KK_WORK_MAX`` items x
bins, longest-processing-time at the fewest bins that fit. A sequence over the budget raises
``ValueError`` or, with ``oversize='own_mb'``, gets a micro-batch of its own. Sequences are never
truncated. ``karmarkar_karp`` also splits a batch over data-parallel ranks (``dp.py``).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def lower_bound(lengths: Sequence[int], max_tokens: int) -> int:
    """ceil(total / budget): no allocation can use fewer micro-batches."""
    return math.ceil(sum(lengths) / max_tokens)


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of indices, each bin's length sum <= max_tokens (all lengths must fit)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if slot is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[slot].append(i)
            loads[slot] += lengths[i]
    return bins


def karmarkar_karp(lengths: Sequence[int], k: int) -> list[list[int]]:
    """k-way largest differencing: k bins of indices with balanced length sums (some may be empty).

    Each item starts as a k-partition [item, {}, ...]; the two partitions with the largest
    spread are merged, heaviest subset of one with the lightest of the other, until one is left.
    """
    heap = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        subsets = [(lengths[i], [i])] + [(0, [])] * (k - 1)
        heapq.heappush(heap, (-lengths[i], i, subsets))  # spread = max - min = the item's length
    while len(heap) > 1:
        _, tie_a, a = heapq.heappop(heap)
        _, tie_b, b = heapq.heappop(heap)
        merged = [
            (sa + sb, ia + ib)
            for (sa, ia), (sb, ib) in zip(sorted(a, key=lambda s: -s[0]), sorted(b, key=lambda s: s[0]))
        ]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), min(tie_a, tie_b), merged))
    return [sorted(ix) for _, ix in heap[0][2]] if heap else [[] for _ in range(k)]


def _best_exchange(heavy: list[int], light: list[int], lengths: Sequence[int], gap: int):
    """The move (i, None) or swap (i, j) from heavy to light bringing the pair's sums closest
    together; None if nothing strictly narrows the gap. Shifting d tokens narrows it iff 0 < d < gap."""
    best, best_err = None, gap
    for i in heavy:
        for j in [None] + light:
            d = lengths[i] - (lengths[j] if j is not None else 0)
            if 0 < d < gap and abs(gap - 2 * d) < best_err:
                best, best_err = (i, j), abs(gap - 2 * d)
    return best


def _rebalance(bins: list[list[int]], lengths: Sequence[int], max_rounds: int) -> list[list[int]]:
    """Narrow the heaviest-lightest gap by moves and swaps. Never breaks the budget: the light
    bin ends below the heavy bin's old sum, which was within it."""
    bins = [list(b) for b in bins]
    for _ in range(max_rounds):
        sums = [sum(lengths[i] for i in b) for b in bins]
        hi, lo = sums.index(max(sums)), sums.index(min(sums))
        step = _best_exchange(bins[hi], bins[lo], lengths, sums[hi] - sums[lo])
        if step is None:
            break
        i, j = step
        bins[hi].remove(i)
        bins[lo].append(i)
        if j is not None:
            bins[lo].remove(j)
            bins[hi].append(j)
    return [sorted(b) for b in bins]


KK_WORK_MAX = 20_000  # items x bins past which KK (O(n k log k) in Python) gives way to LPT


def longest_processing_time(lengths: Sequence[int], k: int) -> list[list[int]]:
    """k bins: items longest first, each into the lightest bin so far (a heap; O(n log k)).

    A bin's sum ends at most total/k + its last item, which is one of the shortest placed."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    return _bins(_lpt(lengths, order, k)[0], k)


def _lpt(lengths: Sequence[int], order: list[int], k: int) -> tuple[list[int], int]:
    """LPT over ``order`` (longest first): (each item's bin, the heaviest bin's sum)."""
    # the first k items (longest first) each open an empty bin, in bin order (ties go to the lower
    # bin): placed directly, then one heapify, the same bins as k heap steps from all-empty
    first = order[:k]
    heap = [(lengths[i], b) for b, i in enumerate(first)] + [(0, b) for b in range(len(first), k)]
    heapq.heapify(heap)
    bin_of = [0] * len(lengths)
    for b, i in enumerate(first):
        bin_of[i] = b
    replace = heapq.heapreplace
    for i in order[k:]:
        load, b = heap[0]
        bin_of[i] = b
        replace(heap, (load + lengths[i], b))
    return bin_of, max(load for load, _ in heap)


def _bins(bin_of: list[int], k: int) -> list[list[int]]:
    """Item -> bin assignment as the non-empty bins' ascending index lists."""
    bins: list[list[int]] = [[] for _ in range(k)]
    for i, b in enumerate(bin_of):
        bins[b].append(i)
    return [b for b in bins if b]


def _lpt_fewest(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """LPT at the fewest bins from ceil(total/budget) up where every bin fits; many items (the
    boba batch: ~8K sequences into ~1.6K micro-batches) keep it within ~2 % of that bound.
    A count that does not fit is followed by the one whose mean load leaves room for its
    overshoot (heaviest - mean), then the counts are bisected back to the fewest that fits.
    Terminates: at one bin per item every bin fits (each item is within the budget here)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    total = sum(lengths)
    lo = lower_bound(lengths, max_tokens) - 1  # the largest count known not to fit
    k, best = lo + 1, None
    while best is None:
        bin_of, heaviest = _lpt(lengths, order, k)
        if heaviest <= max_tokens:
            best = bin_of
        else:  # the next count whose mean load leaves room for this overshoot over the mean
            over = heaviest - total / k
            lo, k = k, min(len(lengths), max(k + 1, math.ceil(total / max(max_tokens - over, max_tokens / 2))))
    hi = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        bin_of, heaviest = _lpt(lengths, order, mid)
        if heaviest <= max_tokens:
            hi, best = mid, bin_of
        else:
            lo = mid
    return _bins(best, hi)


def _balanced(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Fewest bins found between the lower bound and FFD's count, balanced.

    KK at the smallest count where its result fits the budget; if none does, FFD's bins
    (feasible by construction) balanced by local moves and swaps.
    """
    if len(lengths) * lower_bound(lengths, max_tokens) > KK_WORK_MAX:
        return _lpt_fewest(lengths, max_tokens)
    ffd = first_fit_decreasing(lengths, max_tokens)
    for k in range(lower_bound(lengths, max_tokens), len(ffd) + 1):
        bins = [b for b in karmarkar_karp(lengths, k) if b]
        if len(bins) == k and max(sum(lengths[i] for i in b) for b in bins) <= max_tokens:
            return bins
    return _rebalance(ffd, lengths, max_rounds=4 * len(lengths))


def refuse_oversize(lengths: Sequence[int], max_tokens_per_mb: int) -> None:
    """``ValueError`` naming the first sequence over the budget (oversize='error'), if any."""
    i = next((i for i, n in enumerate(lengths) if n > max_tokens_per_mb), None)
    if i is not None:
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, over the micro-batch budget "
            f"max_tokens_per_mb={max_tokens_per_mb}; raise the budget or set oversize='own_mb'"
        )


def allocate_micro_batches(lengths: Sequence[int], max_tokens_per_mb: int, oversize: str = "error") -> list[list[int]]:
    """Partition sequence indices into micro-batches whose token sums are <= max_tokens_per_mb.

    Returns lists of indices (ascending within a micro-batch); every index appears exactly once.
    """
    if max_tokens_per_mb < 1:
        raise ValueError(f"max_tokens_per_mb={max_tokens_per_mb}: expected an integer >= 1")
    if oversize not in ("error", "own_mb"):
        raise ValueError(f"oversize={oversize!r}: expected 'error' or 'own_mb'")
    big = [i for i, n in enumerate(lengths) if n > max_tokens_per_mb]
    if big and oversize == "error":
        refuse_oversize(lengths, max_tokens_per_mb)
    if not big and sum(lengths) <= max_tokens_per_mb:  # everything fits one micro-batch
        return [list(range(len(lengths)))]
    small = [i for i, n in enumerate(lengths) if n <= max_tokens_per_mb]
    bins = _balanced([lengths[i] for i in small], max_tokens_per_mb) if small else []
    return [[small[j] for j in b] for b in bins] + [[i] for i in big]
