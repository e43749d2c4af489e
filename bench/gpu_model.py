#!/usr/bin/env python3
"""gpu_model.py — a random-weight llama-architecture GGUF of a chosen size, for timing on a device.

The figures a GPU is measured for (load against re-prefill, a server's tok/s and VRAM) depend on the
model's shapes, not on its weights. A 1B-parameter model is ~2 GB of F16, more than a device run can
carry, so the device writes one from random weights in seconds. Its tokenizer and chat template are
copied from a real model (the vocabulary is a JSON dump of a few MB), so text tokenizes as with that
model and a chat server formats turns as usual. Answers are noise: use it for speed and memory only,
never for quality.

  gpu_model.py vocab DONOR.gguf OUT.json.gz    dump DONOR's tokenizer.* fields (needs the gguf package)
  gpu_model.py model VOCAB.json.gz OUT.gguf [--embd 2048 --layers 16 --heads 32 --heads-kv 8
                                            --ff 8192 --ctx 8192 --seed 1]
                                            write the model (F16 matrices, F32 norms; tied output)

Needs numpy and llama.cpp's gguf-py (PYTHONPATH=<llama.cpp>/gguf-py). Defaults are Llama 3.2 1B's
shapes (n_embd 2048, 16 layers, 32 query heads, 8 KV heads, FFN 8192): ~1.07B parameters with
SmolLM2's vocabulary of 49,152 tokens.
"""
import argparse
import gzip
import json
import sys
import time

import numpy as np
import gguf


def dump_vocab(donor, out):
    r = gguf.GGUFReader(donor)
    d = {}
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = f.types[1] if len(f.types) > 1 else None
            if sub == gguf.GGUFValueType.STRING:
                d[name] = {"type": "strs", "v": [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]}
            else:
                d[name] = {"type": "ints", "v": [int(f.parts[i][0]) for i in f.data]}
        elif t == gguf.GGUFValueType.STRING:
            d[name] = {"type": "str", "v": bytes(f.parts[f.data[0]]).decode("utf-8")}
        elif t == gguf.GGUFValueType.BOOL:
            d[name] = {"type": "bool", "v": bool(f.parts[f.data[0]][0])}
        else:
            d[name] = {"type": "u32", "v": int(f.parts[f.data[0]][0])}
    with gzip.open(out, "wt", encoding="utf-8") as fp:
        json.dump(d, fp, ensure_ascii=True)
    print(f"{out}: {len(d)} tokenizer fields, {len(d.get('tokenizer.ggml.tokens', {}).get('v', []))} tokens")


def write_model(vocab, out, a):
    with gzip.open(vocab, "rt", encoding="utf-8") as fp:
        d = json.load(fp)
    n_vocab = len(d["tokenizer.ggml.tokens"]["v"])
    head_dim = a.embd // a.heads
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random llama {a.embd}x{a.layers} (kvtier bench/gpu_model.py, seed {a.seed})")
    w.add_context_length(a.ctx)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, f in d.items():
        t, v = f["type"], f["v"]
        if t == "strs":
            w.add_array(name, [s.encode("utf-8", "surrogateescape") for s in v])
        elif t == "ints":
            w.add_array(name, v)
        elif t == "str":
            w.add_string(name, v)
        elif t == "bool":
            w.add_bool(name, v)
        else:
            w.add_uint32(name, v)
    rng = np.random.default_rng(a.seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    off = [0]

    def mat(rows, cols):  # a window of the random pool, rotated per tensor: random enough for timing
        n = rows * cols
        reps = -(-(n + off[0]) // pool.size)
        m = np.tile(pool, reps)[off[0]:off[0] + n].reshape(rows, cols)
        off[0] = (off[0] + 7919) % pool.size
        return m

    ones = np.ones(a.embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(n_vocab, a.embd))
    w.add_tensor("output_norm.weight", ones)
    kv = a.heads_kv * head_dim
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", mat(a.embd, a.embd))
        w.add_tensor(p + "attn_k.weight", mat(kv, a.embd))
        w.add_tensor(p + "attn_v.weight", mat(kv, a.embd))
        w.add_tensor(p + "attn_output.weight", mat(a.embd, a.embd))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", mat(a.ff, a.embd))
        w.add_tensor(p + "ffn_up.weight", mat(a.ff, a.embd))
        w.add_tensor(p + "ffn_down.weight", mat(a.embd, a.ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = n_vocab * a.embd + a.layers * (2 * a.embd * a.embd + 2 * kv * a.embd + 3 * a.ff * a.embd)
    print(f"{out}: llama, {n / 1e9:.2f}B parameters, n_embd {a.embd}, {a.layers} layers, "
          f"{a.heads}/{a.heads_kv} heads, FFN {a.ff}, vocab {n_vocab}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vocab")
    v.add_argument("donor")
    v.add_argument("out")
    m = sub.add_parser("model")
    m.add_argument("vocab")
    m.add_argument("out")
    m.add_argument("--embd", type=int, default=2048)
    m.add_argument("--layers", type=int, default=16)
    m.add_argument("--heads", type=int, default=32)
    m.add_argument("--heads-kv", type=int, default=8)
    m.add_argument("--ff", type=int, default=8192)
    m.add_argument("--ctx", type=int, default=8192)
    m.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t0 = time.time()
    if a.cmd == "vocab":
        dump_vocab(a.donor, a.out)
    else:
        write_model(a.vocab, a.out, a)
    print(f"({time.time() - t0:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
