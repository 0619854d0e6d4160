#!/usr/bin/python3
"""kv_quant_ref.py — an independent numpy implementation of the int8/int4 KV row scheme that
common/dtype.h documents (tests/test_kv_quant.c compares the cpu kernel's bytes with it).

usage: kv_quant_ref.py int8|int4 HEAD_DIM IN OUT_CODES OUT_DEQUANT
IN: rows of HEAD_DIM float32 (native byte order). OUT_CODES: each row as the cache stores it —
the codes (int8, or int4 nibbles: element 2i low, 2i+1 high, as code + 8), then one float16 scale
per group. OUT_DEQUANT: the rows dequantized, float32.

The scheme, written from the documentation rather than the C: groups of 32 elements of a row
(the whole row when HEAD_DIM is not a multiple of 32); scale s = float16(max|x| / qmax) with
qmax 127 (int8) or 7 (int4), rounded to nearest even and saturated at 65504; codes
clip(rint(x / s), -qmax, qmax) (rint: half to even), all codes 0 where s is 0; x' = code * s.
Every quotient and product is one float32 operation."""
import sys

import numpy as np

GROUP = 32


def quantize(rows, qmax):
    """codes (int32, rows' shape) and float16 scales ([rows][groups]) of float32 rows."""
    n, hd = rows.shape
    gs = GROUP if hd % GROUP == 0 else hd
    g = rows.reshape(n, hd // gs, gs)
    amax = np.max(np.abs(g), axis=2)
    with np.errstate(over="ignore"):
        s32 = (amax / np.float32(qmax)).astype(np.float32)
        s16 = np.minimum(s32, np.float32(65504.0)).astype(np.float16)
    s = s16.astype(np.float32)[:, :, None]
    safe = np.where(s == 0, np.float32(1), s)
    q = np.rint((g / safe).astype(np.float32))
    q = np.where(s == 0, np.float32(0), q)
    q = np.clip(q, -qmax, qmax).astype(np.int32)
    return q.reshape(n, hd), s16


def main():
    kind, hd = sys.argv[1], int(sys.argv[2])
    rows = np.fromfile(sys.argv[3], dtype=np.float32).reshape(-1, hd)
    qmax = {"int8": 127, "int4": 7}[kind]
    q, s16 = quantize(rows, qmax)
    if kind == "int8":
        codes = q.astype(np.int8).view(np.uint8)
    else:
        u = (q + 8).astype(np.uint8)
        codes = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    out = np.concatenate([codes, s16.view(np.uint8).reshape(len(rows), -1)], axis=1)
    out.tofile(sys.argv[4])
    gs = GROUP if hd % GROUP == 0 else hd
    s = np.repeat(s16.astype(np.float32), gs, axis=1)
    (q.astype(np.float32) * s).astype(np.float32).tofile(sys.argv[5])


if __name__ == "__main__":
    main()
