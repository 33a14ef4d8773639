"""The checkpoint's tokenizer, through transformers (never a hand-written BPE): a Hugging Face
directory's tokenizer files, or the vocabulary and merges in a GGUF file's metadata. A build with
a checkpoint saves it beside the program (``tokenizer/``), so that a session needs no checkpoint."""

from pathlib import Path

TOKENIZER_DIR = "tokenizer"


def load_tokenizer(checkpoint: str):
    from transformers import AutoTokenizer

    path = Path(checkpoint)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _has_tokenizer(path: Path) -> bool:
    if path.is_dir():
        return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    import gguf

    return "tokenizer.ggml.model" in gguf.GGUFReader(str(path)).fields


def save_tokenizer(checkpoint: str, workdir: Path) -> Path | None:
    """``workdir/tokenizer/`` from the checkpoint; None when it has no tokenizer (a bare weights dir, a
    GGUF without tokenizer metadata)."""
    path = Path(checkpoint)
    if not _has_tokenizer(path):
        return None
    out = workdir / TOKENIZER_DIR
    load_tokenizer(checkpoint).save_pretrained(str(out))
    return out
