"""A serving session over a built artifact directory, through the ExecuTorch runtime.

The artifact decides the layout (manifest.json, cross-checked with the
program's constant methods); the session assigns a column (sequence layouts)
or cells (cell layout) to each sequence, fills the step buffers, runs mixed
prefill/decode steps and returns logits for the last token of every sequence
fed in the step: the rows a sampler reads, never one per token.

A released sequence's rows stay as they are until they are needed (the prefix cache,
``runtime/prefix_cache.py``): a new sequence whose prompt starts with the same tokens (and images)
adopts them for the longest prefix they still hold (``add(seq_id, prefix)``) and prefills only the rest.

An artifact with a DFlash draft also serves speculative steps (``speculate``): the draft proposes a
block per sequence from the target's tapped features, the target verifies every block in one step,
and each sequence keeps its accepted prefix plus the target's next token. The draft and the target
each keep only what they commit: rows written past a sequence's kept length are never read again
(the next step writes over them before any query sees them; the cell layout frees their cells).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.build.manifest import constant_methods, read, sections
from pipeline.build.roles import DRAFT, EMBED, TARGET, TARGET_STEP, VISION, VISION_ENCODER
from pipeline.errors import SessionError
from pipeline.kv.layouts import SeqState
from pipeline.kv.quantize import QUANTIZED_DTYPES
from pipeline.runtime.images import SequenceImages, encoder_input, image_key, load_processor, pixels
from pipeline.runtime.model_state import ModelState
from pipeline.runtime.prefix_cache import PrefixCache, Retained
from pipeline.runtime.speculation import Round, Speculation
from pipeline.runtime.tokens import token_ids

__all__ = ["ModelState", "Round", "Session", "SessionError"]


class Session:
    """``methods`` replaces the ExecuTorch runtime with other runners of the same methods
    (name -> callable(list of inputs) -> list of outputs), e.g. AOTInductor on a GPU. ``prefix_cache``:
    released sequences' rows are kept for new sequences that start alike (``add``); False: they are
    freed at once, and ``add`` never adopts. A non-causal target (``model.causal=false``) has none: a row
    of a chunk that sees itself whole depends on the tokens after it in that chunk, so a prefix's rows
    are not the rows a sequence of that prefix alone would write."""

    def __init__(self, artifact_dir: str | Path, methods: dict | None = None, prefix_cache: bool = True):
        artifact_dir = Path(artifact_dir)
        self.artifact_dir = artifact_dir
        self.manifest = read(artifact_dir)
        self._tokenizer = None
        # every model that keeps KV, alike: its layout's index math and its own state (the cell pool);
        # the session never asks which layout
        self.models = {name: ModelState.of(section) for name, section in sections(self.manifest).items()
                       if "layout" in section}
        target = self.models[TARGET]
        self.kv, self.kv_layout, self.pool, self.seqs = target.section, target.layout, target.pool, target.seqs
        # a draft's speculative rounds: its sequences' lengths lag the target's by the features not yet given to it
        self.speculation = Speculation(self.models[DRAFT]) if DRAFT in self.models else None
        # a vision encoder: each sequence's image features not yet spliced, its images' keys
        self.vision = self.manifest.get(VISION)
        self.images = SequenceImages(self.vision["image_token_id"] if self.vision else None)
        self._image_processor = None
        self.prefix_cache = PrefixCache(self.models) if prefix_cache and self.kv["causal"] else None
        self.tokens: dict[object, list[int]] = {}  # each live sequence's tokens, those its rows hold
        self._methods = {}
        if methods is None:
            from executorch.runtime import Runtime

            from pipeline.quant import scheme

            if (scheme(self.manifest.get("quant", {}).get("scheme", "none")).quantized
                    or self.kv.get("dtype") in QUANTIZED_DTYPES):
                # the quantized ops' kernels (embedding_byte / embedding_4bit; an 8-bit KV cache's
                # dequantize_per_tensor where portable runs it) register with the runtime when this library
                # loads; without it the method fails to load (OperatorMissing)
                import executorch.kernels.quantized  # noqa: F401
            if any(section.get("cpu_kernel") == "native" for section in sections(self.manifest).values()):
                from pipeline.kernels.native import load

                load()  # the attention's kernels (kv.cpu_kernel=native) register with the runtime
            self.program = Runtime.get().load_program(str(artifact_dir / self.manifest["program"]))
            self.runtime = "executorch.runtime"
            self._check_constants()
        else:
            self.program = None
            self.runtime = "external runners"
            self._methods = {name: _Runner(fn) for name, fn in methods.items()}
        self.layout = self.kv["layout"]
        self.max_seqs = self.kv["max_seqs"]
        self.max_step_tokens = self.kv["max_step_tokens"]
        self.max_length = self.kv["max_seq_len"]  # tokens per sequence; None: unbounded (ring layers only)
        self.vocab_size = self.kv["vocab_size"]

    @property
    def acceptance(self) -> dict[object, list[int]]:
        """Tokens each speculative round gave each live sequence (an artifact with a draft)."""
        return self.speculation.acceptance if self.speculation else {}

    def method(self, name: str):
        if name not in self._methods:
            self._methods[name] = self.program.load_method(name)
        return self._methods[name]

    def _check_constants(self) -> None:
        expect = constant_methods(sections(self.manifest))
        for name, value in expect.items():
            got = self.constant(name, many=isinstance(value, list))
            if got != value:
                raise SessionError(f"artifact disagrees with its manifest: {name}() = {got}, manifest says {value}")

    def constant(self, name: str, many: bool = False):
        """A constant method's value (``many``: a list constant, which returns one output per item)."""
        if name not in self.program.method_names:
            raise SessionError(f"the program has no constant method {name}")
        out = self.method(name).execute([])
        return list(out) if many else out[0]

    # --- sequences ---

    def add(self, seq_id, prefix: Sequence[int] = (), images: Sequence = ()) -> int:
        """A new sequence; returns how many tokens of ``prefix`` it starts with (0: it is empty).

        ``prefix``: the tokens its prompt starts with (a caller that needs the logits of the prompt's last
        token passes all but that one); ``images``: the images it will ``add_image``, in order. When a
        released sequence's rows hold a prefix of them (the same tokens, the same images for the
        placeholders among them, and rows nothing wrote over since: every model's pool and
        ``KVLayout.holds_prefix``), the longest such prefix is adopted, in every model (the target and a
        draft alike): the sequence takes those rows (a column, or the cells of those positions) and its
        length is their count; its next ``step`` feeds the tokens after them, and ``add_image`` skips the
        features the prefix already holds. Equal prefixes: the most recently released sequence's.

        Otherwise the sequence is empty, in a free column (owner bit) that holds no released sequence's
        rows, lowest first, else in the least recently released one's (whose rows are then given up).
        Refused without change: an unhashable or live id, no free sequence, a bad token."""
        try:
            live = seq_id in self.seqs
        except TypeError:
            raise SessionError(f"sequence id {seq_id!r} is not hashable; use a str or an int") from None
        if live:
            raise SessionError(f"sequence {seq_id!r} is already live")
        if len(self.seqs) >= self.max_seqs:
            raise SessionError(
                f"cannot add sequence {seq_id!r}: {self.max_seqs} sequences are live, the artifact's max_seqs; "
                "release one first or build with a larger kv.max_seqs")
        prefix = self.check_tokens(seq_id, prefix) if prefix is not None and len(prefix) else []
        cache = self.prefix_cache
        keys = [image_key(image) for image in images] if prefix and cache is not None else []
        free = sorted(set(range(self.max_seqs)) - {s.slot for s in self.seqs.values()})
        entry, length = None, 0
        if cache is not None:
            cache.prune()  # (entries whose rows are gone already: forgetting them changes nothing)
            if prefix:
                placeholder, per_image = ((self.vision["image_token_id"], self.vision["n_image_tokens"]) if self.vision
                                          else (None, 1))
                entry, length = cache.find(prefix, keys, placeholder, per_image, free)
            states = cache.take(cache.slot_for(entry, free), entry, length)
        else:
            states = {name: SeqState(slot=free[0]) for name in self.models}
        for name, model in self.models.items():
            model.seqs[seq_id] = states[name]
        self.tokens[seq_id] = prefix[:length]
        if entry is not None and self.vision:
            held = sum(t == self.vision["image_token_id"] for t in prefix[:length])  # placeholders the prefix holds
            covered = -(-held // self.vision["n_image_tokens"])  # images with a placeholder in it
            self.images.start(seq_id, entry.images[:covered], held)
        else:
            self.images.start(seq_id)
        if self.speculation:
            self.speculation.add(seq_id, self._draft_features(entry, length))
        return length

    def _draft_features(self, entry: Retained | None, length: int):
        """The target features a draft adopting ``entry``'s first ``length`` positions is still to be given:
        those of the positions from where its own rows end."""
        if entry is None or DRAFT not in entry.states:
            return None
        return entry.features[: length - min(length, entry.states[DRAFT].length)]

    def evict(self, entry: Retained) -> None:
        """Give up a released sequence's rows (``prefix_cache.entries``): its cells are free at once."""
        self.prefix_cache.evict(entry)

    def release(self, seq_id) -> None:
        """Forget a sequence. With the prefix cache, its rows stay as they are, in every model, as a
        ``Retained`` entry (its tokens, its images' keys, each model's state; a draft's pending features)
        until a new sequence adopts them or its column or cells are needed; without it, its column (or its
        cells) serve the next sequence at once."""
        seq = self.sequence(seq_id)
        tokens, keys = self.tokens.pop(seq_id), self.images.end(seq_id)
        features = self.speculation.release(seq_id) if self.speculation else None
        states = {name: model.seqs.pop(seq_id) for name, model in self.models.items()}
        if self.prefix_cache is None or seq.length == 0:
            for name, state in states.items():
                self.models[name].pool.release(state)
        else:
            self.prefix_cache.retain(tokens, keys, states, features)

    def committed(self, seq_id, tokens: list[int]) -> None:
        """A step kept ``tokens`` of ``seq_id`` (its length grew by them): the tokens its rows hold."""
        self.tokens[seq_id] += tokens

    # --- images (an artifact with a vision encoder) ---

    @property
    def image_processor(self):
        if self._image_processor is None:
            self._image_processor = load_processor(self.artifact_dir / self.vision["image_processor"])
        return self._image_processor

    def add_image(self, seq_id, image) -> torch.Tensor:
        """Encode ``image`` (a PIL image or an H x W x 3 uint8 array, at most the exported size) once
        for ``seq_id``: its ``n_image_tokens`` features replace the embeddings of the sequence's next
        placeholder tokens (``image_token_id``) that ``step`` feeds. Returns the features. A sequence that
        adopted a prefix holding this image's placeholders (``add``'s ``images``) must be given the same
        image (refused otherwise); the features the prefix holds are not queued again."""
        if not self.vision:
            raise SessionError(f"{self.artifact_dir} has no vision encoder: build with vision=smolvlm_tiny (or another)")
        seq = self.sequence(seq_id)
        queued = self.images.pending(seq_id, self.vision["out_dim"])
        n = self.vision["n_image_tokens"]
        key = image_key(image)
        held = self.images.held(seq_id, key, n)  # this image's features the adopted prefix holds already
        end = seq.length + len(queued) + n - held
        if self.max_length is not None and end > self.max_length:
            raise SessionError(f"sequence {seq_id!r}: the image's {n} tokens would take it to {end} tokens, past the "
                               f"context of {self.max_length}; release it or build with a larger kv.capacity")
        px = pixels(self.image_processor, image, self.vision["image_size"], seq_id)
        try:
            features = self.method(VISION_ENCODER).execute([encoder_input(self.vision, px).to(getattr(torch, self.vision["dtype"]))])[0][0]
        except Exception as err:
            raise SessionError(f"the program failed encoding the image of sequence {seq_id!r} ({err})") from err
        self.images.add(seq_id, key, features, held)
        return features.clone()

    def sequence(self, seq_id) -> SeqState:
        """A live sequence's state in the target; an unknown id is refused naming the live ones."""
        try:
            return self.seqs[seq_id]
        except (KeyError, TypeError):
            raise SessionError(f"unknown sequence {seq_id!r}; live: {sorted(map(str, self.seqs))}") from None

    # --- steps ---

    def step(self, feeds: dict[object, list[int]], every_row: bool = False) -> dict[object, torch.Tensor]:
        """Append ``feeds[seq]`` tokens to each sequence; return each one's next-token logits
        (``every_row``: the logits after each of its tokens, ``[tokens, vocab]``; the program gives at
        most ``max_seqs`` rows a step: teacher-forced scoring, ``validation/quality.py``).

        Transactional: everything is checked before anything changes, and the session's state
        (lengths, columns, cells) is committed only after the program ran. A refused or failed
        step leaves the session as it was; the KV rows a failed step wrote are past every
        sequence's length (or in cells nobody owns) and are never read."""
        if not isinstance(feeds, dict) or not feeds:
            raise SessionError("a step needs a dict of at least one sequence id -> tokens")
        order = [(seq_id, self.sequence(seq_id), self.check_tokens(seq_id, toks)) for seq_id, toks in feeds.items()]
        n_tokens = sum(len(toks) for *_, toks in order)
        decode = all(len(toks) == 1 for *_, toks in order)
        if not decode and n_tokens > self.max_step_tokens:
            raise SessionError(f"a step of {n_tokens} tokens exceeds the artifact's max_step_tokens={self.max_step_tokens} "
                               "(a decode step, one token per sequence, may take up to max_seqs)")
        for seq_id, seq, toks in order:
            end = seq.length + len(toks)
            limit = self.kv_layout.session_length_limit  # None: unbounded, or the cell pool bounds it
            if limit is not None and end > limit:
                raise SessionError(f"sequence {seq_id!r} would reach {end} tokens, past the flat layers' capacity of "
                                   f"{self.max_length}; release it or build with a larger kv.capacity")
        if every_row and n_tokens > self.max_seqs:
            raise SessionError(f"a step returning every row's logits takes at most max_seqs={self.max_seqs} tokens "
                               f"(the program's logit rows), got {n_tokens}")
        cells = self.pool.choose(n_tokens)  # the cells the step will write (cell layout): chosen, not taken
        ends = list(_cumulative_last([len(toks) for *_, toks in order]))  # each sequence's last row
        logits, features = self.run_target(order, list(range(n_tokens)) if every_row else ends, cells)
        self.models[TARGET].commit([(seq, len(toks)) for _, seq, toks in order], cells)
        for seq_id, _, toks in order:
            self.committed(seq_id, toks)
        if self.speculation:
            self.speculation.keep_features([(seq_id, len(toks), len(toks)) for seq_id, _, toks in order], features)
        if every_row:  # each sequence's tokens are consecutive rows
            return {seq_id: logits[end + 1 - len(toks): end + 1].clone() for (seq_id, _, toks), end in zip(order, ends, strict=True)}
        return {seq_id: logits[i].clone() for i, (seq_id, *_) in enumerate(order)}

    def run_target(self, order: list[tuple[object, SeqState, list[int]]], logit_rows: list[int],
                   cells: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embed_text (the sequences' image features spliced in), then the target's step over ``order``
        ((seq_id, state, tokens) from each sequence's length on, writing ``cells``): the logits of
        ``logit_rows`` and, with a draft, every token's tapped features. Nothing is committed."""
        step_buffers = self.models[TARGET].step_buffers([(seq, len(toks)) for _, seq, toks in order], cells)
        token_t = torch.tensor([t for *_, toks in order for t in toks], dtype=torch.int64)
        pos_t = torch.tensor([p for _, seq, toks in order for p in range(seq.length, seq.length + len(toks))],
                             dtype=torch.int64)
        try:
            embeddings, images_left = self.images.spliced(order, self.method(EMBED).execute([token_t])[0])
            self.models[TARGET].writing([(seq, len(toks)) for _, seq, toks in order], cells)
            out = self.method(TARGET_STEP).execute([embeddings, pos_t, torch.tensor(logit_rows, dtype=torch.int64),
                                                    *step_buffers])
        except Exception as err:
            ids = ", ".join(repr(seq_id) for seq_id, *_ in order)
            raise SessionError(f"the program failed on the step of sequences {ids} ({err}); "
                               "the session is unchanged") from err
        self.images.commit(images_left)
        return out[0], (out[1] if self.speculation else None)

    def check_tokens(self, seq_id, toks) -> list[int]:
        """The tokens as Python ints in [0, vocab); anything else is refused, naming the sequence."""
        return token_ids(seq_id, toks, self.vocab_size)

    def speculate(self, feeds: dict[object, int], propose=None, policies: dict | None = None) -> dict[object, Round]:
        """One speculative round for each sequence of ``feeds`` (``Speculation.round``); ``policies``:
        sequence id -> its token policy (``runtime.sampling``; default greedy)."""
        if not self.speculation:
            raise SessionError(f"{self.artifact_dir} has no draft: build with draft=dflash to speculate")
        return self.speculation.round(self, feeds, propose, policies)

    # --- text (artifacts built from a checkpoint carry its tokenizer) ---

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if not self.manifest.get("tokenizer"):
                raise SessionError(f"{self.artifact_dir} has no tokenizer: it was built without model.checkpoint; "
                                   "feed token ids instead of text")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.artifact_dir / self.manifest["tokenizer"]))
        return self._tokenizer

    def generate(self, prompts: dict[object, str], max_new_tokens: int = 32, stop_at_eos: bool = True,
                 speculative: bool | None = None) -> dict[object, str]:
        """Greedy continuations of text prompts, all sequences at once, on the server's schedule
        (``runtime/schedule.py``): prompts prefill in chunks sharing steps with the decodes of those
        already past theirs, every decoding sequence takes a token each step or, with ``speculative``
        (default: when the artifact has a draft), a speculative round; the text is the same. The
        sequences are added and released here."""
        from pipeline.runtime.generate import generate

        return generate(self, prompts, max_new_tokens, stop_at_eos, speculative)

@dataclass
class _Runner:
    execute: object  # callable(list) -> list, like an ExecuTorch method


def _cumulative_last(counts: list[int]):
    total = 0
    for n in counts:
        total += n
        yield total - 1
