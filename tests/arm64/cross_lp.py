#!/usr/bin/env python3
"""cross_lp.py: the requests and the log-probability arithmetic of tests/arm64/cross_store.sh.

  cross_lp.py ask PORT N OUT      N greedy requests (prompts 0..N-1, each a ~430-token document
                                  and a question) to the server on PORT; the replies, with
                                  per-token log-probabilities, as a JSON list into OUT
  cross_lp.py route FILE          one line per reply: STORE PROMPT_TOKENS_FROM_STORE PROMPT_TOKENS
  cross_lp.py diff A B            compares two reply files prompt by prompt over each pair's common
                                  leading tokens; one line per prompt
                                    i |d answer logprob| max|d token| n_common TEXT_A | TEXT_B
                                  then a line "all SUM_ABS_D MEAN_ABS_D MEAN_TOKEN_D N_TOKENS N_SAME":
                                  the sum and mean over prompts of |d answer logprob|, the mean
                                  |d logprob| per common token, the common tokens, and how many
                                  prompts got the same greedy reply
"""
import json
import sys
import urllib.request

VOCAB = ("the river mill lantern harbor orchard comet glacier violin stone garden window winter summer market "
         "bridge quiet old north road letter clock paper music forest light small village").split()
WORDS = ["amber-falcon", "copper-willow", "silent-meadow", "iron-harbor", "velvet-comet", "north-lantern",
         "glass-orchard", "winter-violin"]


def prompt(i):
    """Prompt i: a document of 300 pseudo-random words with a code word, and the question."""
    r, out = 4242 + 7919 * i, []
    for k in range(300):
        r = (r * 1103515245 + 12345) % 2**31
        out.append(VOCAB[(r >> 8) % len(VOCAB)] + ("." if k % 11 == 10 else ""))
    word = WORDS[i % len(WORDS)]
    doc = "Harbor log %d. The keeper's code word is %s. " % (i + 1, word) + " ".join(out)
    return [{"role": "system", "content": doc}, {"role": "user", "content": "What is the keeper's code word?"}]


def ask(port, n, out):
    replies = []
    for i in range(n):
        body = {"model": "m", "temperature": 0, "max_tokens": 12, "logprobs": True, "messages": prompt(i)}
        req = urllib.request.Request("http://127.0.0.1:%s/v1/chat/completions" % port, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        replies.append(json.load(urllib.request.urlopen(req, timeout=1800)))
    with open(out, "w") as f:
        json.dump(replies, f)


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def route(path):
    for d in load(path):
        k = d["usage"]["kvtier"]
        print(k["store"], k["prompt_tokens_from_store"], d["usage"]["prompt_tokens"])


def toks(d):
    c = d["choices"][0]
    return [(t["token"], t["logprob"]) for t in c["logprobs"]["content"]], c["message"]["content"].replace("\n", " ")


def diff(pa, pb):
    ra, rb = load(pa), load(pb)
    sum_d, tok_d, n_tok, n_same = 0.0, 0.0, 0, 0
    for i, (da, db) in enumerate(zip(ra, rb)):
        (a, ta), (b, tb) = toks(da), toks(db)
        n, m, sa, sb = 0, 0.0, 0.0, 0.0
        while n < min(len(a), len(b)) and a[n][0] == b[n][0]:
            m = max(m, abs(a[n][1] - b[n][1]))
            tok_d += abs(a[n][1] - b[n][1])
            sa += a[n][1]
            sb += b[n][1]
            n += 1
        sum_d += abs(sa - sb)
        n_tok += n
        n_same += ta == tb
        print("%d %.6f %.6f %d %s | %s" % (i, abs(sa - sb), m, n, ta, tb))
    k = min(len(ra), len(rb))
    print("all %.6f %.6f %.6f %d %d" % (sum_d, sum_d / k if k else float("nan"), tok_d / n_tok if n_tok else float("nan"),
                                        n_tok, n_same))


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "ask" and len(sys.argv) == 5:
        ask(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif cmd == "route" and len(sys.argv) == 3:
        route(sys.argv[2])
    elif cmd == "diff" and len(sys.argv) == 4:
        diff(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
