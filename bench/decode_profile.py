"""Where a lone decode step's time goes: the target's step method under ExecuTorch's event tracer
(ETDump), ``--seqs`` sequences (1) of ``--context`` prompt tokens (64), then ``--steps`` decodes of all of them; each event's median over the
decodes, summed by name (XNNPACK's ops inside the delegate calls, the portable kernels, the calls).

    python bench/decode_profile.py ARTIFACT [--steps 30] [--top 25] [--seqs 8 --context 1000]

Prints a table (ms per decode step, calls per step); the numbers include the tracer's own overhead
(Method::execute ~1 ms above the untraced step)."""

import argparse
import collections
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEP = "target_forward_from_embeddings"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--seqs", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=64, help="each sequence's prompt tokens before the decodes")
    args = parser.parse_args(argv)
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    from pipeline.runtime.session import Session

    session = Session(args.artifact)
    traced = portable_lib._load_for_executorch(str(Path(args.artifact) / "model.pte"), enable_etdump=True)
    method = session.method

    class Traced:
        def execute(self, inputs):
            return traced.run_method(STEP, tuple(inputs))

    session.method = lambda name: Traced() if name == STEP else method(name)
    prompt = torch.randint(0, session.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    width = session.max_step_tokens
    prefills = 0
    for i in range(args.seqs):
        session.add(i)
        for start in range(0, len(prompt), width):
            session.step({i: prompt[start: start + width]})
            prefills += 1
    for _ in range(args.steps):
        session.step({i: [1] for i in range(args.seqs)})
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/etdump.etdp"
        traced.write_etdump_result_to_file(path, f"{tmp}/debug.bin")
        inspector = Inspector(etdump_path=path)
    total, calls = collections.Counter(), collections.Counter()
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        for event in block.events:
            raw = event.perf_data.raw[prefills:] if event.perf_data is not None else []  # the prefills' calls left out
            if raw:
                total[event.name] += statistics.median(raw)
                calls[event.name] += 1
    print("| event | ms per decode step | calls per step |\n|---|---|---|")
    for name, ms in total.most_common(args.top):
        print(f"| {name} | {ms:.3f} | {calls[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
