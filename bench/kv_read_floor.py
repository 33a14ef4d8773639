"""What a decode step's attention costs at long context on this CPU, in the forms ExecuTorch's CPU ops
allow, against what reading K and V once would cost (issue 49's S=8 / S=1 goal).

    python bench/kv_read_floor.py [--shapes 1x1000 8x256 8x1000] [--layers 30] [--runs 20]

One decode step's attention over B sequences of N keys each, SmolLM2-135M's shapes (9 query heads, 3 KV
heads of 64, 30 layers), each form a program lowered to XNNPACK and run by ExecuTorch's runtime, the
store a constant of 8 x 1,024 slots a layer (the keys of sequence b at slots ``8 n + b``, as the
batched-sequence layout interleaves its columns). The forms (no masks: the landed op adds them):

- ``gathered`` (the landed form, ``kernels/reference._attend_group``): the store ``[slots, Hkv, D]``;
  ``index_select`` of the listed slots, permuted into the matmuls' ``[B * Hkv, D, N]`` and
  ``[B * Hkv, N, D]``; two ``bmm``.
- ``gathered int8``: the same of an 8-bit store (``kv.dtype=int8``): the int8 rows gathered, then a
  scale-1 dequantization with the permute (the scales, ``G`` numbers per key, left out).
- ``head-major``: a store ``[Hkv, slots, D]`` (not built): the gather gives the matmuls' order, no
  permute of the keys.
- ``head-major, keys left``: the same with the scores computed transposed, ``K q^T`` (XNNPACK packs a
  ``bmm``'s right operand: the queries here, not the keys).
- ``native (kv.cpu_kernel=native)``, ``native int8``: ``kvcache::sdpa_gather_alone`` (``_q8``) run by
  ``pipeline/kernels/cpu/sdpa_gather.cpp``, a kernel of ExecuTorch's runtime that reads the listed rows where
  they lie (``pipeline/kernels/native.py`` builds it with g++ and loads it). Left out, with a line saying
  so, where g++ is missing.

Beside each: the bytes of K and V the step reads (float32, or int8 for the 8-bit store) and the time
reading them once takes at the machine's read bandwidth (``torch.sum`` over 400 MB, measured in the same
run): the floor of a form that reads the stores in place. Every form is checked against eager torch.
Writes the "kv_read_floor" section of docs/benchmarks.md (``--out`` another file).
"""

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from _results import RESULTS, write_section

warnings.filterwarnings("ignore")
HQ, HKV, D, COLUMNS, ROWS = 9, 3, 64, 8, 1024
G = HQ // HKV


class Gathered(nn.Module):
    def __init__(self, layers: int, b: int, n: int, int8: bool = False):
        super().__init__()
        self.b, self.n, self.int8, self.layers = b, n, int8, layers
        for i in range(layers):
            k, v = torch.randn(COLUMNS * ROWS, HKV, D), torch.randn(COLUMNS * ROWS, HKV, D)
            if int8:
                k, v = (x.mul(40).round().clamp(-127, 127).to(torch.int8) for x in (k, v))
            self.register_buffer(f"k{i}", k)
            self.register_buffer(f"v{i}", v)

    def rows(self, store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = store.index_select(0, slots)
        if self.int8:
            rows = torch.ops.quantized_decomposed.dequantize_per_tensor.default(rows, 1.0, 0, -127, 127, torch.int8)
        return rows.view(self.b, self.n, HKV, D)

    def forward(self, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, n, out = self.b, self.n, []
        for i in range(self.layers):
            k = self.rows(getattr(self, f"k{i}"), slots).permute(0, 2, 3, 1).reshape(b * HKV, D, n)
            v = self.rows(getattr(self, f"v{i}"), slots).permute(0, 2, 1, 3).reshape(b * HKV, n, D)
            out.append(torch.bmm(torch.softmax(torch.bmm(q, k) * 0.125, -1), v))
        return torch.stack(out).sum(0)


class HeadMajor(nn.Module):
    def __init__(self, layers: int, b: int, n: int, keys_left: bool):
        super().__init__()
        self.b, self.n, self.keys_left, self.layers = b, n, keys_left, layers
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.randn(HKV, COLUMNS * ROWS, D))
            self.register_buffer(f"v{i}", torch.randn(HKV, COLUMNS * ROWS, D))

    def forward(self, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # batches in (head, sequence) order: q [Hkv * B, G, D]
        out = []
        for i in range(self.layers):
            k = getattr(self, f"k{i}").index_select(1, slots).reshape(HKV * self.b, self.n, D)
            v = getattr(self, f"v{i}").index_select(1, slots).reshape(HKV * self.b, self.n, D)
            if self.keys_left:
                weights = torch.softmax(torch.bmm(k, q.transpose(1, 2)).transpose(1, 2) * 0.125, -1)
            else:
                weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.125, -1)
            out.append(torch.bmm(weights, v))
        return torch.stack(out).sum(0)


class InPlace(Gathered):
    """``kv.cpu_kernel=native``: a decode's tokens alone (``kvcache::sdpa_gather_alone``), run by
    pipeline/kernels/cpu/sdpa_gather.cpp (each sequence's token over its own list, as a decode of B sequences)."""

    def __init__(self, layers: int, b: int, n: int, int8: bool = False):
        super().__init__(layers, b, n, int8)
        for i in range(layers if int8 else 0):
            self.register_buffer(f"ks{i}", torch.rand(COLUMNS * ROWS, HKV) / 40)  # a scale per row and head
            self.register_buffer(f"vs{i}", torch.rand(COLUMNS * ROWS, HKV) / 40)
        self.register_buffer("q_pos", torch.full((b,), n))

    def forward(self, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        listed = slots.view(self.b, 1, self.n)
        one = torch.cat([listed, torch.arange(self.n).expand(self.b, 1, self.n),
                         torch.arange(self.b).view(self.b, 1, 1).expand(self.b, 1, self.n)], dim=1)
        qh, out = q.reshape(self.b, HQ, D), []
        step = (self.q_pos, one, 0.125, True, 0)
        for i in range(self.layers):
            k, v = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            if self.int8:
                o = torch.ops.kvcache.sdpa_gather_alone_q8(qh, k, getattr(self, f"ks{i}"), v, getattr(self, f"vs{i}"),
                                                           *step)
            else:
                o = torch.ops.kvcache.sdpa_gather_alone(qh, k, v, *step)
            out.append(o.reshape(self.b * HKV, G, D))
        return torch.stack(out).sum(0)


def load_inplace() -> bool:
    """The native kernels (pipeline/kernels/native.py: built with g++, loaded beside the runtime); False, with
    a line saying so, where g++ is missing."""
    import shutil

    if not shutil.which("g++"):
        print("no g++: the native kernel's rows are left out", flush=True)
        return False
    from pipeline.kernels import native

    native.load()
    return True


def lower(module: nn.Module, args: tuple):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    program = to_edge_transform_and_lower(torch.export.export(module, args), partitioner=[XnnpackPartitioner()],
                                          compile_config=EdgeCompileConfig(_check_ir_validity=False))
    buffer = program.to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    method.keep = buffer  # the runtime reads the program from this buffer: it must outlive the method
    return method


def timed(method, args: tuple, runs: int) -> float:
    times = []
    for _ in range(runs + 3):
        start = time.perf_counter()
        method.execute(args)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def read_bandwidth() -> float:
    """GB/s of a sum over 400 MB (the median of 5): what reading the stores once would run at."""
    x = torch.randn(100_000_000)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1x1000", "8x256", "8x1000"], help="BxN: sequences x keys")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import executorch.kernels.quantized  # noqa: F401  (dequantize_per_tensor's out variant)
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401

    inplace = load_inplace()
    torch.manual_seed(0)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth:.1f} GB/s", flush=True)
    rows = []
    for shape in args.shapes:
        b, n = (int(x) for x in shape.split("x"))
        slots = (torch.arange(n)[None, :] * COLUMNS + torch.arange(b)[:, None]).reshape(-1)
        q = torch.randn(b * HKV, G, D)
        forms = {"gathered (landed)": Gathered(args.layers, b, n), "gathered int8 (landed)": Gathered(args.layers, b, n, True),
                 "head-major": HeadMajor(args.layers, b, n, False),
                 "head-major, keys left": HeadMajor(args.layers, b, n, True)}
        if inplace:
            forms["native (kv.cpu_kernel=native)"] = InPlace(args.layers, b, n)
            forms["native int8"] = InPlace(args.layers, b, n, True)
        for name, module in forms.items():
            method = lower(module, (q, slots))
            want = module(q, slots)
            error = ((method.execute((q, slots))[0] - want).abs().max() / want.abs().max()).item()
            assert error < 1e-5, (name, shape, error)
            ms = timed(method, (q, slots), args.runs)
            item = 1 if "int8" in name else 4
            read = 2 * args.layers * b * n * HKV * D * item
            floor = read / bandwidth / 1e6
            rows.append((shape, name, ms, read / 1e6, floor))
            print(f"{shape} {name}: {ms:.1f} ms, reads {read / 1e6:.0f} MB, once {floor:.1f} ms, relative error {error:.1e}",
                  flush=True)
            del method
    lines = [f"`python bench/kv_read_floor.py --shapes {' '.join(args.shapes)} --layers {args.layers} --runs "
             f"{args.runs}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores): one decode step's attention over B sequences "
             f"of N keys, SmolLM2-135M's shapes ({args.layers} layers, 9 query heads, 3 KV heads of 64), each form "
             f"lowered to XNNPACK and run by ExecuTorch's runtime, the median of {args.runs}; the read bandwidth "
             f"(a sum over 400 MB) {bandwidth:.1f} GB/s in the same run. \"Read once\": K and V's bytes at that "
             "bandwidth, the floor of a form that reads the stores in place.", "",
             "| B x N | form | ms a step | K and V bytes | read once, ms | form / read once |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {name} | {ms:.1f} | {mb:.0f} MB | {floor:.1f} | {ms / floor:.1f}x |"
              for s, name, ms, mb, floor in rows]
    write_section("kv_read_floor", "## A decode step's attention against reading K and V once (CPU)\n\n" + "\n".join(lines),
                  args.out)


if __name__ == "__main__":
    main()
