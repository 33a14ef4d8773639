"""tanh-GELU on XNNPACK: decomposed into its formula's ops inside the delegate (what compile does,
``pipeline/backends/xnnpack.gelu_tanh``) against kept out of the delegate (ExecuTorch's portable
``gelu`` kernel, the partition split around it). A stack of GeGLU MLPs (fp32, 12 layers, 256 -> 1024),
one token and 64 tokens, each form in its own process (the kept-out form patches XNNPACK's GELU
check); each time the median of 15 medians of 20 calls. Writes the "gelu_tanh" section of
docs/benchmarks.md.

    python bench/gelu_tanh.py [--no-write]"""

import argparse
import json
import statistics
import subprocess
import sys
import time

from _results import REPO, write_section

FORMS = {"decomposed": "tanh-GELU as its formula, inside the delegate (compile's form)",
         "kept out": "tanh-GELU in ExecuTorch's portable kernel, outside the delegate"}
TOKENS = (1, 64)


def measure(form: str) -> dict:
    """In this process: lower the stack with ``form`` and time it; {tokens: ms} and the error."""
    import torch
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torch.nn import functional as F

    sys.path.insert(0, str(REPO))
    from pipeline.backends import Backend, backend
    from pipeline.backends.xnnpack import Xnnpack

    if form == "kept out":
        from executorch.backends.xnnpack.partition.config import generic_node_configs

        config = generic_node_configs.GeluConfig
        check = config.check_constraints
        config.check_constraints = lambda self, node, ep: node.kwargs.get("approximate", "none") != "tanh" and check(self, node, ep)
        Xnnpack.inlined = Backend.inlined

    class GeGLU(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.ModuleList(
                [torch.nn.Linear(256, 1024), torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)]) for _ in range(12))

        def forward(self, x):
            for gate, up, down in self.layers:
                x = x + down(F.gelu(gate(x), approximate="tanh") * up(x))
            return x

    torch.manual_seed(0)
    model = GeGLU().eval()
    ep = torch.export.export(model, (torch.randn(4, 256),), dynamic_shapes=({0: torch.export.Dim("t", min=1, max=128)},))
    xnnpack = backend("xnnpack")
    edge = to_edge_transform_and_lower(xnnpack.programs({"forward": ep}), partitioner=xnnpack.partitioners(["forward"]),
                                       compile_config=EdgeCompileConfig())
    graph = edge.exported_program("forward").graph
    out = {"partitions": sum("call_delegate" in str(n.target) for n in graph.nodes)}
    buffer = edge.to_executorch().buffer  # held: the program reads it while it lives
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    for tokens in TOKENS:
        x = torch.randn(tokens, 256)
        with torch.no_grad():
            want = model(x)
        out[f"error_{tokens}"] = float((method.execute([x])[0] - want).abs().max() / want.abs().max())
        medians = []
        for _ in range(15):
            times = []
            for _ in range(20):
                start = time.perf_counter()
                method.execute([x])
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        out[f"ms_{tokens}"] = 1000 * statistics.median(medians)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", choices=list(FORMS), help=argparse.SUPPRESS)  # one form, in a child process
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.form:
        print(json.dumps(measure(args.form)))
        return 0
    results = {}
    for form in FORMS:
        proc = subprocess.run([sys.executable, __file__, "--form", form], capture_output=True, text=True, check=True)
        results[form] = json.loads(proc.stdout.strip().splitlines()[-1])
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["## tanh-GELU on XNNPACK: decomposed in the delegate or kept out of it", "",
             f"`python bench/gelu_tanh.py` at {rev} ({time.strftime('%Y-%m-%d')}), CPU, one run: 12 GeGLU MLPs (fp32, 256 -> "
             "1024), each form in its own process; median of 15 medians of 20 calls.", "",
             "| form | partitions | 1 token (ms) | 64 tokens (ms) | max error vs eager (1 / 64 tokens) |", "|---|---|---|---|---|"]
    for form, r in results.items():
        lines.append(f"| {FORMS[form]} | {r['partitions']} | {r['ms_1']:.3f} | {r['ms_64']:.3f} | "
                     f"{r['error_1']:.1e} / {r['error_64']:.1e} |")
    d, k = results["decomposed"], results["kept out"]
    lines += ["", f"Kept out / decomposed: {k['ms_1'] / d['ms_1']:.2f}x at 1 token, {k['ms_64'] / d['ms_64']:.2f}x at 64 "
              "tokens. Compile decomposes it (`Xnnpack.inlined`)."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("gelu_tanh", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
