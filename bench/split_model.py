"""A model of a decode step's time from the plan's items, for choosing split rules without a GPU.

    python bench/split_model.py [--alpha 1.75] [--item-cap 1.5 1.25 1.0]

The plan runs here in Triton's interpreter (CPU) on the bench's decode cases (32/8 heads, D128);
its items go to ``SLOTS`` program slots (two per SM of an H200) in launch order, item fastest
then KV head.  Fluid model: the running programs share the machine's bandwidth, none faster than
``alpha`` times its share when every slot is busy (a lone program is latency-bound), plus a
fixed cost per call.  The per-key time and the fixed cost are the eighth round's uniform decode
rows (docs/benchmarks_gpu_sdpa.md: B=16 L=8k 133.3 µs, the B=1 fit 13.4 µs fixed); alpha 1.75
puts the skewed rows within ~5% of their measured times there.  A model, not a measurement:
it ranks rules for a sweep on the GPU (``bench/sdpa_varlen.py --sweep --sweep-group 'item cap'``).
That sweep measured ``item_cap=1.5``, now the default, at -10% on skewed B=16 L~8k where the model
said ~-20% (docs/benchmarks_gpu_sdpa.md, "Tuning history"); 0 is the uncapped plan.
"""

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

from bench.sdpa.workloads import lognormal_lengths  # noqa: E402
from pipeline.kernels import sdpa_varlen as K  # noqa: E402

SLOTS = 264
FIXED_US = 13.4
US_PER_KEY = (133.3 - FIXED_US) / 4096  # one slot's key (K and V of one KV head) when all slots run
MEASURED = {  # µs, eighth round (docs/benchmarks_gpu_sdpa.md)
    ("uniform", 16, 8192): 133.3, ("uniform", 64, 2048): 130.0, ("uniform", 4, 8192): 42.0,
    ("uniform", 1, 32768): 45.4, ("uniform", 256, 2048): 492.5,
    ("skewed", 16, 8192): 169.8, ("skewed", 16, 2048): 49.5, ("skewed", 64, 2048): 195.1, ("skewed", 4, 8192): 46.2,
    ("skewed", 64, 8192): 721.8, ("skewed", 256, 2048): 565.2, ("skewed", 16, 32768): 648.1,
    ("skewed", 4, 32768): 137.9,
}


def item_keys(lengths: list[int], tuning: K.Tuning, hq: int = 32, hkv: int = 8, d: int = 128) -> list[int]:
    """Keys of each item of the plan of a decode step over sequences of these lengths."""
    b, rows = len(lengths), max(lengths)
    seq_info = torch.tensor([s for c, n in enumerate(lengths) for s in ([c, 0, n, 0], [c, 0, 0, 0])])
    q = torch.empty(b, hq, d, dtype=torch.bfloat16)
    kv = torch.empty(1, hkv, d, dtype=torch.bfloat16).expand(rows * b, hkv, d)  # the plan reads no K/V
    geo = K.geometry_of(q, kv, kv, b, tuning)
    plan = K.plan_impl(torch.tensor([n - 1 for n in lengths]), torch.arange(b), seq_info, b, True, 0, geo)
    recs = plan[geo.rec_off: geo.rec_off + int(plan[int(K.H_ITEMS)]) * K.NBF].view(-1, K.NBF)
    return (recs[:, int(K.F_KEND)] - recs[:, int(K.F_KSTART)]).tolist()


def step_us(items: list[int], alpha: float, hkv: int = 8) -> float:
    """The fluid model's time of one launch of these items on every KV head."""
    rate_all = SLOTS / US_PER_KEY  # keys per µs over the machine
    queue = [n for _ in range(hkv) for n in items][::-1]
    running, t = [], 0.0
    while queue or running:
        while queue and len(running) < SLOTS:
            running.append(float(queue.pop()))
        rate = min(alpha * rate_all / SLOTS, rate_all / len(running))
        dt = min(running) / rate
        t += dt
        running = [n - rate * dt for n in running if n - rate * dt > 1e-6]
    return FIXED_US + t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alpha", type=float, default=1.75)
    ap.add_argument("--item-cap", type=float, nargs="+", default=[1.5, 1.25, 1.0])
    args = ap.parse_args()
    caps = [0.0] + args.item_cap
    print("| case | measured µs | " + " | ".join(f"model, item_cap={c}" for c in caps) + " |")
    print("|---|---:|" + "---:|" * len(caps))
    for (kind, b, n), us in MEASURED.items():
        lengths = [n] * b if kind == "uniform" else lognormal_lengths(b, n, 4 * n)
        cells = []
        for cap in caps:
            items = item_keys(lengths, K.Tuning(item_cap=cap))
            cells.append(f"{step_us(items, args.alpha):.0f} ({len(items)} items, longest {max(items)})")
        print(f"| {kind} B={b} L~{n} | {us} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
