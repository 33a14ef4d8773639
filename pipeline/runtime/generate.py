"""``Session.generate``: greedy continuations of text prompts, all sequences at once, on the server's
schedule (``runtime/schedule.py``)."""

from pipeline.errors import SessionError
from pipeline.runtime import schedule


def generate(session, prompts: dict[object, str], max_new_tokens: int = 32, stop_at_eos: bool = True,
             speculative: bool | None = None) -> dict[object, str]:
    """``Session.generate``'s work (its docstring says what it does), over ``session``."""
    speculative = bool(session.speculation) if speculative is None else speculative
    if speculative and not session.speculation:
        raise SessionError(f"{session.artifact_dir} has no draft: build with draft=dflash to generate speculatively")
    for seq_id, text in prompts.items():
        if not isinstance(text, str) or not text:
            raise SessionError(f"sequence {seq_id!r}: a prompt must be a non-empty str, got {text!r}")
    if live := [repr(s) for s in prompts if s in session.seqs]:
        raise SessionError(f"sequences {', '.join(live)} are already live; generate adds its own")
    free = session.max_seqs - len(session.seqs)
    if len(prompts) > free:
        raise SessionError(f"{len(prompts)} prompts, but only {free} of the artifact's "
                           f"max_seqs={session.max_seqs} columns are free")
    eos = session.tokenizer.eos_token_id if stop_at_eos else None
    slots = [schedule.Slot(seq_id, session.tokenizer(text).input_ids) for seq_id, text in prompts.items()]
    budget = schedule.Budget(session.max_step_tokens, free, speculative=speculative,  # all fit: all join at once
                             prefix_cache=session.prefix_cache is not None)
    by_id = {slot.id: slot for slot in slots}
    out: dict[object, list[int]] = {seq_id: [] for seq_id in prompts}

    def give(seq_id, tokens: list[int]) -> None:  # keep them up to the end; a slot that ended is done
        by_id[seq_id].next_token = tokens[-1]
        for token in tokens:
            if len(out[seq_id]) < max_new_tokens:
                out[seq_id].append(token)
            if len(out[seq_id]) >= max_new_tokens or token == eos:
                by_id[seq_id].finish()
                return

    try:
        while slots:
            plan = schedule.plan(slots, budget)
            for slot in plan.released:
                session.release(slot.id)
                slots.remove(slot)
            for slot in plan.admitted:
                plan.admit(slot, session.add(slot.id, plan.prefixes.get(slot.id, ())))
            if plan.feeds:
                logits = session.step(plan.feeds)
                for seq_id, toks in plan.feeds.items():
                    if by_id[seq_id].took(len(toks)):
                        give(seq_id, [int(logits[seq_id].argmax())])
            if plan.speculate:
                for seq_id, result in session.speculate(plan.speculate).items():
                    give(seq_id, result.tokens)
    finally:
        for seq_id in prompts:
            if seq_id in session.seqs:
                session.release(seq_id)
    return {seq_id: session.tokenizer.decode(ids, skip_special_tokens=True) for seq_id, ids in out.items()}
