"""validate: drive the written .pte through a continuous-batching episode and
compare every step's logits with the oracle.

The oracle is the eager neutral model with one independent contiguous
ReferenceCache per sequence: batching and layout must not change any
sequence's logits. The episode: max_seqs + 1 sequences of different prompt
lengths, chunked prefill sharing steps with decodes, greedy decoding, one
sequence finishing and a new one taking its column (or cells), ring layers
wrapping.

needs: model, lowered, program    gives: validation (written to validation.json)

What runs the program is the backend's (``Backend.session``): ExecuTorch's runtime on CPU, the
same lowered graphs through Inductor on a GPU.
"""

import copy
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.backends import backend
from pipeline.errors import BuildError
from pipeline.feasibility import episode_sequences
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.runtime.session import Session


class ValidationFailed(BuildError):
    pass


@dataclass
class _Script:
    seq_id: str
    prompt: list[int]
    decode_steps: int
    fed: int = 0
    decoded: int = 0
    next_token: int | None = None
    cache: ReferenceCache | None = None
    errors: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # the greedy tokens, the last one not fed
    text: str | None = None  # the prompt as text (artifacts with a tokenizer)


def relative_error(got: torch.Tensor, want: torch.Tensor, metric: str = "range") -> float:
    """range: max |got - want| over the oracle's logit range; norm: ||got - want|| / ||want||."""
    got, want = got.float(), want.float()
    if metric == "norm":
        return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-12))
    return float((got - want).abs().max() / (want.max() - want.min()).clamp_min(1e-12))


def plan(validate_cfg, max_seqs: int, vocab: int) -> list[_Script]:
    """The episode's sequences (``feasibility.episode_sequences``) with random prompts."""
    gen = torch.Generator().manual_seed(validate_cfg.seed)
    return [_Script(f"seq{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), decode_steps)
            for i, (n, decode_steps) in enumerate(episode_sequences(validate_cfg, max_seqs))]


def run_episode(session: Session, model, scripts: list[_Script], causal: bool, metric: str = "range") -> dict:
    waiting, live = list(scripts), []
    stats = {"steps": 0, "mixed_steps": 0, "decode_steps": 0, "tokens": 0, "max_live": 0}
    budget = session.max_step_tokens
    while waiting or live:
        while waiting and len(live) < session.max_seqs:
            script = waiting.pop(0)
            script.cache = ReferenceCache(model.args.layer_kv(), causal=causal)
            session.add(script.seq_id)
            live.append(script)
        stats["max_live"] = max(stats["max_live"], len(live))
        feeds, room = {}, budget
        decoding = [s for s in live if s.fed == len(s.prompt)]
        for s in decoding:  # decodes first, one token each
            feeds[s.seq_id] = [s.next_token]
            room -= 1
        prefilling = 0
        for s in live:  # then prefill chunks fill the rest of the step
            if s.fed < len(s.prompt) and room > 0:
                feeds[s.seq_id] = s.prompt[s.fed: s.fed + room]
                room -= len(feeds[s.seq_id])
                prefilling += 1
        logits = session.step(feeds)
        stats["steps"] += 1
        stats["mixed_steps"] += bool(decoding) and prefilling > 0
        stats["decode_steps"] += not prefilling
        stats["tokens"] += sum(len(t) for t in feeds.values())
        by_id = {s.seq_id: s for s in live}
        for seq_id, toks in feeds.items():
            s = by_id[seq_id]
            start = s.fed + s.decoded
            with reference_cache(s.cache), torch.no_grad():
                emb = model.embed(torch.tensor(toks))
                want = model.logits(model.hidden(emb, torch.arange(start, start + len(toks)))[-1:])[0]
            s.errors.append(relative_error(logits[seq_id], want, metric))
            if s.fed < len(s.prompt):
                s.fed += len(toks)
            else:
                s.decoded += 1
            s.next_token = int(logits[seq_id].argmax())
            if s.fed == len(s.prompt):
                s.generated.append(s.next_token)
        for s in list(live):
            if s.fed == len(s.prompt) and s.decoded >= s.decode_steps:
                session.release(s.seq_id)
                live.remove(s)
    return stats


def backend_graphs(model_cfg, kv_cfg, backend_cfg) -> dict:
    """export -> lower_kv -> the graphs the backend compiles, from the config alone (the GPU
    validation's child process rebuilds them this way; configs as plain containers)."""
    from omegaconf import OmegaConf

    from pipeline.backends import backend
    from pipeline.stages import export, lower_kv

    model_cfg, kv_cfg, backend_cfg = (OmegaConf.create(c) for c in (model_cfg, kv_cfg, backend_cfg))
    # no workdir: the graphs only (export would save the checkpoint's tokenizer into one)
    exported = export.run(model_cfg, kv_cfg, {}, None)
    lowered = lower_kv.run(kv_cfg, backend_cfg, exported, None)
    return backend(backend_cfg.name).programs(lowered["lowered"])


def graphs_recipe(model_cfg, kv_cfg, backend_cfg):
    """``backend_graphs`` for these sections as a picklable call (for a child process)."""
    from omegaconf import OmegaConf

    return functools.partial(backend_graphs, *(OmegaConf.to_container(c, resolve=True)
                                               for c in (model_cfg, kv_cfg, backend_cfg)))


def _text_prompts(scripts: list[_Script], prompts: list[str], session: Session) -> None:
    """The episode's prompts as text (``validate.prompts``, cycled), tokenized by the artifact's tokenizer."""
    for i, s in enumerate(scripts):
        s.text = prompts[i % len(prompts)]
        s.prompt = session.tokenizer(s.text).input_ids
        end = len(s.prompt) + s.decode_steps
        if session.max_length is not None and end > session.max_length:
            raise ValidationFailed(f"validate.prompts[{i % len(prompts)}] is {len(s.prompt)} tokens; with "
                                   f"{s.decode_steps} decode steps it passes kv.capacity={session.max_length}")


def run(validate_cfg, model_cfg, kv_cfg, backend_cfg, inputs: dict, workdir: Path) -> dict:
    model = inputs["model"]
    if next(model.parameters()).dtype != torch.float32:  # the oracle computes in fp32 from the same weights
        model = copy.deepcopy(model).float()
    with backend(backend_cfg.name).session(validate_cfg, model_cfg, kv_cfg, backend_cfg, inputs, workdir) as (session, runtime):
        scripts = plan(validate_cfg, session.max_seqs, model.args.vocab_size)
        if session.manifest.get("tokenizer") and validate_cfg.prompts:
            _text_prompts(scripts, list(validate_cfg.prompts), session)
        print(f"  episode: {len(scripts)} sequences through {session.layout} (max_seqs={session.max_seqs})", flush=True)
        stats = run_episode(session, model, scripts, kv_cfg.causal, validate_cfg.metric)
    worst = max(max(s.errors) for s in scripts)
    if scripts[0].text is not None:
        decode = session.tokenizer.decode
        text = {s.seq_id: {"prompt": s.text, "continuation": decode(s.generated, skip_special_tokens=True)} for s in scripts}
    passed = worst <= validate_cfg.tolerance
    report = {
        "scenario": {
            "layout": session.layout, "max_seqs": session.max_seqs,
            "sequences": [{"id": s.seq_id, "prompt_tokens": len(s.prompt), "decoded": s.decoded} for s in scripts],
            **stats,
        },
        **({"text": text} if scripts[0].text is not None else {}),
        "runtime": runtime,
        "metric": {"range": "max |logits - oracle| / (oracle logit range)",
                   "norm": "||logits - oracle|| / ||oracle||"}[validate_cfg.metric] + ", every step of every sequence",
        "per_sequence": {s.seq_id: max(s.errors) for s in scripts},
        "metric_name": validate_cfg.metric,
        "max_relative_error": worst,
        "tolerance": validate_cfg.tolerance,
        "passed": passed,
    }
    (workdir / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"  max relative error ({validate_cfg.metric}) {worst:.2e} (tolerance {validate_cfg.tolerance:.0e}) "
          f"over {stats['steps']} steps", flush=True)
    if not passed:
        raise ValidationFailed(
            f"validation failed: max relative logit error {worst:.3e} exceeds validate.tolerance={validate_cfg.tolerance}")
    return {"validation": report}
