#!/usr/bin/python3
"""kv_events_decode.py — an independent decoder of rekv-kvstore's KV events (--kv-events) for
tests/test_kv_events.c: reads the ZeroMQ messages the test received, decodes each with
python3-msgpack (not rekv's encoder, msgpack-c) and checks it against vLLM's wire format as
v0.26 publishes it (vllm/distributed/kv_events.py: KVEventBatch [ts, events, data_parallel_rank]
positional; each event a map tagged by "type", fields in vLLM's order, or with --array the
positional events of vLLM before PR #42892). Prints one JSON object a message:
{"topic", "seq", "ts", "rank", "events": [{"type", "block_hashes", "parent_block_hash",
"token_ids", "block_size", "medium", ...}]}, block hashes as decimal strings (they are uint64:
JSON readers take at most int64). Exits 1 with the reason on the first message that is not
vLLM's format.

Input (argv[1]): records of three frames, each a 4-byte little-endian length and the bytes."""
import json
import struct
import sys

import msgpack

STORED = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name"]
REMOVED = ["block_hashes", "medium"]
FIELDS = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": []}
U64 = (0, 2**64 - 1)


def fail(msg):
    sys.stderr.write("kv_events_decode: %s\n" % msg)
    sys.exit(1)


def frames(data):
    i, out = 0, []
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    if len(out) % 3:
        fail("%d frames: not messages of three" % len(out))
    return [out[k:k + 3] for k in range(0, len(out), 3)]


def check_hash(h, what):
    if not isinstance(h, int) or not U64[0] <= h <= U64[1]:
        fail("%s %r is not a uint64" % (what, h))
    return str(h)


def event(raw, positional):
    if positional:
        if not isinstance(raw, list) or not raw or raw[0] not in FIELDS:
            fail("event %r is not a tagged array" % (raw,))
        tag, names = raw[0], FIELDS[raw[0]]
        if len(raw) != len(names) + 1:
            fail("%s has %d fields, vLLM's has %d" % (tag, len(raw) - 1, len(names)))
        ev = dict(zip(names, raw[1:]))
    else:
        if not isinstance(raw, dict) or raw.get("type") not in FIELDS:
            fail("event %r is not a map tagged by type" % (raw,))
        tag, names = raw["type"], FIELDS[raw["type"]]
        keys = list(raw.keys())
        if keys != ["type"] + names:  # msgspec writes fields in declaration order
            fail("%s keys %r, vLLM's are %r" % (tag, keys, ["type"] + names))
        ev = {k: raw[k] for k in names}
    out = {"type": tag}
    if tag == "AllBlocksCleared":
        return out
    hashes = ev["block_hashes"]
    if not isinstance(hashes, list) or not hashes:
        fail("%s block_hashes %r" % (tag, hashes))
    out["block_hashes"] = [check_hash(h, "block hash") for h in hashes]
    if ev["medium"] != "CPU":
        fail("%s medium %r" % (tag, ev["medium"]))
    out["medium"] = ev["medium"]
    if tag == "BlockRemoved":
        return out
    parent = ev["parent_block_hash"]
    out["parent_block_hash"] = None if parent is None else check_hash(parent, "parent")
    toks, bs = ev["token_ids"], ev["block_size"]
    if bs != 16 or not isinstance(toks, list) or len(toks) != 16 * len(hashes):
        fail("BlockStored of %d blocks: block_size %r, %d token ids" % (len(hashes), bs,
                                                                       len(toks)))
    if not all(isinstance(t, int) and 0 <= t < 2**32 for t in toks):
        fail("token ids %r" % (toks,))
    if ev["lora_id"] is not None or ev["lora_name"] is not None:
        fail("lora %r %r" % (ev["lora_id"], ev["lora_name"]))
    out["token_ids"] = toks
    out["block_size"] = bs
    return out


def main():
    positional = "--array" in sys.argv[2:]
    with open(sys.argv[1], "rb") as f:
        msgs = frames(f.read())
    for topic, seq, payload in msgs:
        if len(seq) != 8:
            fail("sequence frame of %d bytes" % len(seq))
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(batch, list) or len(batch) != 3:
            fail("batch %r is not [ts, events, data_parallel_rank]" % (batch,))
        ts, events, rank = batch
        if not isinstance(ts, float) or not isinstance(events, list) or rank != 0:
            fail("batch head ts %r, rank %r" % (ts, rank))
        print(json.dumps({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": ts,
                          "rank": rank, "events": [event(e, positional) for e in events]}))


main()
