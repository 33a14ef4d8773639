"""validate's episode: sequences driven through a session of the written program on the server's
schedule (``runtime/schedule.py``: chunked prefill sharing steps with decodes, greedy decoding, a
finished sequence's column or cells taken by a waiting one), every step's logits compared with the
oracles: the eager model on each sequence alone (and, for a quantized artifact, the unquantized eager
model; with a draft, the eager draft). ``pipeline.stages.validate`` runs it and writes the report."""

from dataclasses import dataclass, field

import torch

from pipeline.build.feasibility import episode_sequences
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.progress import Progress
from pipeline.runtime import schedule
from pipeline.runtime.images import splice
from pipeline.runtime.sampling import accepted_length
from pipeline.runtime.schedule import Budget, Slot, State
from pipeline.runtime.session import Session


@dataclass
class Script:
    seq_id: str
    prompt: list[int]
    decode_steps: int
    decoded: int = 0  # tokens fed after the prompt (the schedule's ``Slot`` keeps the prompt's progress)
    cache: ReferenceCache | None = None
    errors: list[float] = field(default_factory=list)
    # speculative decoding (an artifact with a draft): the eager draft's cache, the eager target's
    # tapped features not yet given to it, the draft's logit errors, proposals that differed, the
    # tokens each round gave, and the rounds whose tokens are not the greedy choice of the .pte's own
    # verification logits
    draft_cache: ReferenceCache | None = None
    features: torch.Tensor | None = None
    draft_errors: list[float] = field(default_factory=list)
    proposal_mismatches: int = 0
    acceptance: list[int] = field(default_factory=list)
    off_greedy_rounds: int = 0
    # an image sequence (an artifact with a vision encoder): the image, the eager encoder's features
    # not yet spliced, the .pte's features against them
    image: object = None
    image_features: torch.Tensor | None = None
    image_embedding: torch.Tensor | None = None  # the prompt's eager embeddings, the image spliced in
    vision_error: float | None = None
    # a quantized artifact: the unquantized eager model on the same tokens (its own cache), each step's
    # logit error against it and whether the greedy tokens agree; and whether the .pte's greedy token
    # equals the quantized oracle's (with a draft, a step is each token a round keeps: its block row)
    float_cache: ReferenceCache | None = None
    float_errors: list[float] = field(default_factory=list)
    float_agree: list[bool] = field(default_factory=list)
    oracle_agree: list[bool] = field(default_factory=list)
    # a causal artifact without a draft: every token fed, and each step's last row and logits, for the
    # oracles' one forward over the sequence after the episode (``_oracles_over_sequences``)
    fed_tokens: list[int] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # the greedy tokens, the last one not fed
    text: str | None = None  # the prompt as text (artifacts with a tokenizer)


def relative_error(got: torch.Tensor, want: torch.Tensor, metric: str = "range") -> float:
    """range: max |got - want| over the oracle's logit range; norm: ||got - want|| / ||want||."""
    got, want = got.float(), want.float()
    if metric == "norm":
        return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-12))
    return float((got - want).abs().max() / (want.max() - want.min()).clamp_min(1e-12))


def plan(validate_cfg, max_seqs: int, vocab: int) -> list[Script]:
    """The episode's sequences (``feasibility.episode_sequences``) with random prompts; the last one, which
    waits for the first's column, begins as the first does (``share_prefix``)."""
    gen = torch.Generator().manual_seed(validate_cfg.seed)
    scripts = [Script(f"seq{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), decode_steps)
               for i, (n, decode_steps) in enumerate(episode_sequences(validate_cfg, max_seqs))]
    share_prefix(scripts)
    return scripts


def share_prefix(scripts: list[Script]) -> None:
    """The last sequence (it waits for a column; the first, which decodes least, is released first) starts with the first's
    prompt, up to all but its own last token, so that a session with the prefix cache adopts the
    released rows (where they still hold it: ``kv/layout_sequence.prefix_rows_held``). Its length stays, so
    the episode's feasibility does not change. (Text prompts replace these later, and then a chat
    template's shared opening is the prefix; an image's placeholders go in after a prompt's first token,
    so an image sequence shares that token only.)"""
    if len(scripts) < 2:
        return
    first, last = scripts[0], scripts[-1]
    shared = min(len(first.prompt), len(last.prompt) - 1)
    last.prompt = first.prompt[:shared] + last.prompt[shared:]


def add_images(scripts: list[Script], vision: dict, vocab_size: int, seed: int) -> None:
    """Every other sequence (seq1, seq3, ...) gets a random image: its placeholder tokens go in after the
    prompt's first token, and no other token of the prompt is the placeholder."""
    import numpy as np

    rng = np.random.default_rng(seed)
    placeholder, size = vision["image_token_id"], vision["image_size"]
    for s in scripts[1::2]:
        s.image = rng.integers(0, 256, (size, size, vision["num_channels"]), dtype=np.uint8)
        text = [t if t != placeholder else (t + 1) % vocab_size for t in s.prompt]
        s.prompt = text[:1] + [placeholder] * vision["n_image_tokens"] + text[1:]


def _encode_image(session: Session, model, vision_model, s: Script, metric: str) -> None:
    """The image through the .pte's vision_encoder (the session keeps its features) and the eager one."""
    from pipeline.runtime.images import encoder_input, pixels

    got = session.add_image(s.seq_id, s.image)
    px = pixels(session.image_processor, s.image, session.vision["image_size"])
    with torch.no_grad():
        want = vision_model(encoder_input(session.vision, px).float())[0]
    s.image_features = want
    s.vision_error = relative_error(got, want, metric)
    placeholder = session.vision["image_token_id"]
    with torch.no_grad():
        s.image_embedding = model.embed(torch.tensor(s.prompt)).clone()
    splice(s.image_embedding, s.prompt, placeholder, want)


def _oracle_step(model, s: Script, toks: list[int], start: int, taps: tuple, placeholder: int | None = None,
                 cache: ReferenceCache | None = None) -> torch.Tensor:
    """The eager target on ``toks`` at ``start`` over the sequence's own cache (or ``cache``: then the
    image features are spliced but left for the next call): logits of every token (and, with a draft,
    its tapped features appended to the script's). An image sequence's eager features replace its
    placeholder tokens' embeddings."""
    with reference_cache(cache or s.cache), torch.no_grad():
        emb = model.embed(torch.tensor(toks))
        if s.image_features is not None and len(s.image_features):
            emb = emb.clone()
            used = splice(emb, toks, placeholder, s.image_features)
            if cache is None:
                s.image_features = s.image_features[used:]
        hidden, features = model.hidden_and_taps(emb, torch.arange(start, start + len(toks)), taps)
        if taps:
            s.features = features if s.features is None else torch.cat([s.features, features])
        return model.logits(hidden)


def _oracle_rows(model, s: Script, placeholder: int | None, kv_rounding=None) -> torch.Tensor:
    """The eager target's logits at the rows ``s.step_rows`` of one forward over every token ``s`` was
    fed, from position 0, over a cache of its own (the image's eager features in its placeholders;
    ``kv_rounding``: the artifact's KV store's, ``ReferenceCache.rounding``)."""
    toks = torch.tensor(s.fed_tokens)
    with reference_cache(ReferenceCache(model.args.layer_kv(), causal=True, rounding=kv_rounding)), torch.no_grad():
        emb = model.embed(toks)
        if s.image_features is not None and len(s.image_features):
            emb = emb.clone()
            splice(emb, toks.tolist(), placeholder, s.image_features)
        hidden, _ = model.hidden_and_taps(emb, torch.arange(len(toks)), ())
        return model.logits(hidden[s.step_rows])


def _oracles_over_sequences(model, scripts: list[Script], metric: str, placeholder: int | None, unquantized=None,
                            kv_rounding=None) -> None:
    """Each step's error against the oracle (and the unquantized model): with causal attention a
    step's logits depend only on the tokens before it, so one forward per sequence over everything it
    was fed gives every step's oracle logits; the masks are those of the step-by-step cache (positions,
    causality, windows), and the weights are read once per sequence instead of once per step."""
    print(f"  oracles: one forward over each of the {len(scripts)} sequences", flush=True)
    for s in scripts:
        got = torch.stack(s.step_logits)
        for oracle, errors, agree, rounds in ((model, s.errors, s.oracle_agree, kv_rounding),
                                              (unquantized, s.float_errors, s.float_agree, None)):
            if oracle is not None:
                want = _oracle_rows(oracle, s, placeholder, rounds)
                errors += [relative_error(g, w, metric) for g, w in zip(got, want, strict=True)]
                agree += (got.argmax(-1) == want.argmax(-1)).tolist()
        s.step_logits = []


def _speculative_round(model, draft, rounds: dict, fed: dict, by_id: dict, metric: str, unquantized=None) -> None:
    """Check each sequence's round (``fed``: the token it fed) against the eager models: the draft's
    logits from the eager target's features, the target's logits on the verified block; both caches
    rolled back as the session's. The
    round's tokens against the greedy choice of its own verification logits (``off_greedy_rounds``). With
    ``unquantized`` (a quantized artifact), each kept row (a token the round gave) also against that
    model on the same block, over its own cache, rolled back likewise."""
    taps = tuple(draft.args.target_layer_ids)
    for seq_id, r in rounds.items():
        s = by_id[seq_id]
        start = len(s.prompt) + s.decoded  # the position of the fed token
        block = [fed[seq_id], *r.proposals]
        if r.proposals:  # the draft's block: the fed token, then mask tokens
            masked = [fed[seq_id]] + [draft.args.mask_token_id] * len(r.proposals)
            with reference_cache(s.draft_cache), torch.no_grad():
                ctx = torch.arange(start - s.features.shape[0], start)
                h = draft(s.features[None], model.embed(torch.tensor(masked)), ctx, torch.arange(start, start + len(block)))
                want = model.logits(h[0, 1:])
            s.draft_cache.truncate(start)  # the block was scratch
            s.features = s.features[:0]
            s.draft_errors.append(relative_error(r.draft_logits, want, metric))
            s.proposal_mismatches += want.argmax(-1).tolist() != r.draft_logits.argmax(-1).tolist()
        kept = len(r.tokens)  # the fed token and the accepted proposals stay
        got = r.logits.argmax(-1).tolist()
        if unquantized is not None:
            ref = _oracle_step(unquantized, s, block, start, (), cache=s.float_cache)[:kept]
            s.float_errors += [relative_error(g, w, metric) for g, w in zip(r.logits[:kept], ref, strict=True)]
            s.float_agree += [g == w for g, w in zip(got[:kept], ref.argmax(-1).tolist(), strict=True)]
            s.float_cache.truncate(start + kept)
        want = _oracle_step(model, s, block, start, taps)
        s.errors += [relative_error(g, w, metric) for g, w in zip(r.logits, want, strict=True)]  # each row of the block
        s.oracle_agree += [g == w for g, w in zip(got[:kept], want[:kept].argmax(-1).tolist(), strict=True)]
        accepted = accepted_length(block, got)  # the target's greedy choice on these logits: agreed proposals, then its token
        s.off_greedy_rounds += r.tokens != block[1: accepted + 1] + [got[accepted]]
        s.cache.truncate(start + kept)
        s.features = s.features[: s.features.shape[0] - (len(block) - kept)]  # the rejected rows' features
        s.acceptance.append(kept)
        s.generated += r.tokens
        s.decoded += kept


@dataclass(frozen=True)
class Oracles:
    """The eager models an episode holds the .pte to, and how: ``stepwise``, the oracles run each step
    over the sequence's own cache; else once per sequence after the episode."""

    model: object
    causal: bool
    metric: str
    stepwise: bool
    placeholder: int | None = None  # an artifact with a vision encoder: its image token
    draft: object = None
    vision: object = None
    unquantized: object = None
    kv_rounding: object = None  # the artifact's KV store's rounding (kv.dtype=int8), applied by the model's caches

    def cache(self) -> ReferenceCache:
        """A sequence's cache for ``model`` (the unquantized model's keep what it computes)."""
        return ReferenceCache(self.model.args.layer_kv(), causal=self.causal, rounding=self.kv_rounding)

    @property
    def taps(self) -> tuple:
        return tuple(self.draft.args.target_layer_ids) if self.draft is not None else ()


def run_episode(session: Session, model, scripts: list[Script], causal: bool, metric: str = "range",
                draft=None, vision=None, unquantized=None, stepwise: bool = False, kv_rounding=None) -> dict:
    """The continuous-batching episode, on the server's schedule (``runtime/schedule.py``: admission
    with the cells a sequence may take, decodes and prefill chunks sharing steps; with ``draft``, the
    decoding sequences' speculative round beside the step); with ``vision``, image sequences have their
    image encoded once they join; with ``unquantized`` (a quantized artifact), each step is also
    measured against that eager model on the same tokens. The oracles see each sequence alone: step by
    step over its own cache (non-causal, or with a draft), or once it is done, one forward over every
    token it was fed (``_oracles_over_sequences``; ``stepwise=True``: step by step anyway). ``kv_rounding``:
    what the artifact's KV store does to what it keeps (an 8-bit cache), which ``model``'s caches do too."""
    # causal without a draft: the oracles run after the episode, one forward per sequence; otherwise
    # (a non-causal chunk sees itself whole; a draft needs the target's features each round) step by step
    oracles = Oracles(model, causal, metric, stepwise or draft is not None or not causal,
                      session.vision["image_token_id"] if session.vision else None, draft, vision, unquantized,
                      kv_rounding)
    block = session.speculation.block_size if draft is not None else 0
    # a released sequence's rows adopted where a prompt begins alike (not with a draft: the eager draft's
    # rows of an adopted prefix are not rebuilt here; tests/runtime/test_speculation.py checks those)
    budget = Budget(session.max_step_tokens, session.max_seqs, speculative=draft is not None,
                    cells=getattr(session.pool, "n_cells", None),
                    prefix_cache=session.prefix_cache is not None and draft is None)
    slots = {s.seq_id: Slot(s.seq_id, s.prompt, cells=len(s.prompt) + s.decode_steps + block) for s in scripts}
    by_id = {s.seq_id: s for s in scripts}
    held = list(slots.values())
    stats = {"steps": 0, "mixed_steps": 0, "decode_steps": 0, "tokens": 0, "max_live": 0, "reused": {}}
    if draft is not None:
        stats["speculative_rounds"] = 0
    total = sum(len(s.prompt) + s.decode_steps for s in scripts)
    with Progress(total, "episode", "tokens") as progress:
        while held:
            progress.update(sum(slots[s.seq_id].fed + min(s.decoded, s.decode_steps) for s in scripts) - progress.done)
            step = schedule.plan(held, budget)
            for slot in step.released:
                session.release(slot.id)
                held.remove(slot)
            for slot in step.admitted:
                reused = _join(session, oracles, by_id[slot.id], step.prefixes.get(slot.id, ()))
                step.admit(slot, reused)
                if reused:
                    stats["reused"][slot.id] = reused
            stats["max_live"] = max(stats["max_live"], sum(slot.state is not State.WAITING for slot in held))
            if step.feeds:
                _check_step(session.step(step.feeds), step.feeds, slots, by_id, oracles, stats)
            if step.speculate:
                rounds = session.speculate(step.speculate)
                _speculative_round(model, draft, rounds, step.speculate, by_id, metric, unquantized)
                stats["speculative_rounds"] += 1
                stats["tokens"] += sum(len(r.proposals) + 1 for r in rounds.values())
                for seq_id, r in rounds.items():
                    slots[seq_id].next_token = r.tokens[-1]
            for slot in held:
                if slot.state is State.DECODING and by_id[slot.id].decoded >= by_id[slot.id].decode_steps:
                    slot.finish()
        progress.update(total - progress.done)
    if not oracles.stepwise:
        _oracles_over_sequences(model, scripts, metric, oracles.placeholder, unquantized, kv_rounding)
    return stats


def _join(session: Session, oracles: Oracles, s: Script, prefix) -> int:
    """A sequence the schedule admitted: its sequence (adopting what the session holds of ``prefix``), its
    image, the oracles' caches (step by step: holding the adopted prefix, as the eager model on those
    tokens computes it; else the prefix is the start of the tokens of the one forward). Returns the
    prompt tokens adopted."""
    reused = session.add(s.seq_id, prefix)
    if oracles.stepwise:
        s.cache = oracles.cache()
        if oracles.unquantized is not None:
            s.float_cache = ReferenceCache(oracles.model.args.layer_kv(), causal=oracles.causal)
    if oracles.draft is not None:
        s.draft_cache = ReferenceCache(oracles.draft.layer_kv(), causal=False)
    if s.image is not None:
        _encode_image(session, oracles.model, oracles.vision, s, oracles.metric)
    if reused and oracles.stepwise:  # the unquantized oracle first: the quantized one's call takes the image rows
        if oracles.unquantized is not None:
            _oracle_step(oracles.unquantized, s, s.prompt[:reused], 0, (), oracles.placeholder, s.float_cache)
        _oracle_step(oracles.model, s, s.prompt[:reused], 0, oracles.taps, oracles.placeholder)
    s.fed_tokens = list(s.prompt[:reused])
    return reused


def _check_step(logits: dict, feeds: dict, slots: dict, by_id: dict, oracles: Oracles, stats: dict) -> None:
    """Each fed sequence's logits against the oracles (now, or kept for after the episode); its slot
    told what it took, and the greedy token chosen where the step ended its prompt or decoded."""
    decoding = [seq_id for seq_id in feeds if slots[seq_id].state is State.DECODING]
    prefilling = len(feeds) - len(decoding)
    stats["steps"] += 1
    stats["mixed_steps"] += bool(decoding) and prefilling > 0
    stats["decode_steps"] += not prefilling
    stats["tokens"] += sum(len(t) for t in feeds.values())
    metric, placeholder = oracles.metric, oracles.placeholder
    for seq_id, toks in feeds.items():
        s, slot, got = by_id[seq_id], slots[seq_id], logits[seq_id]
        start = slot.fed + s.decoded  # the position of the step's first token of this sequence
        if not oracles.stepwise:  # for the oracles after the episode
            s.fed_tokens += toks
            s.step_rows.append(len(s.fed_tokens) - 1)
            s.step_logits.append(got.detach().reshape(-1).clone())
        else:
            if oracles.unquantized is not None:  # first: the quantized oracle's call takes the image rows
                ref = _oracle_step(oracles.unquantized, s, toks, start, (), placeholder, s.float_cache)[-1]
                s.float_errors.append(relative_error(got, ref, metric))
                s.float_agree.append(int(got.argmax()) == int(ref.argmax()))
            want = _oracle_step(oracles.model, s, toks, start, oracles.taps, placeholder)[-1]
            s.errors.append(relative_error(got, want, metric))
            s.oracle_agree.append(int(got.argmax()) == int(want.argmax()))
        s.decoded += seq_id in decoding
        if slot.took(len(toks)):
            slot.next_token = int(got.argmax())
            s.generated.append(slot.next_token)
