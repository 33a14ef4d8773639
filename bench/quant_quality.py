"""Quantization quality of built artifacts on several texts: what ``validate`` measures
(``pipeline/validation/quality.py``: mean / p99 / max KL divergence against the unquantized eager model,
top-1 agreement, the perplexity ratio), on the validation text and on other fixed texts, the
calibration of the per-scheme bounds in ``conf/quant/``; with ``--decode``, each artifact's decode
speed too (one sequence, 64 tokens after a 64-token prompt).

    python bench/quant_quality.py outputs/cal_int4/v0001 outputs/cal_int8/v0001 [--texts project types comparisons]

The texts: ``project``, the validation text (``pipeline/validation/text.py``); the others, sections of
the Python documentation shipped in the standard library (``pydoc_data.topics``), fixed for a given
Python. Prints a table and writes the "quant_quality" section of docs/benchmarks.md (``--out``).

llama.cpp beside them (``--gguf NAME=PATH``, measured against the first artifact's unquantized model,
with the same windows and scored positions): the logits through llama-cpp-python (not in the project's
dependencies: ``pip install --target DIR --no-deps llama-cpp-python==0.3.36`` builds it from source,
then ``PYTHONPATH=DIR``), each window from an empty context, no BOS added (SmolLM2's GGUF adds none).
``--requantize-q4_0 OUT`` first writes the model's GGUF requantized to Q4_0 with gguf-py, as
``llama-quantize --allow-requantize IN OUT Q4_0`` does for it (every Q4_1 matrix dequantized and
quantized to Q4_0; the tied embedding stays Q8_0; the file llama.cpp's own requantizer writes has
the same tensors byte for byte, checked once)."""

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from _results import write_section


def texts(names: list[str]) -> dict[str, str]:
    from pydoc_data.topics import topics

    from pipeline.validation.text import TEXT

    return {name: TEXT if name == "project" else topics[name] for name in names}


def requantize_q4_0(source: str, out: Path) -> None:
    """``source`` (a GGUF) with its Q4_1 matrices requantized to Q4_0 (gguf-py's reference rounding)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents(),
                             endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        value = int(gguf.LlamaFileType.MOSTLY_Q4_0) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if array else None)
    tensors = []
    for t in reader.tensors:
        data, qtype = t.data, t.tensor_type
        if qtype == kind.Q4_1:
            data, qtype = quantize(dequantize(np.asarray(data), kind.Q4_1).astype(np.float32), kind.Q4_0), kind.Q4_0
        tensors.append(np.asarray(data))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()


def llama_cpp_rows(ggufs: dict[str, str], reference, tokens: list[int], decode: bool) -> list:
    """Each GGUF through llama.cpp on ``tokens``' windows against ``reference``; (name, measures, MiB, tok/s)."""
    import llama_cpp
    import numpy as np
    import torch

    from pipeline.validation.quality import measure

    rows = []
    for name, path in ggufs.items():
        llm = llama_cpp.Llama(model_path=path, n_ctx=512, logits_all=True, n_threads=2, n_threads_batch=2, verbose=False)

        def logits(window, llm=llm):
            llm.reset()
            llm.eval(window)
            assert list(llm.input_ids[: len(window)]) == list(window)  # exactly our tokens, nothing prepended
            return torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32))

        m = measure(logits, reference, tokens, 512)
        speed = None
        if decode:
            llm.reset()
            llm.eval(tokens[:64])
            times = []
            for t in tokens[64:128]:
                start = time.perf_counter()
                llm.eval([t])
                times.append(time.perf_counter() - start)
            speed = 1 / statistics.median(times)
        rows.append((name, m, Path(path).stat().st_size / 2**20, speed))
    return rows


def decode_tok_s(session, steps: int = 64) -> float:
    session.add("speed")
    logits = session.step({"speed": list(range(100, 164))})["speed"]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = session.step({"speed": [int(logits.argmax())]})["speed"]
        times.append(time.perf_counter() - start)
    session.release("speed")
    return 1 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--texts", nargs="+", default=["project", "types", "comparisons"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--section", default="quant_quality", help="the docs/benchmarks.md section written")
    parser.add_argument("--gguf", nargs="*", default=[], metavar="NAME=PATH", help="llama.cpp models beside ours")
    parser.add_argument("--requantize-q4_0", type=Path, metavar="OUT",
                        help="write the first artifact's GGUF requantized to Q4_0 here and add it as llama.cpp Q4_0")
    parser.add_argument("--out", type=Path, default=None, help="write the docs section to this file (default: docs/benchmarks.md)")
    args = parser.parse_args()

    from pipeline.models.methods import build_target
    from pipeline.runtime.session import Session
    from pipeline.validation.quality import measure, pte_logits

    rows, reference = [], None
    for art in args.artifacts:
        cfg = OmegaConf.load(art / ".hydra" / "config.yaml")
        session = Session(art, prefix_cache=False)
        reference = build_target(cfg.model, None)[0].float().eval()
        size = (art / "model.pte").stat().st_size / 2**20
        speed = decode_tok_s(session) if args.decode else None
        for name, text in texts(args.texts).items():
            tokens = session.tokenizer(text)["input_ids"][: args.tokens]
            m = measure(lambda w, session=session: pte_logits(session, w), reference, tokens, session.max_length)
            rows.append((cfg.quant.scheme, str(art), name, m, size, speed))
            print(f"{cfg.quant.scheme:16} {name:12} tokens {m['tokens_scored']:5d}  mean KLD {m['mean_kld']:.4f}  p99 "
                  f"{m['p99_kld']:.3f}  max {m['max_kld']:.3f}  top-1 {m['top1_agreement']:.3f}  ppl ratio {m['ppl_ratio']:.4f}"
                  f"  (ppl {m['ppl']:.2f} / {m['ppl_unquantized']:.2f})", flush=True)
    ggufs = dict(g.split("=", 1) for g in args.gguf)
    if args.requantize_q4_0:
        requantize_q4_0(OmegaConf.load(args.artifacts[0] / ".hydra" / "config.yaml").model.checkpoint, args.requantize_q4_0)
        ggufs["llama.cpp Q4_0 (requantized)"] = str(args.requantize_q4_0)
    if ggufs:  # against the first artifact's reference, on the first text
        first = Session(args.artifacts[0], prefix_cache=False)
        reference = build_target(OmegaConf.load(args.artifacts[0] / ".hydra" / "config.yaml").model, None)[0].float().eval()
        name, text = next(iter(texts(args.texts).items()))
        for gname, m, size, speed in llama_cpp_rows(ggufs, reference, first.tokenizer(text)["input_ids"][: args.tokens], args.decode):
            rows.append((gname, "llama.cpp", name, m, size, speed))
            print(f"{gname:16} {name:12} mean KLD {m['mean_kld']:.4f}  p99 {m['p99_kld']:.3f}  top-1 "
                  f"{m['top1_agreement']:.3f}  ppl ratio {m['ppl_ratio']:.4f}", flush=True)
    table = ["| scheme | artifact | text | tokens | mean KLD | p99 KLD | max KLD | top-1 | ppl ratio | .pte MiB | decode tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for scheme, art, name, m, size, speed in rows:
        table.append(f"| {scheme} | `{art}` | {name} | {m['tokens_scored']} | {m['mean_kld']:.4f} | {m['p99_kld']:.3f} | "
                     f"{m['max_kld']:.3f} | {m['top1_agreement']:.3f} | {m['ppl_ratio']:.4f} | {size:.1f} | "
                     f"{'' if speed is None else f'{speed:.1f}'} |")
    print("\n".join(table))
    command = "python bench/quant_quality.py " + shlex.join(sys.argv[1:])
    title = ("Quantization quality against the unquantized model (CPU)" if args.section == "quant_quality" else
             "Calibration of validate's quality bounds (conf/quant/): SmolLM2 on three texts (CPU)")
    body = (f"## {title}\n\n"
            f"`{command}` ({time.strftime('%Y-%m-%d')}): each text through the `.pte` and the unquantized eager "
                  "model, teacher-forced in windows of 512 tokens; KL divergence in nats per token (the unquantized "
                  "distribution first).\n\n" + "\n".join(table))
    write_section(args.section, body, *([args.out] if args.out else []))


if __name__ == "__main__":
    main()
