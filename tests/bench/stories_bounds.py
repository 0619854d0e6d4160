#!/usr/bin/env python3
"""What sparse attention can reach on stories260K: a float64 numpy forward pass of the llama2.c
checkpoint (independent of rekv) with every attention row of layers 1..4 at decode positions
(>= prefill 32) restricted to a selected set of keys plus the current one; prints the NLL of each
../shared/eval sample under several selection rules at a budget of --frac of the context.

  python3 tests/bench/stories_bounds.py [--frac 0.2] [--shared ../shared]      (needs python3-numpy)

Rules: oracle_row: each query head its own top keys by exact score (the bound in ../shared/eval's
note; reproduces its oracle_top20_nll); group_max: one set per KV head, the best exact score over
its query group; group_prob: one set per KV head, the group's summed softmax (rekv's rule);
spec_*: group_prob on speculated scores as rekv --mode infinigen makes them, with the skew of
another sample: lookahead 1 (layer i-1's input) or 0 (the layer's own), 30% or all columns.
It also prints the mean cosine between consecutive layers' attention inputs (InfiniGen's premise).

--clo: CLO's head-wise similarity cache instead (issue 13): per (layer > 0, KV head) a query label
and a cached top-k (exact retrieval on a miss), a hit when the least cosine over the group's
queries to the label is >= tau; attention over the cached tokens, 4 sink and 64 recent ones. Prints
the mean cosine of adjacent decode queries per layer (CLO's premise), then NLL, hit ratio and the
link bytes relative to offload's (layer 0 resident, sink and recent on the device) per tau.

--heads: CLO's head profile as rekv heads computes it (gpuworker/heads.h), on sample 0: per layer
the mean cosine of adjacent decode queries and each head's importance (the attention output's
relative squared error with only 4 sink + 64 recent tokens, over the model's largest) — the
reference values of tests/test_heads.c."""
import argparse, json
import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--frac", type=float, default=0.2)
ap.add_argument("--shared", default="../shared")
ap.add_argument("--clo", action="store_true")
ap.add_argument("--heads", action="store_true")
args = ap.parse_args()

f = open(args.shared + "/models/stories260K/stories260K.bin", "rb")
dim, hid, L, H, KVH, V, S = (int(v) for v in np.frombuffer(f.read(28), dtype=np.int32))
shared_cls, V = V > 0, abs(V)
hs, kvd, G = dim // H, dim * KVH // H, H // KVH
w = np.frombuffer(f.read(), dtype=np.float32).astype(np.float64)
off = 0


def take(*shape):
    global off
    n = int(np.prod(shape))
    a = w[off:off + n].reshape(shape)
    off += n
    return a


emb, ra = take(V, dim), take(L, dim)
wq, wk, wv, wo = take(L, dim, dim), take(L, kvd, dim), take(L, kvd, dim), take(L, dim, dim)
rf, w1, w2, w3 = take(L, dim), take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
rfin = take(dim)
take(S, hs // 2), take(S, hs // 2)
cls = emb if shared_cls else take(V, dim)


def rms(x, g):
    return x * g / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def rope(x, pos, nh):
    x = x.reshape(len(pos), nh, hs // 2, 2).copy()
    ang = pos[:, None] * 10000.0 ** (-2 * np.arange(hs // 2) / hs)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0].copy(), x[..., 1].copy()
    x[..., 0], x[..., 1] = a * c - b * s, a * s + b * c
    return x.reshape(len(pos), nh * hs)


def qkv(x, l, pos):
    n = len(pos)
    h = rms(x, ra[l])
    return (rope(h @ wq[l].T, pos, H).reshape(n, H, hs), rope(h @ wk[l].T, pos, KVH).reshape(n, KVH, hs),
            (h @ wv[l].T).reshape(n, KVH, hs))


def softmax_rows(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def top(score, m):
    keep = np.zeros(len(score), bool)
    keep[np.argsort(-score, kind="stable")[:m]] = True
    return keep


def forward(ids, rule=None, skew=None, ratio=1.0, look=0, prefill=32, frac=0.2, taps=None):
    n = len(ids)
    pos = np.arange(n)
    x, prev = emb[ids], None
    causal = np.tril(np.ones((n, n), bool))
    for l in range(L):
        if taps is not None:
            taps.append(x.copy())
        q, k, v = qkv(x, l, pos)
        if rule and rule.startswith("spec") and l > 0:
            qs = qkv(x if look == 0 else prev, l, pos)[0]
        out = np.zeros((n, H, hs))
        for g in range(KVH):
            exact = np.stack([q[:, g * G + j] @ k[:, g].T for j in range(G)]) / np.sqrt(hs)  # G,n,n
            masks = [causal.copy() for _ in range(G)]
            if rule and l > 0:
                if rule.startswith("spec"):
                    A = skew[l][g]
                    rk = int(np.ceil(ratio * hs))
                    qa = np.stack([qs[:, g * G + j] @ A for j in range(G)])
                    ka = k[:, g] @ A
                    cols = np.argsort(-np.abs(np.concatenate([qa.reshape(-1, hs), ka])).sum(0))[:rk]
                    sc = np.einsum("jnc,mc->jnm", qa[:, :, cols], ka[:, cols]) / np.sqrt(hs)
                else:
                    sc = exact
                for p in range(prefill, n):
                    m = max(1, int(np.ceil(frac * (p + 1))))
                    rows = sc[:, p, :p + 1]
                    if rule == "oracle_row":
                        keeps = [top(rows[j], m) for j in range(G)]
                    elif rule == "group_max":
                        keeps = [top(rows.max(0), m)] * G
                    else:
                        keeps = [top(softmax_rows(rows).sum(0), m)] * G
                    for j in range(G):
                        keeps[j][p] = True
                        masks[j][p, :p + 1] = keeps[j]
            for j in range(G):
                pr = softmax_rows(np.where(masks[j], exact[j], -np.inf))
                out[:, g * G + j] = pr @ v[:, g]
        prev = x
        x = x + out.reshape(n, dim) @ wo[l].T
        h = rms(x, rf[l])
        a = h @ w1[l].T
        x = x + (a / (1 + np.exp(-a)) * (h @ w3[l].T)) @ w2[l].T
    lp = np.log(softmax_rows(rms(x, rfin) @ cls.T))
    return -np.mean([lp[p, ids[p + 1]] for p in range(prefill, n - 1)])


def calibrate(ids):
    """rekv's skew: per (layer, KV head) the right singular vectors of the group's queries"""
    taps = []
    forward(ids, taps=taps)
    pos = np.arange(len(ids))
    return [[np.linalg.svd(qkv(taps[l], l, pos)[0][:, g * G:(g + 1) * G].transpose(1, 0, 2).reshape(-1, hs),
                           full_matrices=False)[2].T for g in range(KVH)] for l in range(L)]


def clo(ids, tau, kfrac, sink=4, recent=64, prefill=32):
    n = len(ids)
    pos = np.arange(n)
    x = emb[ids]
    hits = heads = fetched = offload = 0
    for l in range(L):
        q, k, v = qkv(x, l, pos)
        out = np.zeros((n, H, hs))
        for g in range(KVH):
            exact = np.stack([q[:, g * G + j] @ k[:, g].T for j in range(G)]) / np.sqrt(hs)
            mask = np.tril(np.ones((n, n), bool))
            label = cached = None
            for p in range(prefill, n) if l > 0 else ():
                qs = q[p, g * G:(g + 1) * G]
                hit = label is not None and np.min(np.sum(qs * label, 1) / np.linalg.norm(qs, axis=1) /
                                                   np.linalg.norm(label, axis=1)) >= tau
                heads, hits, offload = heads + 1, hits + hit, offload + p + 1
                if not hit:
                    m = max(1, int(np.ceil(kfrac * (p + 1))))
                    cached = top(softmax_rows(exact[:, p, :p + 1]).sum(0), m)
                    label, fetched = qs.copy(), fetched + m
                keep = np.zeros(p + 1, bool)
                keep[:len(cached)] = cached
                keep[:sink] = True
                keep[max(0, p - recent + 1):] = True
                mask[p, :p + 1] = keep
            for j in range(G):
                out[:, g * G + j] = softmax_rows(np.where(mask, exact[j], -np.inf)) @ v[:, g]
        x = x + out.reshape(n, dim) @ wo[l].T
        h = rms(x, rf[l])
        a = h @ w1[l].T
        x = x + (a / (1 + np.exp(-a)) * (h @ w3[l].T)) @ w2[l].T
    lp = np.log(softmax_rows(rms(x, rfin) @ cls.T))
    nll = -np.mean([lp[p, ids[p + 1]] for p in range(prefill, n - 1)])
    return nll, hits / heads, fetched / offload * (L - 1) / L


d = json.load(open(args.shared + "/eval/stories260K.samples.json"))
samples = [np.array(s["ids"] if isinstance(s["ids"], list) else json.loads(s["ids"])) for s in d["samples"]]
rules = [("oracle_row", {}), ("group_max", {}), ("group_prob", {}),
         ("spec la1 30%", dict(ratio=0.3, look=1)), ("spec la0 30%", dict(ratio=0.3, look=0)),
         ("spec la1 all", dict(ratio=1.0, look=1))]
if args.heads:
    ids = samples[0]
    n = len(ids)
    pos = np.arange(n)
    taps = []
    forward(ids, taps=taps)
    imp = np.zeros((L, H))
    for l in range(L):
        q, k, v = qkv(taps[l], l, pos)
        qd = q[32:]
        cos = np.sum(qd[1:] * qd[:-1], 2) / np.linalg.norm(qd[1:], axis=2) / np.linalg.norm(qd[:-1], axis=2)
        print("layer %d adjacent cos %.6f per head %s" % (l, cos.mean(), " ".join("%.4f" % c for c in cos.mean(0))))
        for h in range(H):
            sc = q[:, h] @ k[:, h // G].T / np.sqrt(hs)
            e = e0 = 0
            for p in range(max(32, 68), n):
                keep = np.zeros(p + 1, bool)
                keep[:4] = True
                keep[p - 63:] = True
                of = softmax_rows(sc[p, :p + 1]) @ v[:p + 1, h // G]
                os_ = softmax_rows(np.where(keep, sc[p, :p + 1], -np.inf)) @ v[:p + 1, h // G]
                e, e0 = e + np.sum((of - os_) ** 2), e0 + np.sum(of ** 2)
            imp[l, h] = e / e0
    imp /= imp.max()
    for l in range(L):
        print("layer %d importance %s" % (l, " ".join("%.4f" % x for x in imp[l])))
    raise SystemExit(0)
if args.clo:
    for i, ids in enumerate(samples):
        full = forward(ids)
        pos = np.arange(len(ids))
        taps = []
        forward(ids, taps=taps)
        cos = []
        for l in range(L):
            q = qkv(taps[l], l, pos)[0][32:]
            cos.append(np.mean(np.sum(q[1:] * q[:-1], 2) / np.linalg.norm(q[1:], axis=2) / np.linalg.norm(q[:-1], axis=2)))
        print("sample %d: full %.4f; adjacent decode queries' cos per layer %s" % (i, full, " ".join("%.2f" % c for c in cos)))
        for kfrac in (0.1, 0.2):
            for tau in (0.3, 0.5, 0.7, 0.9, 1.01):
                r, hit, b = clo(ids, tau, kfrac)
                print("  top %.0f%% tau %.2f: %.4f (%+.1f%%) hits %.2f bytes %.3f" % (100 * kfrac, tau, r, 100 * (r / full - 1), hit, b))
    raise SystemExit(0)
print("budget %.0f%% of the context per row, layers 1..%d; NLL (relative to full)" % (100 * args.frac, L - 1))
for i, ids in enumerate(samples):
    full = forward(ids)
    skew = calibrate(samples[(i + 1) % len(samples)])
    taps = []
    forward(ids, taps=taps)
    cos = [float(np.mean(np.sum(taps[l - 1] * taps[l], 1) /
                         np.linalg.norm(taps[l - 1], axis=1) / np.linalg.norm(taps[l], axis=1))) for l in range(1, L)]
    print("sample %d: full %.4f (file: %s); cos(input l-1, input l) %s" %
          (i, full, d["samples"][i]["nll"], " ".join("%.2f" % c for c in cos)))
    for name, kw in rules:
        r = forward(ids, rule=name if not name.startswith("spec") else "spec", skew=skew, frac=args.frac, **kw)
        print("  %-13s %.4f (%+.1f%%)" % (name, r, 100 * (r / full - 1)))
