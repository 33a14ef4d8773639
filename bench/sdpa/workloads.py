"""Workloads of the GPU benchmark: one step of attention (sequences of keys and query
tokens), its inputs for our column store, and the case lists (the table, --quick, the
sweep and profile cases)."""

import torch

from .timing import DEV, DT, MAX_KV_OURS


class Work:
    """seqs: list of (n_keys, n_q, start_row); query tokens at the last n_q
    positions of each sequence (prefill chunk / draft block / decode)."""

    def __init__(self, name, hq, hkv, d, seqs, causal, rows=None, window=0):
        self.name, self.hq, self.hkv, self.d = name, hq, hkv, d
        self.seqs, self.causal, self.window = seqs, causal, window
        self.B = len(seqs)
        self.rows = rows or max(n for n, _, _ in seqs)
        self.T = sum(nq for _, nq, _ in seqs)
        vis = 0
        for n, nq, _ in seqs:
            for j in range(nq):
                qp = n - nq + j
                vis += (qp + 1) if causal else n
        self.pairs = vis  # (query, key) pairs per head
        self.kv_read = sum(n for n, _, _ in seqs) * hkv * d * 2 * 2
        self.store_bytes = self.rows * self.B * hkv * d * 2 * 2
        self.bytes = self.kv_read + 2 * self.T * hq * d * 2
        self.flops = 4 * d * hq * self.pairs

    def ours_inputs(self, n_copies):
        cols = self.B
        seg, q_cols, q_pos = [], [], []
        for c, (n, nq, r0) in enumerate(self.seqs):
            first = min(n, self.rows - r0)
            seg.append([c, r0, first, 0])
            seg.append([c, 0, n - first, first] if n - first > 0 else [c, 0, 0, 0])
            q_cols += [c] * nq
            q_pos += list(range(n - nq, n))
        seq_info = torch.tensor(seg, dtype=torch.int64, device=DEV)
        q = torch.randn(self.T, self.hq, self.d, device=DEV, dtype=DT)
        kvs = []
        for _ in range(n_copies):
            k = torch.randn(self.rows * cols, self.hkv, self.d, device=DEV, dtype=DT)
            v = torch.randn(self.rows * cols, self.hkv, self.d, device=DEV, dtype=DT)
            kvs.append((k, v))
        return q, kvs, torch.tensor(q_pos, device=DEV), torch.tensor(q_cols, device=DEV), seq_info, cols




HEADS = [(32, 8, 128), (64, 8, 128), (16, 2, 256), (32, 32, 128)]


def lognormal_lengths(B, L, rows_cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(B, generator=g))
    lens = (x / x.sum() * B * L).clamp(16, rows_cap).round().long()
    # restore the total after clipping (as close as the cap allows)
    for _ in range(4):
        diff = B * L - int(lens.sum())
        if diff == 0:
            break
        room = (rows_cap - lens) if diff > 0 else (lens - 16)
        share = (room.float() / max(1, int(room.sum())) * diff).round().long()
        lens = (lens + share).clamp(16, rows_cap)
    return lens.tolist()


def build_cases(quick):
    """In priority order (the bench stops adding cases when its time budget is spent)."""
    cases = []
    batches = [1, 4, 16, 64, 256]
    ctxs = [512, 2048, 8192, 32768, 131072]
    hq, hkv, d = HEADS[0]
    per_tok = hkv * d * 4

    def fits(b, c):
        return b * c * per_tok <= MAX_KV_OURS

    def uni(b, c, h=HEADS[0]):
        return ("decode", Work(f"decode uniform B={b} L={c}", h[0], h[1], h[2], [(c, 1, 0)] * b, True))

    def skew(b, c):
        lens = lognormal_lengths(b, c, 4 * c)
        return ("skew", Work(f"decode skewed B={b} L~{c}", hq, hkv, d, [(n, 1, 0) for n in lens], True,
                             rows=max(lens)))

    def wrap(b, c, align=1):
        g = torch.Generator().manual_seed(b + c)
        starts = [max(align, s // align * align) for s in torch.randint(1, c, (b,), generator=g).tolist()]
        name = f"decode wrapped B={b} L={c}" + (f" start rows multiples of {align}" if align > 1 else "")
        return ("wrap", Work(name, hq, hkv, d, [(c, 1, s) for s in starts], True))

    def draft(b, n=8192):  # n = 8197: the block's positions 8181..8196 not aligned to 16
        return ("draft", Work(f"draft 16 non-causal B={b} L={n}", hq, hkv, d, [(n, 16, 0)] * b, False))

    def prefill(chunk, hist):
        return ("prefill", Work(f"prefill chunk={chunk} hist={hist}", hq, hkv, d, [(hist + chunk, chunk, 0)], True))

    if quick:
        return [uni(1, 32768), uni(1, 8192), uni(4, 2048), uni(16, 8192), uni(64, 8192), uni(256, 2048), skew(16, 8192),
                skew(256, 2048), wrap(16, 8192), draft(4), draft(4, 8197), draft(8), prefill(2048, 8192), prefill(8192, 0)]
    cases += [uni(b, c) for b in batches for c in ctxs if fits(b, c)]
    cases += [skew(b, c) for b in (4, 16, 64, 256) for c in (2048, 8192, 32768) if b * 4 * c * per_tok <= MAX_KV_OURS]
    cases += [wrap(b, c) for b in batches for c in (8192, 32768) if fits(b, c)] + [wrap(1, 131072), wrap(4, 131072)]
    cases += [draft(b) for b in (1, 4, 8, 32)] + [draft(4, 8197)]
    cases += [prefill(c, h) for c in (512, 2048, 8192) for h in (0, 8192)]
    cases.append(("mixed", Work("mixed 128 decodes@2k + 2k chunk", hq, hkv, d,
                                [(2048, 1, 0)] * 128 + [(2048, 2048, 0)], True)))
    for h in HEADS[1:]:
        for b, c in [(1, 32768), (4, 131072), (16, 8192), (64, 2048), (256, 2048)]:
            if b * c * h[1] * h[2] * 4 <= MAX_KV_OURS:
                cases.append(uni(b, c, h))
    # wrapped B=1 ran slower than uniform (32k: 48.5 against 45.4 µs; 131k: 149.7 against 133.3): the same starts
    # rounded to the decode tile (64 rows) tell whether tiles that straddle 64-row boundaries cost it
    cases += [wrap(1, 32768, 64), wrap(1, 131072, 64)]
    return cases


FLEX_CASES = {"32/8 D128 decode uniform B=16 L=8192", "32/8 D128 prefill chunk=2048 hist=0",
              "32/8 D128 prefill chunk=8192 hist=0"}




def sweep_cases():
    hq, hkv, d = HEADS[0]
    lens = lognormal_lengths(256, 2048, 4 * 2048)
    lens16 = lognormal_lengths(16, 8192, 4 * 8192)
    lens64 = lognormal_lengths(64, 2048, 4 * 2048)
    dec = [Work("decode B=1 L=32k", hq, hkv, d, [(32768, 1, 0)], True),
           Work("decode B=1 L=128k", hq, hkv, d, [(131072, 1, 0)], True),
           Work("decode B=16 L=8k", hq, hkv, d, [(8192, 1, 0)] * 16, True),
           Work("decode B=256 L=2k", hq, hkv, d, [(2048, 1, 0)] * 256, True),
           Work("skewed B=256 L~2k", hq, hkv, d, [(n, 1, 0) for n in lens], True, rows=max(lens)),
           Work("skewed B=16 L~8k", hq, hkv, d, [(n, 1, 0) for n in lens16], True, rows=max(lens16)),
           Work("skewed B=64 L~2k", hq, hkv, d, [(n, 1, 0) for n in lens64], True, rows=max(lens64)),
           Work("decode B=4 L=32k", hq, hkv, d, [(32768, 1, 0)] * 4, True)]
    pre = [Work("draft16 B=4 L=8k", hq, hkv, d, [(8192, 16, 0)] * 4, False),
           Work("draft16 B=8 L=8k", hq, hkv, d, [(8192, 16, 0)] * 8, False),
           Work("draft16 B=4 L=8k+5", hq, hkv, d, [(8197, 16, 0)] * 4, False),
           Work("prefill 2k hist 8k", hq, hkv, d, [(10240, 2048, 0)], True),
           Work("prefill 8k hist 0", hq, hkv, d, [(8192, 8192, 0)], True)]
    return dec, pre


def small_cases():
    """Single and few sequences, where a split block's merge weighs most (G = 4 and G = 8)."""
    return [Work("decode 32/8 B=1 L=32k", 32, 8, 128, [(32768, 1, 0)], True),
            Work("decode 64/8 B=1 L=32k", 64, 8, 128, [(32768, 1, 0)], True),
            Work("decode 32/8 B=16 L=8k", 32, 8, 128, [(8192, 1, 0)] * 16, True),
            Work("draft16 32/8 B=4 L=8k", 32, 8, 128, [(8192, 16, 0)] * 4, False)]


def wave_cases():
    """Small decodes (where the splits' count and length decide) and a skewed one, for the one-wave group:
    the decode sweep's B=1 L=32k, B=16 L=8k and skewed B=16 cases and two smaller ones."""
    hq, hkv, d = HEADS[0]
    dec, _ = sweep_cases()
    return [dec[0], Work("decode B=1 L=8k", hq, hkv, d, [(8192, 1, 0)], True),
            Work("decode B=4 L=2k", hq, hkv, d, [(2048, 1, 0)] * 4, True), dec[2], dec[5]]


def guard_cases():
    """One case per path of the attention launches (a small decode, a draft block, a prefill chunk):
    a sweep group times those of the other paths too, and a variant that slows one is not adopted."""
    _, pre = sweep_cases()
    return [wave_cases()[1], pre[0], pre[3]]
