"""export: the eager model and its methods, traced with the neutral KV op.

gives: model (the eager oracle and its args), exported ({method: (ExportedProgram, MethodInputs)}),
       tokenizer (the checkpoint's, saved as tokenizer/; None without a checkpoint)
"""

from pathlib import Path

import torch
from torch.export import Dim

from pipeline.config import ModelConfig
from pipeline.models.args import ModelArgs, model_args
from pipeline.models.families import family
from pipeline.models.loaders import load_into
from pipeline.models.tokenizer import save_tokenizer
from pipeline.models.transformer import EmbedText, ForwardFromEmbeddings, build_model
from pipeline.passes.lower_offgraph_kv import MethodInputs


def _dim(name: str, upper: int):
    # A dimension that can only be 1 is exported static: torch.export rejects min == max.
    return Dim(name, min=1, max=upper) if upper > 1 else Dim.STATIC


def method_inputs(args: ModelArgs, max_step_tokens: int, max_seqs: int, dtype=torch.float32) -> dict[str, MethodInputs]:
    # one step method serves prefill chunks (up to max_step_tokens) and decodes (one token of each
    # of up to max_seqs sequences): a second, decode-only method would be the same graph compiled
    # twice, doubling the compile stage's time and memory for no speed (the logit_rows gather is all
    # that differs)
    width = max(max_step_tokens, max_seqs)
    n_tokens, n_seqs = _dim("n_tokens", width), _dim("n_seqs", max_seqs)
    return {
        "embed_text": MethodInputs((torch.zeros(width, dtype=torch.int64),), ({0: n_tokens},), n_tokens),
        "forward_from_embeddings": MethodInputs(
            (torch.zeros(1, width, args.dim, dtype=dtype), torch.arange(width), torch.arange(max_seqs)),
            ({1: n_tokens}, {0: n_tokens}, {0: n_seqs}), n_tokens),
    }


def run(model_cfg: ModelConfig, kv_cfg, inputs: dict, workdir) -> dict:
    args = model_args(model_cfg)
    dtype = getattr(torch, model_cfg.dtype)
    model = build_model(args, model_cfg.seed)
    tokenizer = None
    if model_cfg.checkpoint:
        print(f"  load {model_cfg.checkpoint}", flush=True)
        load_into(model, model_cfg.checkpoint, family(model_cfg.family))
        if workdir is not None:
            tokenizer = save_tokenizer(model_cfg.checkpoint, Path(workdir))
    model = model.to(dtype)
    views = {
        "embed_text": EmbedText(model),
        "forward_from_embeddings": ForwardFromEmbeddings(model),
    }
    exported = {}
    for name, spec in method_inputs(args, kv_cfg.max_step_tokens, kv_cfg.max_seqs, dtype).items():
        print(f"  export {name}", flush=True)
        with torch.no_grad():
            ep = torch.export.export(views[name], spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
        exported[name] = (ep, spec)
    return {"model": model, "exported": exported, "tokenizer": tokenizer}
