"""serve_long_test.py — one request whose single user message is longer than the budget (issue #23):
a pasted document with one planted sentence and, after a blank line, a question about it.  What
a user sends first, and what the turn-based evaluation never exercised.  Started by
tests/server/cli_serve_long.sh against two servers on the same model: kvtier at --budget 512,
and a reference that never evicts.

For each of DOCS documents (essay text, ~4x the budget, the sentence at 25/50/75 %):
  - kvtier served the whole prompt within its budget (evictions, resident <= 512), the reference
    evicted nothing;
  - kvtier's reply answers the question (it names the question's subject) in every document where
    the reference's does.  At e52d987 the blocks recovered for the question were loaded between
    the end of the user's turn and the reply, and the replies went on with the document
    ("[1] The original text is from the 1990s...").  The reference runs here, on this CPU:
    greedy text is never judged on its own.
Whether the number itself comes back is printed, not asserted: three documents are too few to
compare recall rates (kvtier eval niah --single-prompt does, on >= 10 cases per cell, and
tests/cli/cli_eval_single.sh on the answer's log-probability).
Prints "ok   NAME" / "FAIL NAME: why"; exit status = failures.

  python serve_long_test.py KVTIER_URL REFERENCE_URL ESSAY_DIR
"""
import glob
import os
import sys

from serve_client import check, finish, init

import openai

BASE, REF, ESSAYS = sys.argv[1:4]
init(BASE, None)
A = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=600)
R = openai.OpenAI(base_url=REF + "/v1", api_key="none", max_retries=0, timeout=600)
BUDGET = 512
DOCS = [("Tavoren", "48213", 25, "aord.txt"), ("Mirelle", "70591", 50, "apple.txt"), ("Quendor", "36127", 75, "avg.txt")]


def document(name, number, depth, essay):
    words = " ".join(open(os.path.join(ESSAYS, essay), encoding="utf-8").read().split()).split(" ")[:1500]
    cut = len(words) * depth // 100
    while cut < len(words) and not words[cut - 1].endswith("."):  # at a sentence end
        cut += 1
    needle = f"The secret code of {name} is {number}."
    return ("Read the following document. A question about it comes at the end.\n\n" + " ".join(words[:cut]) +
            " " + needle + " " + " ".join(words[cut:]) +
            f"\n\nWhat is the secret code of {name}? Answer with the number.")


def ask(client, msg, sid):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": msg}], max_tokens=24,
                                       temperature=0, extra_headers={"X-Session-Id": sid})
    return r, r.model_dump()["usage"]["kvtier"]


check("the essays are there", all(os.path.isfile(os.path.join(ESSAYS, d[3])) for d in DOCS), ESSAYS)
hits_k = hits_r = 0
for i, (name, number, depth, essay) in enumerate(DOCS):
    msg = document(name, number, depth, essay)
    rk, kk = ask(A, msg, f"long-{i}")
    rr, kr = ask(R, msg, f"long-ref-{i}")
    ak, ar = rk.choices[0].message.content, rr.choices[0].message.content
    hits_k += number in ak
    hits_r += number in ar
    print(f"     doc {i + 1} (needle at {depth} %, {rk.usage.prompt_tokens} prompt tokens): kvtier {ak!r} "
          f"(evictions {kk['evictions']}, recoveries {kk['recoveries']}, resident {kk['resident_tokens']}); "
          f"reference {ar!r}")
    check(f"doc {i + 1}: one {rk.usage.prompt_tokens}-token message (> 3x the budget) served within the budget",
          rk.usage.prompt_tokens > 3 * BUDGET and kk["evictions"] > 0 and 0 < kk["resident_tokens"] <= BUDGET, str(kk))
    check(f"doc {i + 1}: the reference held it all", kr["evictions"] == 0, str(kr))
    if name in ar:
        check(f"doc {i + 1}: kvtier answers the question (names {name}), as the reference does", name in ak, repr(ak))
    else:
        print(f"     doc {i + 1}: the reference's reply does not name {name}: not judged")
print(f"     recalled the number: kvtier {hits_k}/{len(DOCS)}, reference (no eviction) {hits_r}/{len(DOCS)}")
finish()
