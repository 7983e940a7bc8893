"""Interval arithmetic on sorted numpy arrays: unions and how much of a window they cover."""

from __future__ import annotations

from typing import Callable

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge possibly overlapping [start, end) intervals into sorted disjoint ones."""
    if len(starts) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    running_end = np.maximum.accumulate(e)
    # A new block starts where an interval begins after everything before it has ended.
    new_block = np.empty(len(s), bool)
    new_block[0] = True
    new_block[1:] = s[1:] > running_end[:-1]
    block = np.cumsum(new_block) - 1
    block_starts = s[new_block]
    block_ends = np.zeros(block[-1] + 1, np.int64)
    np.maximum.at(block_ends, block, running_end)
    return block_starts, block_ends


def covered(union_starts: np.ndarray, union_ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each window [lo, hi), how many ns the disjoint sorted union covers."""
    if len(union_starts) == 0:
        return np.zeros(len(lo), np.int64)
    prefix = np.concatenate([[0], np.cumsum(union_ends - union_starts)])

    def cover_until(x: np.ndarray) -> np.ndarray:
        # Blocks wholly before x, plus the part of the block x falls in.
        i = np.searchsorted(union_starts, x, side="right")  # blocks starting at or before x
        full = prefix[np.maximum(i - 1, 0)]
        last_start = union_starts[np.maximum(i - 1, 0)]
        last_end = union_ends[np.maximum(i - 1, 0)]
        partial = np.clip(np.minimum(x, last_end) - last_start, 0, None)
        return np.where(i > 0, full + partial, 0)

    return np.clip(cover_until(hi) - cover_until(lo), 0, None)


def innermost_container(starts: np.ndarray, ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each query [lo, hi), the index of the last interval (in start order) that contains it, or -1.

    `starts` must be sorted, with ties ordered outermost first; for properly nested intervals the
    last container is the innermost. A sparse table of range maxima over `ends` lets every query
    jump back over whole blocks of intervals that end too early, log2(n) steps in all.
    """
    n = len(starts)
    if n == 0:
        return np.full(len(lo), -1)
    levels = [ends]
    while (1 << len(levels)) <= n:
        prev, half = levels[-1], 1 << (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))  # levels[k][x] = max(ends[x : x + 2**k])
    pos = np.searchsorted(starts, lo, side="right") - 1
    for k in range(len(levels) - 1, -1, -1):
        first = pos - (1 << k) + 1
        inside = first >= 0
        block_max = levels[k][np.clip(first, 0, len(levels[k]) - 1)]
        pos = np.where(inside & (block_max < hi), pos - (1 << k), pos)
    found = (pos >= 0) & (ends[np.clip(pos, 0, n - 1)] >= hi)
    return np.where(found, pos, -1)


def end_to_end(groups: int, *times: np.ndarray) -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    """Lay `groups` timelines (threads, devices) end to end on one int64 axis: the returned function moves time t
    of group g to (t - low) + g x span, where [low, low + span) holds every time given, so that no interval of one
    group meets a window or an interval of another and every group is searched at once. None when the times
    span too much for that (an int64 overflow): the caller then takes the groups one by one."""
    given = [t for t in times if len(t)]
    if not given:
        return None
    low = min(int(t.min()) for t in given)
    span = max(int(t.max()) for t in given) - low + 1
    if span * max(groups, 1) >= 2**62:
        return None
    return lambda t, group: (t - np.int64(low)) + group.astype(np.int64) * np.int64(span)
