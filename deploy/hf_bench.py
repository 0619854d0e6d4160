#!/usr/bin/env python3
"""hf_bench.py - HuggingFace transformers on the model directory rekv benchmarks (issue 15's
comparison), so that anyone with a GPU and transformers reruns it:

    deploy/hf_bench.py MODEL_DIR --batch B --prompt-len S --gen-len N [--dtype f16]
                       [--caches dynamic,offloaded]

It decodes greedily the prompts `rekv bench decode` makes for the same model, batch and prompt
length (its generator: x = 777; for each prompt, for each position: x = x * 6364136223846793005 +
1442695040888963407 mod 2^64, id = (x >> 33) mod vocab), once per cache: "dynamic" (transformers'
default cache, on the GPU) and "offloaded" (its offloaded cache: the KV of all but the current
layers in host memory). Each run is timed as rekv times it: a generate of one new token (the
prefill and the first token), then a generate of N; the decode time is their difference, N - 1
steps, and decode_tokens_per_s = B * (N - 1) / that. It prints one JSON object per cache, one per
line, with tokens_crc32c: the CRC32C of the generated ids laid out as rekv's bench lays out its
own ([step][sequence] int32, little-endian), so an equal value means the same greedy tokens, and
prompts_crc32c, which must equal the bench's (the same prompts).
"""
import argparse
import json
import struct
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def rekv_prompts(batch, length, vocab):
    x, out = 777, []
    for _ in range(batch):
        row = []
        for _ in range(length):
            x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            row.append((x >> 33) % vocab)
        out.append(row)
    return out


def crc32c(data):
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def generate(model, ids, new_tokens, cache):
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    if cache != "dynamic":
        kwargs["cache_implementation"] = cache
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    return out[:, ids.shape[1]:], time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--gen-len", type=int, required=True)
    ap.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="f16")
    ap.add_argument("--caches", default="dynamic,offloaded")
    a = ap.parse_args()
    if a.gen_len < 2:
        sys.exit("hf_bench.py: --gen-len must be at least 2 (the decode steps are gen-len - 1)")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[a.dtype]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to("cuda").eval()
    vocab = model.config.vocab_size
    prompts = rekv_prompts(a.batch, a.prompt_len, vocab)
    flat = [t for p in prompts for t in p]
    prompts_crc = crc32c(struct.pack("<%di" % len(flat), *flat))
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        generate(model, ids[:, :8], 2, "dynamic")  # warm-up: kernels, allocator
        for cache in a.caches.split(","):
            first, t1 = generate(model, ids, 1, cache)
            toks, tn = generate(model, ids, a.gen_len, cache)
            decode_s = tn - t1
            laid = toks.t().contiguous().to(torch.int32).cpu().flatten().tolist()
            print(json.dumps({
                "system": "transformers",
                "cache": cache,
                "batch": a.batch,
                "prompt_len": a.prompt_len,
                "gen_len": a.gen_len,
                "prefill_s": t1,
                "decode_s": decode_s,
                "decode_tokens_per_s": a.batch * (a.gen_len - 1) / decode_s,
                "first_token_same": bool((first[:, 0] == toks[:, 0]).all()),
                "tokens_crc32c": crc32c(struct.pack("<%di" % len(laid), *laid)),
                "prompts_crc32c": prompts_crc,
                "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            }), flush=True)
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
