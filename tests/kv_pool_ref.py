#!/usr/bin/python3
"""kv_pool_ref.py - an independent model of InfiniGen's KV cache pool victims (tests/test_kv_pool.c
runs it), written from the paper's §4.4 text, not from rekv's C code: "the pool manager increments
a counter for each prefetched KV entry and selects a victim with the smallest count in the KV
cache pool. If any counter becomes saturated, all the counter values are reduced by half." FIFO
"simply evicts the oldest residing token". The counter's candidates are the older half of the
residing entries, as the authors' code takes them (snu-comparch/InfiniGen, kv_cache_mask: "avoid
evicting recently added ones"). rekv's choices where both are silent: 8-bit counters (saturated at
255, halved by a shift), ties to the oldest entry, a new entry's count 0, the half rounded up.

  kv_pool_ref.py TRACE_JSON
    TRACE_JSON: {"policy": "counter"|"fifo", "limit": L, "len0": N, "steps": [[i, ...], ...]}:
    N entries (positions 0..N-1) are in the pool before the first step; step k (the token at
    position N + k arrives) prefetches the live entries of ranks i (0 = the oldest live entry, in
    the order given), then makes room for the new entry.
    Prints {"victims": [[positions evicted at step k], ...]}."""
import json
import sys

import numpy as np

SATURATED = 255


def main():
    tr = json.load(open(sys.argv[1]))
    limit, pos = tr["limit"], np.arange(tr["len0"], dtype=np.int64)
    count = np.zeros(tr["len0"], dtype=np.int64)
    out = []
    for k, ranks in enumerate(tr["steps"]):
        for r in ranks:  # one increment at a time: a saturation halves before the next
            count[r] += 1
            if count[r] == SATURATED:
                count //= 2
        victims = []
        while len(pos) + 1 > limit:
            half = (len(pos) + 1) // 2  # the older half of the residing entries
            v = 0 if tr["policy"] == "fifo" else int(np.argmin(count[:half]))  # argmin: the first
            victims.append(int(pos[v]))
            pos, count = np.delete(pos, v), np.delete(count, v)
        pos = np.append(pos, tr["len0"] + k)
        count = np.append(count, 0)
        out.append(victims)
    json.dump({"victims": out}, sys.stdout)


if __name__ == "__main__":
    main()
