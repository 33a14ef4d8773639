"""Where a lone decode step's time goes: the target's step method under ExecuTorch's event tracer
(ETDump), one sequence, a 64-token prompt, then ``--steps`` greedy decodes; each event's median over the
decodes, summed by name (XNNPACK's ops inside the delegate calls, the portable kernels, the calls).

    python bench/decode_profile.py ARTIFACT [--steps 30] [--top 25]

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
    prompt = torch.randint(0, session.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    session.add("a")
    session.step({"a": prompt})
    token = 1
    for _ in range(args.steps):
        token = int(session.step({"a": [token]})["a"].argmax())
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/etdump.etdp"
        traced.write_etdump_result_to_file(path, f"{tmp}/debug.bin")
        inspector = Inspector(etdump_path=path)
    total, calls = collections.Counter(), collections.Counter()
    for block in inspector.event_blocks:
        if block.name != "Execute":
            continue
        for event in block.events:
            raw = event.perf_data.raw[1:] if event.perf_data is not None else []  # the prefill's call left out
            if raw:
                total[event.name] += statistics.median(raw)
                calls[event.name] += 1
    print("| event | ms per decode step | calls per step |\n|---|---|---|")
    for name, ms in total.most_common(args.top):
        print(f"| {name} | {ms:.3f} | {calls[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
