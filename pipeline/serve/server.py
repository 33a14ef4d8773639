"""The server assembled from an artifact directory: its session, its engine and the app."""

from pathlib import Path

from pipeline.errors import SessionError


def build(artifact: Path, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
          request_timeout: float | None = None):
    """(app, engine) over ``artifact``; the engine is not started. The artifact must carry a tokenizer."""
    from transformers import AutoTokenizer

    from pipeline.build.roles import EMBED, TARGET_STEP
    from pipeline.runtime.session import Session
    from pipeline.serve.app import Settings, create_app
    from pipeline.serve.engine import Engine
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.prompts import Prompts

    session = Session(artifact)
    if not session.manifest.get("tokenizer"):
        raise SessionError(f"{artifact} has no tokenizer, and the server takes text: build from a checkpoint "
                           "(model.checkpoint=..., model=smollm2_135m) or with model.tokenizer=... (model=tiny_chat)")
    for method in (EMBED, TARGET_STEP):  # loaded before the first request, not during it
        session.method(method)
    tokenizer = AutoTokenizer.from_pretrained(str(artifact / session.manifest["tokenizer"]))
    engine = Engine(session, Metrics(), max_queue=max_queue)
    name = model_name or f"{artifact.resolve().parent.name}/{artifact.resolve().name}"
    app = create_app(engine, Prompts(tokenizer, session.vision, session.vocab_size),
                     Settings(name, api_key, request_timeout))
    app.state.model_name = name
    app.state.engine = engine
    return app, engine
