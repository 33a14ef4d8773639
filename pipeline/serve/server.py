"""The server assembled from an artifact directory: the engine in its own process, and the app."""

import json
import re
from pathlib import Path

from pipeline.errors import SessionError

# a GGUF file name's quantization part (llama.cpp's names: "SmolLM2-135M-Instruct.Q4_1", "Llama-3.2-1B-Q4_K_M",
# "model-f16"): not part of the model's name
_GGUF_ENCODING = re.compile(r"[.-](?:I?Q\d\w*|[BF]F?16|F32)$", re.IGNORECASE)


def model_name(artifact: Path) -> str:
    """The id clients name, as a user knows the model: the checkpoint's name (a GGUF file's name less its
    quantization; a Hugging Face directory's, or its repository's in a hub cache), else the experiment's
    name (random weights: the model is the build), else ``<experiment>/<version>`` from the path.

    Not a GGUF's ``general.name``: SmolLM2-135M-Instruct's says "Smollm2 135M 8k Lc100K Mix1 Ep2"."""
    import yaml

    config = artifact / ".hydra" / "config.yaml"
    cfg = yaml.safe_load(config.read_text()) if config.is_file() else {}
    checkpoint = ((cfg or {}).get("model") or {}).get("checkpoint")
    if checkpoint:
        path = Path(checkpoint)
        if path.suffix.lower() == ".gguf":
            return _GGUF_ENCODING.sub("", path.stem) or path.stem
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
            return path.parent.parent.name.rsplit("--", 1)[-1]  # models--HuggingFaceTB--SmolLM2-135M-Instruct
        return path.name
    record = artifact / "build.json"
    experiment = json.loads(record.read_text()).get("experiment") if record.is_file() else None
    experiment = experiment or (cfg or {}).get("experiment_name")
    if experiment:
        return str(experiment)
    return f"{artifact.resolve().parent.name}/{artifact.resolve().name}"


def build(artifact: Path, model: str | None = None, api_key: str | None = None, max_queue: int = 64,
          request_timeout: float | None = None, prefill_chunk: int | None = None, engine_restarts: int = 0,
          prefix_cache: bool = True):
    """(app, engine) over ``artifact``; the engine process is loaded, its reader not started. The
    artifact must carry a tokenizer (checked before the engine process starts). The model's id is
    ``model``, or ``model_name(artifact)``. ``prefix_cache``: the engine's session keeps released
    sequences' rows for prompts that start alike (``--no-prefix-cache``: False)."""
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
    engine = EngineProcess(artifact, max_queue, prefill_chunk, restarts=engine_restarts, prefix_cache=prefix_cache)
    name = model or model_name(artifact)
    vocab_size = sections(manifest)[TARGET]["vocab_size"]
    app = create_app(engine, Prompts(tokenizer, manifest.get(VISION), vocab_size), Settings(name, api_key, request_timeout))
    app.state.model_name = name
    app.state.engine = engine
    return app, engine
