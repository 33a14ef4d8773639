"""The server assembled from an artifact directory: the engine in its own process, and the app."""

from pathlib import Path

from pipeline.errors import SessionError


def build(artifact: Path, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
          request_timeout: float | None = None, prefill_chunk: int | None = None):
    """(app, engine) over ``artifact``; the engine process is loaded, its reader not started. The
    artifact must carry a tokenizer (checked before the engine process starts)."""
    from transformers import AutoTokenizer

    from pipeline.build.manifest import read, sections
    from pipeline.build.roles import TARGET, VISION
    from pipeline.serve.app import Settings, create_app
    from pipeline.serve.prompts import Prompts
    from pipeline.serve.worker import EngineProcess

    manifest = read(artifact)
    if not manifest.get("tokenizer"):
        raise SessionError(f"{artifact} has no tokenizer, and the server takes text: build from a checkpoint "
                           "(model.checkpoint=..., model=smollm2_135m) or with model.tokenizer=... (model=tiny_chat)")
    tokenizer = AutoTokenizer.from_pretrained(str(artifact / manifest["tokenizer"]))
    engine = EngineProcess(artifact, max_queue, prefill_chunk)
    name = model_name or f"{artifact.resolve().parent.name}/{artifact.resolve().name}"
    vocab_size = sections(manifest)[TARGET]["vocab_size"]
    app = create_app(engine, Prompts(tokenizer, manifest.get(VISION), vocab_size), Settings(name, api_key, request_timeout))
    app.state.model_name = name
    app.state.engine = engine
    return app, engine
