#!/usr/bin/python3
"""rope_ref.py - an independent reference for rekv's RoPE scaling (tests/test_rope.c runs it).

Written from the published formulas (HF transformers' modeling_rope_utils: default, linear,
dynamic NTK, llama3, YaRN and LongRoPE; the YaRN paper, arXiv 2309.00071; the LongRoPE paper,
arXiv 2402.13753, as Phi-3 configures it), in numpy float64, reading the same config.json that
rekv reads. Nothing here comes from rekv's C code.

  rope_ref.py freqs CONFIG_JSON POS...
      {"attention_factor": a, "inv_freq": [[...] per POS]}: the inverse frequency of each pair at
      each position (they differ only for dynamic NTK past the original length).
  rope_ref.py forward MODEL_DIR TOKEN...
      {"logits": [[...] per token]}: a float64 forward of the Llama/Mistral/Qwen2/Phi-3 model in
      MODEL_DIR (config.json, one F32 model.safetensors) over the tokens at positions 0, 1, ...:
      Phi-3's fused qkv_proj / gate_up_proj split here by rows, and the sliding window (Mistral,
      Phi-3, Qwen2 with use_sliding_window) as HF's mask: key k visible to query q when
      q - W < k <= q.

Dynamic NTK: HF recomputes one table per forward from the current length; rekv (and this
reference) rotates position p with the base for length p + 1, which is HF's table for every
decoded token. LongRoPE likewise: HF takes the long factors for a whole forward whose length
passes the original one; here position p takes them when p + 1 > original, HF's choice for every
decoded token. Angles are rounded as HF rounds them (inv_freq held in float32, the product
position * inv_freq in float32); everything else is float64."""
import json
import math
import struct
import sys

import numpy as np


def rope_params(cfg):
    """(type, dict of the rope_scaling fields, theta) from a config.json dict."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(rs.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rs.get("rope_type", rs.get("type", "default"))
    return kind, rs, theta


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def default_inv_freq(theta, d):
    # theta^(-2j/d) for the d/2 pairs
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def inv_freq_at(cfg, pos):
    """(inv_freq[d/2], attention_factor) at position pos."""
    kind, rs, theta = rope_params(cfg)
    d = head_dim(cfg)
    base = default_inv_freq(theta, d)
    if kind == "default":
        return base, 1.0
    factor = float(rs.get("factor") or 0)
    if kind == "linear":
        # positions divided by factor, i.e. every frequency divided by it
        return base / factor, 1.0
    if kind == "dynamic":
        # NTK-aware: past the trained length L0 the base becomes
        # theta * (factor * L / L0 - (factor - 1))^(d / (d - 2)) for the length L = pos + 1
        l0 = cfg["max_position_embeddings"]
        length = max(pos + 1, l0)
        grown = theta * (factor * length / l0 - (factor - 1)) ** (d / (d - 2))
        return default_inv_freq(grown, d), 1.0
    if kind == "llama3":
        # Llama 3.1: wavelengths longer than L0/low_freq_factor are interpolated by factor,
        # shorter than L0/high_freq_factor kept, and the band between blended linearly in L0/wavelength
        l0 = rs["original_max_position_embeddings"]
        lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
        wl = 2 * math.pi / base
        smooth = (l0 / wl - lo) / (hi - lo)
        blended = (1 - smooth) * base / factor + smooth * base
        out = np.where(wl < l0 / hi, base, np.where(wl > l0 / lo, base / factor, blended))
        return out, 1.0
    if kind == "yarn":
        l0 = rs.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = rs.get("attention_factor")
        if att is None:
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                att = mscale(factor, rs["mscale"]) / mscale(factor, rs["mscale_all_dim"])
            else:
                att = mscale(factor)

        def pair_of(rotations):
            # the pair whose wavelength turns `rotations` times over L0: solve
            # L0 / (2 pi theta^(2j/d)) = rotations for j
            return d * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_of(beta_fast), pair_of(beta_slow)
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
        return base / factor * (1 - keep) + base * keep, float(att)
    if kind in ("longrope", "su"):
        # LongRoPE: inv_freq[j] = 1 / (ext[j] * theta^(2j/d)), ext = short_factor up to the
        # original length, long_factor past it; attention factor sqrt(1 + ln s / ln L0) where
        # s = max_position_embeddings / L0 (Phi-3 keeps L0 at the config's top level)
        l0 = cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings")
        if cfg.get("original_max_position_embeddings"):
            scale = cfg["max_position_embeddings"] / l0
        else:
            l0 = l0 or cfg["max_position_embeddings"]
            scale = rs.get("factor") or 1.0
        att = rs.get("attention_factor")
        if att is None:
            att = math.sqrt(1 + math.log(scale) / math.log(l0)) if scale > 1 else 1.0
        ext = np.array(rs["long_factor"] if pos + 1 > l0 else rs["short_factor"], dtype=np.float64)
        return 1.0 / (ext * theta ** (np.arange(0, d, 2, dtype=np.float64) / d)), float(att)
    raise SystemExit("rope_ref.py: unknown rope type %r" % kind)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] != "F32":
            raise SystemExit("rope_ref.py: %s is %s; write the model with --dtype f32" % (name, t["dtype"]))
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").astype(np.float64).reshape(t["shape"])
    return out


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate(x, cos, sin):
    # HF's rotate_half: pairs (x[j], x[j + d/2])
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def sliding_window(cfg):
    """HF's window of the model, or None: Mistral and Phi-3 take sliding_window as it is, Qwen2
    only with use_sliding_window (and, here, every layer windowed), Llama has none."""
    kind = cfg.get("model_type")
    if kind in ("mistral", "phi3") or (kind == "qwen2" and cfg.get("use_sliding_window")):
        return cfg.get("sliding_window")
    return None


def split_fused(w, cfg):
    """Phi-3's qkv_proj rows are q, k, v; gate_up_proj's gate, up (HF's Phi3 chunks them so)."""
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d = head_dim(cfg)
    for name in list(w):
        if name.endswith("self_attn.qkv_proj.weight"):
            a = w.pop(name)
            p = name[: -len("qkv_proj.weight")]
            w[p + "q_proj.weight"] = a[: nh * d]
            w[p + "k_proj.weight"] = a[nh * d : (nh + nkv) * d]
            w[p + "v_proj.weight"] = a[(nh + nkv) * d :]
        elif name.endswith("mlp.gate_up_proj.weight"):
            a = w.pop(name)
            p = name[: -len("gate_up_proj.weight")]
            f = a.shape[0] // 2
            w[p + "gate_proj.weight"], w[p + "up_proj.weight"] = a[:f], a[f:]
    return w


def forward(model_dir, tokens):
    cfg = json.load(open(model_dir + "/config.json"))
    w = split_fused(load_safetensors(model_dir + "/model.safetensors"), cfg)
    T, nh = len(tokens), cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    d = head_dim(cfg)
    eps = cfg.get("rms_norm_eps", 1e-6)
    cos = np.empty((T, d // 2))
    sin = np.empty((T, d // 2))
    for p in range(T):
        inv, att = inv_freq_at(cfg, p)
        # HF's numerics for the angle: inv_freq in float32, position * inv_freq in float32
        ang = np.float32(p) * inv.astype(np.float32)
        cos[p] = np.cos(ang.astype(np.float64)) * att
        sin[p] = np.sin(ang.astype(np.float64)) * att
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    win = sliding_window(cfg)
    if win:  # query q sees keys k with q - win < k <= q
        mask = mask + np.tril(np.full((T, T), -np.inf), -win)
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l

        def lin(h, name):
            y = h @ w[p + name + ".weight"].T
            return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = rotate(lin(h, "self_attn.q_proj").reshape(T, nh, d), cos, sin)
        k = rotate(lin(h, "self_attn.k_proj").reshape(T, nkv, d), cos, sin)
        v = lin(h, "self_attn.v_proj").reshape(T, nkv, d)
        out = np.empty((T, nh, d))
        for hh in range(nh):
            kv = hh // (nh // nkv)  # grouped-query attention
            s = q[:, hh] @ k[:, kv].T / math.sqrt(d) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + lin(out.reshape(T, nh * d), "self_attn.o_proj")
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = lin(h, "mlp.gate_proj")
        x = x + lin(g / (1 + np.exp(-g)) * lin(h, "mlp.up_proj"), "mlp.down_proj")
    x = rmsnorm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])  # tied: the embedding
    return x @ head.T


def main(argv):
    if len(argv) >= 3 and argv[1] == "freqs":
        cfg = json.load(open(argv[2]))
        rows, att = [], 1.0
        for p in argv[3:]:
            inv, att = inv_freq_at(cfg, int(p))
            rows.append([float(v) for v in inv])
        json.dump({"attention_factor": att, "inv_freq": rows}, sys.stdout)
    elif len(argv) >= 4 and argv[1] == "forward":
        logits = forward(argv[2], [int(t) for t in argv[3:]])
        json.dump({"logits": logits.tolist()}, sys.stdout)
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
