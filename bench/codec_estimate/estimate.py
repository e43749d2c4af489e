"""estimate.py — what a transform or an entropy coder could buy over q4, from dump.c's K/V.

    python estimate.py DIR HEAD_DIM

Per (layer, K/V) section, the first half of the tokens calibrates and the second half is coded:
  q4     kvtier's KIVI q4 (K per channel over 64 cells, V per token over 64 channels, min/max):
         its MSE is the reference, its bytes 5 bits an element (0.3125x F16);
  ident  the per-head mean removed, one uniform step for the section, and an ideal entropy coder
         with one symbol model per channel (the empirical entropy of each channel's codes);
  pca    the same after a per-KV-head PCA basis from the calibration half (KVTC's transform).
The step is searched so that the section's MSE is 0.5, 1, 2 or 4 x q4's; the bits are the
entropy per element (side information not counted: the basis is per model, the step per
section).  MSE, not KL: the model is not run.  Prints the bits per element and the ratio to F16.
"""
import numpy as np, glob, sys, os
d, hd = sys.argv[1], int(sys.argv[2])
def ent_bits(q):  # empirical entropy (bits) of each column's symbols, summed, per row
    tot = 0.0
    for j in range(q.shape[1]):
        _, c = np.unique(q[:, j], return_counts=True)
        p = c / c.sum()
        tot += -(p * np.log2(p)).sum()
    return tot  # bits per row (token)
def q4(x, kind):
    y = np.empty_like(x)
    T, E = x.shape
    if kind == 'K':  # per channel, groups of 64 cells
        for c0 in range(0, T, 64):
            g = x[c0:c0+64]; lo = g.min(0); hi = g.max(0); st = (hi - lo) / 15; st[st == 0] = 1
            y[c0:c0+64] = lo + np.floor((g - lo) / st + 0.5) * st
    else:  # per token, groups of 64 channels
        for e0 in range(0, E, 64):
            g = x[:, e0:e0+64]; lo = g.min(1, keepdims=True); hi = g.max(1, keepdims=True); st = (hi - lo) / 15; st[st == 0] = 1
            y[:, e0:e0+64] = lo + np.floor((g - lo) / st + 0.5) * st
    return y
def code(x, basis, mu, delta):  # transform, uniform step, entropy; returns (bits per element, mse)
    y = (x - mu) @ basis
    q = np.round(y / delta)
    rec = (q * delta) @ basis.T + mu
    return ent_bits(q) / x.shape[1], float(((rec - x) ** 2).mean())
res = {}
for f in sorted(glob.glob(d + '/*.f32')):
    kind, part, layer = os.path.basename(f)[:-4].split('_')
    x = np.fromfile(f, dtype=np.float32).astype(np.float64)
    E = int(sys.argv[3]) if len(sys.argv) > 3 else hd
    x = x.reshape(-1, E)
    T = x.shape[0]; cal, ev = x[:T//2], x[T//2:]
    mse_q4 = float(((q4(ev, kind) - ev) ** 2).mean())
    for name in ('pca', 'ident'):
        # per head basis from the calibration half
        B = np.zeros((E, E)); mu = np.zeros(E)
        for h in range(E // hd):
            s = slice(h*hd, (h+1)*hd)
            m = cal[:, s].mean(0); mu[s] = m
            if name == 'pca':
                w, U = np.linalg.eigh(np.cov((cal[:, s] - m).T))
                B[s, s] = U[:, ::-1]
            else:
                B[s, s] = np.eye(hd)
        for target in (0.5, 1, 2, 4):
            lo, hi = 1e-6, 1e3
            for _ in range(40):
                mid = np.sqrt(lo * hi)
                b, m = code(ev, B, mu, mid)
                if m > target * mse_q4: hi = mid
                else: lo = mid
            b, m = code(ev, B, mu, lo)
            res.setdefault((name, target), []).append((b, kind, T // 2))
    print(f"{os.path.basename(f)} mse_q4 {mse_q4:.3e}", file=sys.stderr)
for (name, target), v in sorted(res.items()):
    for kind in ('K', 'V', 'KV'):
        bs = [b for b, k, n in v if kind == 'KV' or k == kind]
        print(f"{name:6s} MSE {target:>3} x q4's  {kind:2s}: {np.mean(bs):5.2f} bits/elem = {np.mean(bs)/16:.3f}x F16 (q4: 0.3125x)")
