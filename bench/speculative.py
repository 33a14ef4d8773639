"""Speculative (DFlash) against plain greedy decoding through one CPU artifact, side by side in one run.

    python -m pipeline model=smollm2_135m draft=dflash draft.n_heads=9 draft.n_kv_heads=3 draft.head_dim=64 \
        draft.hidden_dim=1536 draft.target_layer_ids=null kv.max_seqs=4 stages=[export,lower_kv,compile] \
        experiment_name=smollm2_dflash4
    python bench/speculative.py outputs/smollm2_dflash4/v0001 [--seqs 1 4] [--acceptance 0.5 0.9] [--tokens 48]

A draft with random weights proposes nothing the target accepts, so the proposals are the target's own
greedy continuation (from the plain run) with each proposal corrupted independently at the rate that
gives the asked acceptance (the share of proposals accepted, on average); the draft still runs every
round, so its cost is in the figures. Every sequence first holds --context tokens of a text prompt.
tokens/s = tokens produced by all sequences / wall time of the decode loop; the speculative output is
checked equal to the plain one.
"""

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

warnings.filterwarnings("ignore")
TEXT = "The history of the city begins with a small settlement on the river, where traders met to exchange grain and "


def _prefill(s, seqs: int, context: list[int]) -> dict:
    for i in range(seqs):
        s.add(i)
    last = {}
    for i in range(seqs):
        for start in range(0, len(context), s.max_step_tokens):
            last[i] = s.step({i: context[start: start + s.max_step_tokens]})[i]
    return {i: int(logits.argmax()) for i, logits in last.items()}


def plain(version: Path, seqs: int, context: list[int], tokens: int) -> tuple[float, dict]:
    from pipeline.runtime.session import Session

    s = Session(version)
    nxt = _prefill(s, seqs, context)
    out = {i: [t] for i, t in nxt.items()}
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        logits = s.step({i: [out[i][-1]] for i in range(seqs)})
        for i in range(seqs):
            out[i].append(int(logits[i].argmax()))
    return seqs * (tokens - 1) / (time.perf_counter() - t0), out


def corruption_rate(acceptance: float, proposals: int) -> float:
    """q such that proposals corrupted independently at rate q are accepted at ``acceptance`` on average
    (a round keeps the proposals before the first corrupted one)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        q = (lo + hi) / 2
        mean = sum((1 - q) ** j for j in range(1, proposals + 1)) / proposals
        lo, hi = (q, hi) if mean > acceptance else (lo, q)
    return q


def speculative(version: Path, seqs: int, context: list[int], tokens: int, greedy: dict, q: float | None,
                seed: int = 0) -> tuple[float, float]:
    from pipeline.runtime.session import Session

    s = Session(version)
    rng = random.Random(seed)
    nxt = _prefill(s, seqs, context)
    out = {i: [t] for i, t in nxt.items()}

    def propose(i, proposals):
        if q is None:
            return proposals  # the draft's own
        have = len(out[i])
        want = (greedy[i] + [0] * len(proposals))[have: have + len(proposals)]
        return [(t + 1) % s.vocab_size if rng.random() < q else t for t in want]

    accepted = proposed = 0
    t0 = time.perf_counter()
    while live := [i for i in range(seqs) if len(out[i]) < tokens]:
        rounds = s.speculate({i: out[i][-1] for i in live}, propose=propose)
        for i, r in rounds.items():
            out[i] += r.tokens
            accepted += len(r.tokens) - 1
            proposed += len(r.proposals)
    seconds = time.perf_counter() - t0
    produced = sum(len(out[i]) - 1 for i in range(seqs))
    for i in range(seqs):
        if out[i][:tokens] != greedy[i][:tokens]:
            raise SystemExit(f"sequence {i}: the speculative output differs from plain greedy decoding")
    return produced / seconds, accepted / max(proposed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", type=Path, help="an artifact built with draft=dflash")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per sequence")
    args = parser.parse_args()
    import json

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    manifest = json.loads((args.version / "manifest.json").read_text())
    block = manifest["draft"]["block_size"]
    if manifest.get("tokenizer"):
        from transformers import AutoTokenizer

        context = AutoTokenizer.from_pretrained(str(args.version / manifest["tokenizer"]))(TEXT * 8).input_ids[: args.context]
    else:
        context = [(7 * i + 3) % manifest["target"]["vocab_size"] for i in range(args.context)]
    rows = []
    for seqs in args.seqs:
        base, greedy = plain(args.version, seqs, context, args.tokens + block)
        print(f"S={seqs}: plain {base:.1f} tok/s", flush=True)
        for target in [None, *args.acceptance]:
            q = corruption_rate(target, block - 1) if target is not None else None
            rate, got = speculative(args.version, seqs, context, args.tokens, greedy, q)
            label = "the draft's own (random weights)" if target is None else f"oracle, corrupted at {q:.3f}"
            rows.append((seqs, label, got, rate, base))
            print(f"  {label}: acceptance {got:.0%}, {rate:.1f} tok/s ({rate / base:.2f}x plain)", flush=True)
    table = ("| S | proposals | acceptance | speculative tokens/s | plain tokens/s | speculative / plain |\n"
             "|---|---|---|---|---|---|\n")
    table += "".join(f"| {s} | {label} | {got:.0%} | {rate:.1f} | {base:.1f} | {rate / base:.2f}x |\n"
                     for s, label, got, rate, base in rows)
    print(table)
    cmd = (f"python bench/speculative.py {args.version} --seqs {' '.join(map(str, args.seqs))} --acceptance "
           f"{' '.join(map(str, args.acceptance))} --context {args.context} --tokens {args.tokens}")
    model = "SmolLM2-135M-Instruct" if manifest.get("tokenizer") else "the tiny target"
    write_section("speculative", f"## Speculative (DFlash) vs plain decoding, {model}, CPU\n\n`{cmd}` on {os.cpu_count()} "
                  f"CPU cores, {time.strftime('%Y-%m-%d')}: block {block} (7 proposals a round), every sequence holds "
                  f"{args.context} tokens of context, {args.tokens} new tokens each; acceptance = share of proposals "
                  f"accepted (measured; the corruption draws are seeded, so a short run can land off the asked "
                  f"rate); the speculative output equals the plain output in every row. The artifact: the build "
                  f"command at the top of `bench/speculative.py` (a one-layer draft of SmolLM2's width tapping layer "
                  f"15; the draft runs every round, its proposals then replaced).\n\n{table}")


if __name__ == "__main__":
    main()
