#!/usr/bin/python3
"""prefix_shareable.py FILE — the independent count of `rekv bench serve --workload-out FILE`:
for each run, the prompt tokens the prefix cache can serve, counted from the token lists alone,
beside the tokens the server said it took (cached_tokens). A request can take the longest run of
whole 16-token blocks of its prompt (all but its last token at most) that a request of an earlier
wave wrote: the chains of that request's prompt + answer, but the answer's last token (no step
computes its K,V). Prints one JSON object {run: {prompt_tokens, cached_tokens, shareable_tokens}}."""
import json
import sys

B = 16


def main(path):
    runs = {}
    for line in open(path):
        r = json.loads(line)
        runs.setdefault(r["run"], []).append(r)
    out = {}
    for name, reqs in runs.items():
        waves = sorted({r["wave"] for r in reqs})
        written = set()  # every whole-block chain (the tokens up to the block's end) written so far
        share = 0
        for w in waves:
            wave = [r for r in reqs if r["wave"] == w]
            for r in wave:
                p, k = r["prompt"], 0
                while k < (len(p) - 1) // B and tuple(p[: (k + 1) * B]) in written:
                    k += 1
                share += k * B
            for r in wave:  # what this wave wrote counts for the next waves only
                if r["output"]:
                    seq = r["prompt"] + r["output"]
                    for k in range(1, (len(seq) - 1) // B + 1):
                        written.add(tuple(seq[: k * B]))
        out[name] = {"prompt_tokens": sum(len(r["prompt"]) for r in reqs),
                     "cached_tokens": sum(r["cached_tokens"] for r in reqs),
                     "shareable_tokens": share}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
