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


def vocabulary_size(path: str) -> int:
    """How many tokens the tokenizer of ``path`` (a Hugging Face directory or a GGUF file) has: what a
    model that uses it must output. A GGUF's is read from its metadata (no transformers import)."""
    from pipeline.errors import ConfigError

    source = Path(path)
    if not source.exists():
        raise ConfigError(f"model.tokenizer={path} does not exist (a Hugging Face directory or a .gguf file)")
    if not _has_tokenizer(source):
        raise ConfigError(f"model.tokenizer={path} has no tokenizer (no tokenizer.json / tokenizer_config.json, "
                          "or no tokenizer.ggml.* metadata)")
    if source.is_dir():
        return len(load_tokenizer(path))
    from pipeline.models.loaders.gguf import token_count

    return token_count(source)


def save_tokenizer(checkpoint: str, workdir: Path, setting: str = "model.checkpoint") -> Path | None:
    """``workdir/tokenizer/`` from the checkpoint (or the ``model.tokenizer`` source); None when it has no
    tokenizer (a bare weights dir, a GGUF without tokenizer metadata)."""
    path = Path(checkpoint)
    if not _has_tokenizer(path):
        return None
    out = workdir / TOKENIZER_DIR
    try:
        tokenizer = load_tokenizer(checkpoint)
    except Exception as err:  # transformers' converters fail on incomplete metadata with any error (KeyError: 'scores')
        from pipeline.errors import BuildError

        raise BuildError(f"{setting}={checkpoint}: its tokenizer cannot be read by transformers ({type(err).__name__}: {err}); "
                         "a GGUF needs llama.cpp's complete tokenizer.ggml.* metadata") from None
    tokenizer.save_pretrained(str(out))
    return out
