#!/usr/bin/python3
"""gemma_ref.py — an independent float64 forward of Gemma and Gemma-2, written from the published
formulas of HF transformers (models/gemma/modeling_gemma.py, models/gemma2/modeling_gemma2.py),
not from rekv's C: tests/test_gemma.c compares rekv's logits with it.

    gemma_ref.py forward MODEL_DIR TOKEN...

reads MODEL_DIR's config.json and its one F32 model.safetensors and prints
{"logits": [[...vocab...] per position]} for the tokens at positions 0, 1, ...

The formulas, as HF computes them:
- embeddings times normalizer = torch.tensor(hidden_size ** 0.5, dtype=model dtype) (float32 here)
- GemmaRMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight)
- RoPE: rotate_half over the whole head, inv_freq = 1 / theta^(2j / head_dim)
- attention: softmax(q k^T * scaling + mask) v; Gemma: scaling = head_dim^-0.5; Gemma-2:
  query_pre_attn_scalar^-0.5, then scores = cap * tanh(scores / cap) (attn_logit_softcapping)
  before the mask; grouped-query heads share a KV head (repeat_kv)
- Gemma-2's window: layer i is sliding when not i % 2; the mask drops keys with q - k >= window
- MLP: down(gelu_tanh(gate(x)) * up(x)), gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
  x^3)))
- Gemma layer: x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))
- Gemma-2 layer: x += post_attention_layernorm(attn(input_layernorm(x)));
  x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
- logits = norm(x) @ embed_tokens^T (tied), Gemma-2 then cap * tanh(logits / cap)
  (final_logit_softcapping)
"""
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            raise SystemExit("gemma_ref.py: %s is %s, not F32" % (name, meta["dtype"]))
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(meta["shape"]).astype(np.float64)
    return out


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * (1.0 + w)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def softcap(x, cap):
    return cap * np.tanh(x / cap) if cap else x


def forward(model_dir, tokens):
    cfg = json.load(open(model_dir + "/config.json"))
    two = cfg["model_type"] == "gemma2"
    w = load_safetensors(model_dir + "/model.safetensors")
    T, H = len(tokens), cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d = cfg.get("head_dim", 256)
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    # HF: inv_freq in float32, position * inv_freq in float32, cos and sin of that
    ang = np.arange(T, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
    ang = np.concatenate([ang, ang], axis=1).astype(np.float64)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # x: [T, heads, d]; rotate_half
        half = d // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin

    scaling = cfg.get("query_pre_attn_scalar", 256) ** -0.5 if two else d ** -0.5
    attn_cap = cfg.get("attn_logit_softcapping", 50.0) if two else None
    final_cap = cfg.get("final_logit_softcapping", 30.0) if two else None
    window = cfg.get("sliding_window", 4096) if two else None
    emb = w["model.embed_tokens.weight"]
    x = emb[tokens] * float(np.float32(H ** 0.5))
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        mask = causal
        if two and l % 2 == 0 and window:  # is_sliding = not bool(layer_idx % 2)
            mask = causal + np.tril(np.full((T, T), -np.inf), -window)

        def lin(h, name):
            return h @ w[p + name + ".weight"].T

        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = rope(lin(h, "self_attn.q_proj").reshape(T, nh, d))
        k = rope(lin(h, "self_attn.k_proj").reshape(T, nkv, d))
        v = lin(h, "self_attn.v_proj").reshape(T, nkv, d)
        out = np.empty((T, nh, d))
        for hh in range(nh):
            g = hh // (nh // nkv)
            s = softcap(q[:, hh] @ k[:, g].T * scaling, attn_cap) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, g]
        a = lin(out.reshape(T, nh * d), "self_attn.o_proj")
        if two:
            x = x + rmsnorm(a, w[p + "post_attention_layernorm.weight"], eps)
            h = rmsnorm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        else:
            x = x + a
            h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = lin(gelu_tanh(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
        x = x + (rmsnorm(m, w[p + "post_feedforward_layernorm.weight"], eps) if two else m)
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", emb)
    return softcap(x @ head.T, final_cap)


def main(argv):
    if len(argv) >= 4 and argv[1] == "forward":
        logits = forward(argv[2], [int(t) for t in argv[3:]])
        json.dump({"logits": logits.tolist()}, sys.stdout)
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
