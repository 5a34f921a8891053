"""Compiled (numba) exact top-k for :class:`~sorl_verl.retrieval.bm25.BM25Scorer`: block-max MaxScore.

The index is bm25s' CSC layout unchanged: term ``t``'s postings are ``indices[indptr[t]:indptr[t+1]]``
(document positions, ascending) with ``data[...]`` the float32 score of ``(t, doc)``. At load,
:func:`block_maxima` cuts every posting list into blocks of ``block`` postings (the last one
shorter) and keeps each block's largest score and last document (8 bytes per block: 1/128 of
the postings' bytes at ``block = 128``, ``BM25Scorer.kernel_block``), and each term's largest
score (``max_score``, equal to ``np.maximum.reduceat``). Load cost: one pass over ``data`` (the
numpy scorer's ``max_score`` already made it) and one read of ``indices`` per block, which
touches every page of a memory-mapped ``indices`` once; nothing is written next to the index
(no sidecar file). Memory: 8 bytes per block, e.g. 4.4 MB for the 70.5M postings of the
synthetic 1M-passage index, ~93 MB at 21M passages (~1.5e9 postings).

:func:`topk_query` scores one query. Its lists ``0..m-1`` (the non-empty query terms) come sorted
by ascending bound ``ub_i = w_i * max_score`` (``w_i``: the term's count in the query) and split
at ``n_non`` exactly as the numpy scorer splits them, so that a document's score is the numpy
scorer's float32 arithmetic, bit for bit::

    c_i(d) = fl32(w_i * data_i(d))                           (absent term: no term)
    P(d)   = fold_+ of c_i(d), i = n_non .. m-1 (ascending)  (the "essential" partial score)
    T(d)   = fold_+ of c_i(d), i = 0 .. n_non-1 (ascending)
    s(d)   = fl32(P(d) + T(d))                               (T = 0 adds exactly nothing)

and the candidates are the documents of lists ``n_non..m-1`` (``n_non = 0``: every list; the
numpy scorer's single-term and exhaustive paths are that case). The result is the exact top
``k`` of ``s`` over the candidates, ordered by score descending, ties by smaller document.
:func:`sample_kth` is the numpy scorer's ``theta`` sample (its ``_lookup`` fold), compiled.
:func:`plan_query` makes the numpy scorer's other per-query decisions (term order, ``theta``,
the split) in compiled code too, and :func:`search` runs one query end to end, so a query holds
the GIL only for its text analysis.

The search is MaxScore over windows of ``window`` documents (the shape of Lucene's MaxScore bulk
scorer): ``tau`` is a lower bound on the k-th best score (the caller's ``tau0``, then the k-th
score in a heap of the best so far); lists ``0..p-1`` whose bounds sum (a prefix) stays below
``tau`` are non-essential: a document only in them cannot enter, so candidates are the
documents of lists ``p..m-1`` (``p >= n_non``). A window starts at the smallest unvisited
essential document. Every list's *window bound* ``wb_i`` is ``w_i`` times the largest block
maximum over the window; if their sum is below ``tau`` the whole window is passed over, and a
block of one list that lies inside the window is passed over when ``w_i * bmax + (sum of the
other lists' wb) < tau``: none of its documents can reach ``tau`` (the rest of a passed-over
document's score is missing from the accumulator below, which only ever drops documents that
could not enter). The essential postings are added into a window accumulator (float64, a
bound only), which marks the candidates. Each non-essential list is either *accumulated* (its
window postings added to documents already marked, never marking one: chosen when its length is
at most ``accumulate`` times the essential lists' total, since reading a list in order costs far
less per posting than a search in it; the add is branch-free, multiplied by whether the document
is marked, because a branch on that mispredicts often and made the read ~5x dearer) or
*probed*: bounded over the window by ``wb``, then per surviving candidate by the block that
would hold it, and searched (galloping) only while the candidate's upper bound still reaches
``tau``. The few candidates left get their exact score from the lists themselves, in document
order. ``p`` and each list's mode are updated between windows.

Pruning is safe under float32 rounding: with ``u = 2**-24`` each stored product
``fl32(w x) <= w x (1 + u)`` and a float32 fold of ``n`` positive terms is at most
``(1 + u)**(n-1)`` times the exact sum, so ``s(d) <= UB(d) * (1 + (m + 1) u + O(u^2))`` for any
float64 upper bound ``UB(d)`` of the exact sum. A document is dropped only when
``UB(d) * (1 + rel) < tau`` with ``rel = (m + 2) * 2**-23`` (twice that, covering the
higher-order and float64 terms), i.e. only when ``s(d) < tau``; ties at ``tau`` are evaluated
(a later, larger document loses a tie to the heap's, as the order requires). Scores are assumed
positive (BM25 ``lucene`` scores are). All functions are ``nogil``: threads score queries in
parallel. Per call, four window buffers of ``window`` entries (512 KB at 16,384) are allocated,
whatever the corpus size.
"""

from __future__ import annotations

import numpy as np
from numba import njit

SENTINEL = np.iinfo(np.int64).max


@njit(nogil=True, cache=True)
def block_maxima(
    data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(bbase, bmax, blast, max_score)``: term ``t``'s block ``j`` is entry ``bbase[t] + j``.

    Block ``j`` of term ``t`` holds postings ``indptr[t] + j*block`` up to (excluding)
    ``min(indptr[t] + (j+1)*block, indptr[t+1])``; ``bmax`` is its largest score, ``blast`` its
    last (largest) document, ``max_score[t]`` the term's largest score (0 for an empty list,
    equal to ``np.maximum.reduceat``). One pass over ``data``, one read per block of ``indices``.
    """
    n_terms = len(indptr) - 1
    bbase = np.empty(n_terms + 1, np.int64)
    bbase[0] = 0
    for t in range(n_terms):
        bbase[t + 1] = bbase[t] + (indptr[t + 1] - indptr[t] + block - 1) // block
    bmax = np.empty(bbase[n_terms], np.float32)
    blast = np.empty(bbase[n_terms], np.int32)
    tmax = np.zeros(n_terms, np.float32)
    for t in range(n_terms):
        b, end = bbase[t], indptr[t + 1]
        for p0 in range(indptr[t], end, block):
            p1 = min(p0 + block, end)
            mx = data[p0]
            for q in range(p0 + 1, p1):
                if data[q] > mx:
                    mx = data[q]
            bmax[b], blast[b] = mx, indices[p1 - 1]
            if b == bbase[t] or mx > tmax[t]:
                tmax[t] = mx
            b += 1
    return bbase, bmax, blast, tmax


@njit(nogil=True, cache=True)
def _seek(indices: np.ndarray, pos: int, end: int, target: int) -> int:
    """First position ``p`` in ``[pos, end)`` with ``indices[p] >= target`` (``end`` if none); galloping."""
    if pos >= end or indices[pos] >= target:
        return pos
    lo, step = pos, 1  # invariant: indices[lo] < target
    while True:
        hi = lo + step
        if hi >= end:
            hi = end
            break
        if indices[hi] >= target:
            break
        lo = hi
        step *= 2
    while hi - lo > 1:  # indices[lo] < target <= indices[hi] (or hi == end)
        mid = (lo + hi) >> 1
        if indices[mid] >= target:
            hi = mid
        else:
            lo = mid
    return hi


@njit(nogil=True, cache=True)
def _worse(s1: float, d1: int, s2: float, d2: int) -> bool:
    """Whether ``(s1, d1)`` ranks below ``(s2, d2)``: lower score, or the same score and a larger document."""
    return s1 < s2 or (s1 == s2 and d1 > d2)


@njit(nogil=True, cache=True)
def _sift_down(hs: np.ndarray, hd: np.ndarray, n: int, i: int) -> None:
    """Restore the min-heap (worst entry at 0) of ``hs/hd[:n]`` below ``i``."""
    while True:
        least, left, right = i, 2 * i + 1, 2 * i + 2
        if left < n and _worse(hs[left], hd[left], hs[least], hd[least]):
            least = left
        if right < n and _worse(hs[right], hd[right], hs[least], hd[least]):
            least = right
        if least == i:
            return
        hs[i], hs[least] = hs[least], hs[i]
        hd[i], hd[least] = hd[least], hd[i]
        i = least


@njit(nogil=True, cache=True)
def _push(hs: np.ndarray, hd: np.ndarray, n: int, s: np.float32, d: int) -> None:
    """Add ``(s, d)`` as entry ``n`` of the min-heap ``hs/hd[:n]``."""
    hs[n], hd[n] = s, d
    i = n
    while i > 0:
        parent = (i - 1) // 2
        if not _worse(hs[i], hd[i], hs[parent], hd[parent]):
            return
        hs[i], hs[parent] = hs[parent], hs[i]
        hd[i], hd[parent] = hd[parent], hd[i]
        i = parent


@njit(nogil=True, cache=True)
def _shallow(blast: np.ndarray, bstart: int, n_blocks: int, j: int, target: int) -> int:
    """First block ``>= j`` (of a list whose block ends are ``blast[bstart:bstart+n_blocks]``) ending at
    or after document ``target``; ``n_blocks`` if none. Galloping."""
    if j >= n_blocks or blast[bstart + j] >= target:
        return j
    lo, step = j, 1  # invariant: block lo ends before target
    while True:
        hi = lo + step
        if hi >= n_blocks:
            hi = n_blocks
            break
        if blast[bstart + hi] >= target:
            break
        lo = hi
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if blast[bstart + mid] >= target:
            hi = mid
        else:
            lo = mid
    return hi


@njit(nogil=True, cache=True)
def sample_kth(
    indices: np.ndarray,
    data: np.ndarray,
    sample: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    w: np.ndarray,
    k: int,
) -> np.float32:
    """The ``k``-th largest of the sorted documents ``sample``'s scores over the lists ``starts/ends``.

    A document's score is the float32 fold ``0 + w_0 x_0 + w_1 x_1 + ...`` over the lists that
    hold it, in the given order: the numpy scorer's ``_lookup``, bit for bit. Each list is
    searched by galloping from the previous sample document's position. 0 if ``len(sample) < k``.
    """
    if k < 1 or len(sample) < k:
        return np.float32(0.0)
    total = np.zeros(len(sample), np.float32)
    for i in range(len(starts)):
        at = starts[i]
        for j in range(len(sample)):
            at = _seek(indices, at, ends[i], sample[j])
            if at == ends[i]:
                break
            if indices[at] == sample[j]:
                total[j] = total[j] + w[i] * data[at]
    total.sort()
    return total[len(total) - k]


@njit(nogil=True, cache=True)
def topk_query(
    indices: np.ndarray,
    data: np.ndarray,
    bmax: np.ndarray,
    blast: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    bstarts: np.ndarray,
    w: np.ndarray,
    ub: np.ndarray,
    n_non: int,
    tau0: float,
    k: int,
    block: int,
    window: int,
    accumulate: float,
    out_docs: np.ndarray,
    out_scores: np.ndarray,
) -> int:
    """Exact top-``k`` of ``s(d)`` (module docstring) into ``out_docs/out_scores``; returns how many.

    ``starts/ends`` (int64): the non-empty lists' posting ranges, ascending ``ub`` (float64,
    ``w * max_score``); ``bstarts``: each list's first block in ``bmax/blast``; ``w``: float32
    weights; ``tau0``: a lower bound on the k-th best score such that at least ``k`` candidates
    score at least it (0 when unknown); ``window`` (>= 1): documents per window; ``accumulate``:
    a non-essential list at most this many times the essential lists' total length is read in
    order rather than probed. ``out_*`` have room for ``k`` entries.
    """
    m = len(starts)
    pos = starts.copy()  # essential and accumulated lists: first posting of the next window; probed: search start
    wpos = starts.copy()  # first posting of the current window (exact scoring searches from here)
    blk = np.zeros(m, np.int64)  # probed lists: block holding the first posting >= the current document
    bnd = np.zeros(m, np.float64)
    wb = np.zeros(m, np.float64)  # per list: its largest contribution in the current window
    prefix = np.zeros(m + 1, np.float64)  # prefix[i]: sum of the bounds of lists 0..i-1
    for i in range(m):
        prefix[i + 1] = prefix[i] + ub[i]
    rel = (m + 2) * 2.0**-23
    tau = tau0
    p = n_non  # lists p..m-1 are essential (numpy's non-essential lists never give candidates)
    while p < m and prefix[p + 1] * (1.0 + rel) < tau:
        p += 1
    ess_len = 0
    for i in range(p, m):
        ess_len += ends[i] - starts[i]
    accumulated = np.zeros(m, np.bool_)
    for i in range(p):
        accumulated[i] = ends[i] - starts[i] <= accumulate * ess_len
    acc = np.full(window, -1.0)  # per window offset: float64 sum so far (-1: not a candidate)
    touched = np.empty(window, np.int64)
    surv = np.empty(window, np.int64)
    sacc = np.empty(window, np.float64)
    hs = np.empty(k, np.float32)
    hd = np.empty(k, np.int64)
    hn = 0
    c = np.zeros(m, np.float32)
    hit = np.zeros(m, np.bool_)
    while p < m:
        ws = SENTINEL
        for i in range(p, m):
            if pos[i] < ends[i] and indices[pos[i]] < ws:
                ws = indices[pos[i]]
        if ws == SENTINEL:
            break
        we = ws + window  # the window: documents ws .. we-1
        probe_bound = 0.0  # probed lists: sum of the largest block maximum over the window
        wsum = 0.0  # every list: the same sum (a bound on any score in the window)
        for i in range(m):
            n_blocks = (ends[i] - starts[i] + block - 1) // block
            probed = i < p and not accumulated[i]
            if probed:
                j = blk[i] = _shallow(blast, bstarts[i], n_blocks, max(blk[i], (pos[i] - starts[i]) // block), ws)
            else:
                j = _shallow(blast, bstarts[i], n_blocks, (pos[i] - starts[i]) // block, ws)
            mx = np.float32(0.0)
            while j < n_blocks:  # the blocks holding documents ws .. we-1
                if bmax[bstarts[i] + j] > mx:
                    mx = bmax[bstarts[i] + j]
                if blast[bstarts[i] + j] >= we - 1:
                    break
                j += 1
            wb[i] = w[i] * np.float64(mx)
            wsum += wb[i]
            if probed:
                probe_bound += wb[i]
        if wsum * (1.0 + rel) < tau:  # no document of the window can reach tau
            for i in range(p, m):
                pos[i] = _seek(indices, pos[i], ends[i], we)
            continue
        nt = 0
        for i in range(p, m):  # essential postings: mark and add
            wi, q, e = w[i], pos[i], ends[i]
            wpos[i] = q
            others = wsum - wb[i]
            fresh = i == p  # the window's first list: every document is new
            while q < e:
                b = (q - starts[i]) // block
                bend = min(starts[i] + (b + 1) * block, e)
                if blast[bstarts[i] + b] < we and (wi * np.float64(bmax[bstarts[i] + b]) + others) * (1.0 + rel) < tau:
                    q = bend  # no document of this block can reach tau
                    continue
                done = False
                if fresh:
                    while q < bend:
                        doc = indices[q]
                        if doc >= we:
                            done = True
                            break
                        o = doc - ws
                        acc[o] = wi * data[q]
                        touched[nt] = o
                        nt += 1
                        q += 1
                else:
                    while q < bend:
                        doc = indices[q]
                        if doc >= we:
                            done = True
                            break
                        o = doc - ws
                        x = wi * data[q]
                        if acc[o] < 0.0:
                            acc[o] = x
                            touched[nt] = o
                            nt += 1
                        else:
                            acc[o] += x
                        q += 1
                if done:
                    break
            pos[i] = q
        for i in range(p):  # accumulated non-essential postings: add to marked documents only
            if accumulated[i]:
                wi, e = w[i], ends[i]
                others = wsum - wb[i]
                q = wpos[i] = _seek(indices, pos[i], e, ws)
                while q < e:
                    b = (q - starts[i]) // block
                    bend = min(starts[i] + (b + 1) * block, e)
                    if (
                        blast[bstarts[i] + b] < we
                        and (wi * np.float64(bmax[bstarts[i] + b]) + others) * (1.0 + rel) < tau
                    ):
                        q = bend  # no document of this block can reach tau
                        continue
                    done = False
                    while q < bend:
                        doc = indices[q]
                        if doc >= we:
                            done = True
                            break
                        o = doc - ws
                        a0 = acc[o]  # branch-free (a branch on a0 mispredicts here): adds 0 to unmarked ones
                        acc[o] = a0 + (wi * data[q]) * (a0 >= 0.0)
                        q += 1
                    if done:
                        break
                pos[i] = q
        ns = 0
        for t in range(nt):
            o = touched[t]
            if (acc[o] + probe_bound) * (1.0 + rel) >= tau:
                surv[ns], sacc[ns] = o, acc[o]
                ns += 1
            acc[o] = -1.0
        if ns == 0:  # tau unchanged: so are p and the modes
            continue
        for a in range(1, ns):  # document order (few survivors: insertion sort)
            o, v = surv[a], sacc[a]
            b = a - 1
            while b >= 0 and surv[b] > o:
                surv[b + 1], sacc[b + 1] = surv[b], sacc[b]
                b -= 1
            surv[b + 1], sacc[b + 1] = o, v
        for r in range(ns):
            d, partial = ws + surv[r], sacc[r]
            if (partial + probe_bound) * (1.0 + rel) < tau:  # tau rose since the filter
                continue
            rest = 0.0
            for i in range(p):
                if not accumulated[i]:
                    n_blocks = (ends[i] - starts[i] + block - 1) // block
                    j = blk[i] = _shallow(blast, bstarts[i], n_blocks, blk[i], d)
                    bnd[i] = w[i] * np.float64(bmax[bstarts[i] + j]) if j < n_blocks else 0.0
                    rest += bnd[i]
            if (partial + rest) * (1.0 + rel) < tau:
                continue
            alive = True
            for i in range(p - 1, -1, -1):  # probed lists, largest bound first
                if accumulated[i]:
                    continue
                rest -= bnd[i]
                hit[i] = False
                if bnd[i] > 0.0:  # d is in block blk[i] if in the list at all
                    first = starts[i] + blk[i] * block
                    pos[i] = _seek(indices, max(pos[i], first), min(first + block, ends[i]), d)
                    if pos[i] < ends[i] and indices[pos[i]] == d:
                        c[i] = w[i] * data[pos[i]]
                        hit[i] = True
                        partial += c[i]
                if (partial + rest) * (1.0 + rel) < tau:
                    alive = False
                    break
            if not alive:
                continue
            for i in range(m):  # essential and accumulated lists: the exact contributions
                if i >= p or accumulated[i]:
                    q = wpos[i] = _seek(indices, wpos[i], pos[i], d)
                    hit[i] = q < pos[i] and indices[q] == d
                    if hit[i]:
                        c[i] = w[i] * data[q]
            part = np.float32(0.0)  # the exact score: the numpy scorer's folds
            for i in range(n_non, m):
                if hit[i]:
                    part = part + c[i]
            rest32 = np.float32(0.0)
            for i in range(n_non):
                if hit[i]:
                    rest32 = rest32 + c[i]
            s = part + rest32
            if hn < k:
                _push(hs, hd, hn, s, d)
                hn += 1
            elif _worse(hs[0], hd[0], s, d):
                hs[0], hd[0] = s, d
                _sift_down(hs, hd, hn, 0)
            else:
                continue
            if hn == k and hs[0] > tau:
                tau = hs[0]
        if p < m and prefix[p + 1] * (1.0 + rel) < tau:  # lists turned non-essential: choose their mode
            while p < m and prefix[p + 1] * (1.0 + rel) < tau:
                ess_len -= ends[p] - starts[p]
                p += 1
            for i in range(p):
                accumulated[i] = ends[i] - starts[i] <= accumulate * ess_len
    for n in range(hn - 1, -1, -1):  # pop the worst first: fill from the back
        out_scores[n], out_docs[n] = hs[0], hd[0]
        hs[0], hd[0] = hs[n], hd[n]
        _sift_down(hs, hd, n, 0)
    return hn


@njit(nogil=True, cache=True)
def kth_largest(data: np.ndarray, start: int, end: int, k: int) -> np.float32:
    """The ``k``-th largest of ``data[start:end]`` (``1 <= k <= end - start``): the top-k heap of
    :func:`_push`/:func:`_sift_down` with one document for all, i.e. a min-heap by score alone."""
    hs = np.empty(k, np.float32)
    hd = np.zeros(k, np.int64)
    for n in range(k):
        _push(hs, hd, n, data[start + n], 0)
    for q in range(start + k, end):
        if data[q] > hs[0]:
            hs[0] = data[q]
            _sift_down(hs, hd, k, 0)
    return hs[0]


@njit(nogil=True, cache=True)
def plan_query(
    indices: np.ndarray,
    data: np.ndarray,
    indptr: np.ndarray,
    max_score: np.ndarray,
    kth: np.ndarray,
    term_ids: np.ndarray,
    k: int,
    short_list: int,
    theta_sample: int,
    exhaustive_postings: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, float]:
    """``(terms, starts, ends, w, ub, n_non, tau0)`` of :func:`topk_query` for a query's term ids (repeats count).

    The numpy scorer's own decisions, compiled (``BM25Scorer._query_terms``, ``_theta`` and the
    split): the distinct terms by ascending bound ``ub = count * max_score`` (float64; stable,
    from id order), their non-empty lists only; ``theta`` = the ``k``-th best score of a sample
    (the first ``theta_sample`` documents of the shortest list, scored by :func:`sample_kth` over
    the lists of at most ``short_list`` postings, else over the shortest list) raised to
    ``w * (k-th largest score)`` of each such short list; ``n_non`` = the non-empty lists among
    the prefix whose bounds' running sum stays below ``theta``; ``tau0 = theta * (1 - 2 rel)``.
    ``n_non = 0, tau0 = 0`` for one list, at most ``exhaustive_postings`` postings, or no
    essential list left. ``kth[t]`` caches term ``t``'s ``k``-th largest score (NaN: not yet known;
    filled here, the same value by whichever thread computes it).
    """
    ids = np.sort(term_ids)
    n = 0
    for i in range(len(ids)):
        if i == 0 or ids[i] != ids[i - 1]:
            n += 1
    terms = np.empty(n, np.int64)
    counts = np.zeros(n, np.int64)
    n = -1
    for i in range(len(ids)):
        if i == 0 or ids[i] != ids[i - 1]:
            n += 1
            terms[n] = ids[i]
        counts[n] += 1
    n += 1
    bounds = np.empty(n, np.float64)
    for i in range(n):
        bounds[i] = counts[i] * np.float64(max_score[terms[i]])
    for a in range(1, n):  # stable insertion sort by bound (few terms)
        t, c, b = terms[a], counts[a], bounds[a]
        j = a - 1
        while j >= 0 and bounds[j] > b:
            terms[j + 1], counts[j + 1], bounds[j + 1] = terms[j], counts[j], bounds[j]
            j -= 1
        terms[j + 1], counts[j + 1], bounds[j + 1] = t, c, b
    lengths = np.empty(n, np.int64)
    total, n_lists = 0, 0
    for i in range(n):
        lengths[i] = indptr[terms[i] + 1] - indptr[terms[i]]
        total += lengths[i]
        n_lists += lengths[i] > 0
    keep = np.empty(n_lists, np.int64)
    j = 0
    for i in range(n):
        if lengths[i] > 0:
            keep[j] = i
            j += 1
    starts = np.empty(n_lists, np.int64)
    ends = np.empty(n_lists, np.int64)
    w = np.empty(n_lists, np.float32)
    ub = np.empty(n_lists, np.float64)
    for j in range(n_lists):
        i = keep[j]
        starts[j], ends[j] = indptr[terms[i]], indptr[terms[i] + 1]
        w[j], ub[j] = np.float32(counts[i]), bounds[i]
    terms = terms[keep]
    if n_lists <= 1 or total <= exhaustive_postings:
        return terms, starts, ends, w, ub, 0, 0.0
    short = np.empty(n_lists, np.int64)  # the lists of at most short_list postings, in order
    n_short, first = 0, 0  # first: the shortest list (the first of equals)
    for j in range(n_lists):
        if ends[j] - starts[j] <= short_list:
            short[n_short] = j
            n_short += 1
        if ends[j] - starts[j] < ends[first] - starts[first]:
            first = j
    if n_short == 0:  # the sample is scored over the shortest list alone
        short[0] = first
    sampled = short[: max(n_short, 1)]
    sample = indices[starts[first] : min(ends[first], starts[first] + theta_sample)]
    theta = 0.0
    if len(sample) >= k:
        theta = np.float64(sample_kth(indices, data, sample, starts[sampled], ends[sampled], w[sampled], k))
    for j in short[:n_short]:
        if ends[j] - starts[j] >= k:
            v = kth[terms[j]]
            if v != v:
                v = kth[terms[j]] = kth_largest(data, starts[j], ends[j], k)
            theta = max(theta, np.float64(w[j]) * np.float64(v))
    cum, n_prefix = 0.0, 0
    for i in range(n):  # over every term, empty lists (bound 0) included, as the numpy scorer counts
        cum += bounds[i]
        if cum < theta:
            n_prefix = i + 1
        else:
            break
    n_non = 0
    for i in range(n_prefix):
        if lengths[i] > 0:
            n_non += 1
    if n_non == n_lists:  # no essential list left: the numpy path's exhaustive fallback
        return terms, starts, ends, w, ub, 0, 0.0
    rel = (n_lists + 2) * 2.0**-23
    return terms, starts, ends, w, ub, n_non, theta * (1.0 - 2.0 * rel)


@njit(nogil=True, cache=True)
def search(
    indices: np.ndarray,
    data: np.ndarray,
    indptr: np.ndarray,
    max_score: np.ndarray,
    bbase: np.ndarray,
    bmax: np.ndarray,
    blast: np.ndarray,
    kth: np.ndarray,
    term_ids: np.ndarray,
    k: int,
    short_list: int,
    theta_sample: int,
    exhaustive_postings: int,
    block: int,
    window: int,
    accumulate: float,
    out_docs: np.ndarray,
    out_scores: np.ndarray,
) -> int:
    """One query end to end: :func:`plan_query`, then :func:`topk_query` (again with ``tau0 = 0`` if
    ``tau0`` did not bound ``k`` candidates, which float rounding can cause). Returns how many
    results were written (at most ``k`` and at most the query's postings)."""
    terms, starts, ends, w, ub, n_non, tau0 = plan_query(
        indices, data, indptr, max_score, kth, term_ids, k, short_list, theta_sample, exhaustive_postings
    )
    if len(terms) == 0:
        return 0
    room = min(k, int((ends - starts).sum()))
    bstarts = bbase[terms]
    args = (indices, data, bmax, blast, starts, ends, bstarts, w, ub, n_non)
    n = topk_query(*args, tau0, room, block, window, accumulate, out_docs, out_scores)
    if n < room and tau0 > 0.0:
        n = topk_query(*args, 0.0, room, block, window, accumulate, out_docs, out_scores)
    return n
