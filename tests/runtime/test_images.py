"""An artifact with a vision encoder: a prompt with an image through the .pte equals transformers'
SmolVLM on the same pixels, the full draft + vision artifact holds every method, and images the
artifact cannot take are refused."""

import json

import numpy as np
import pytest
import torch

from conftest import DRAFT_VISION, compose_config
from pipeline.models.methods import build_target, build_vision_model
from pipeline.runtime.session import Session, SessionError

VISION_FLAT = ("model=tiny_flat", "vision=smolvlm_tiny", "kv.max_seqs=2", "backend=portable", "experiment_name=vision2")
FULL = DRAFT_VISION
GLIMMER = ("model=muse_glimmer_tiny", "draft=dflash_muse_glimmer_tiny", "vision=muse_glimmer_tiny", "kv=sequence",
           "kv.max_seqs=4", "backend=portable", "experiment_name=glimmer_full4")


@pytest.fixture(scope="module")
def flat(build_dir):
    return build_dir(*VISION_FLAT)


def smolvlm_with_our_weights(cfg):
    """transformers' SmolVLM (Llama text model) holding our target's and encoder's weights."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    from pipeline.models.loaders.hf import our_name

    target, _ = build_target(cfg.model, None)
    vision = build_vision_model(cfg.vision, cfg.model)
    m, v = cfg.model, cfg.vision
    config = SmolVLMConfig(
        vision_config=dict(hidden_size=v.dim, intermediate_size=v.hidden_dim, num_hidden_layers=v.n_layers,
                           num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                           layer_norm_eps=v.norm_eps),
        text_config=dict(model_type="llama", hidden_size=m.dim, intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layers,
                         num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, vocab_size=m.vocab_size,
                         rms_norm_eps=m.norm_eps, rope_theta=m.rope_base, tie_word_embeddings=False, max_position_embeddings=256),
        scale_factor=v.scale_factor, image_token_id=v.image_token_id, tie_word_embeddings=False)
    ref = SmolVLMForConditionalGeneration(config).eval()
    ours_target, ours_vision = target.state_dict(), vision.state_dict()
    vision_names = {"embeddings.patch_embedding": "patch_embedding", "embeddings.position_embedding": "position_embedding",
                    "post_layernorm": "post_layernorm", "encoder.layers.": "layers.", "mlp.": "", "self_attn.": "attention."}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith("model.text_model.") or name == "lm_head.weight":
                p.copy_(ours_target[our_name(name.replace("model.text_model.", "model."))])
            elif name.startswith("model.vision_model."):
                ours = name.removeprefix("model.vision_model.")
                for theirs, mine in vision_names.items():
                    ours = ours.replace(theirs, mine)
                p.copy_(ours_vision[ours])
            else:
                assert name == "model.connector.modality_projection.proj.weight", name
                p.copy_(ours_vision["projection.weight"])
    return ref


def test_a_prompt_with_an_image_equals_smolvlm(flat):
    cfg = compose_config(*VISION_FLAT)
    ref = smolvlm_with_our_weights(cfg)
    image = np.random.default_rng(4).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    prompt = [5, 2, 2, 2, 2, 17, 300, 42, 9]  # 2: the image placeholder, once per image token (4)
    s = Session(flat)
    s.add("a")
    features = s.add_image("a", image)
    pixels = s.image_processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        want_features = ref.model.get_image_features(pixels["pixel_values"], pixels["pixel_attention_mask"])
        want_features = getattr(want_features, "pooler_output", want_features)
        if isinstance(want_features, (list, tuple)):  # one tensor per image
            want_features = torch.cat(list(want_features))
    assert float((features - want_features.reshape(features.shape)).abs().max()) < 1e-5
    got = [s.step({"a": prompt})["a"]]
    ids = list(prompt)
    for _ in range(4):  # greedy, the image staying in the prompt
        ids.append(int(got[-1].argmax()))
        got.append(s.step({"a": [ids[-1]]})["a"])
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                   pixel_attention_mask=pixels["pixel_attention_mask"]).logits[0, len(prompt) - 1:]
    got = torch.stack(got)
    assert float((got - want).abs().max() / (want.max() - want.min())) < 1e-5
    # the comparison sees the image: without it (placeholders as text) the logits differ
    s.release("a")
    s.add("b")
    text_only = s.step({"b": prompt})["b"]
    assert float((text_only - want[0]).abs().max() / (want.max() - want.min())) > 1e-3


def test_an_image_is_part_of_the_prefix_key(flat):
    """The same tokens with another image adopt only the text before the image's placeholders; with the
    same image, the whole prefix, and add_image queues none of the features the prefix holds; each step
    equals a session without the prefix cache. Adopting the image's placeholders and then adding
    another image is refused."""
    rng = np.random.default_rng(7)
    image, other = (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(2))
    prompt = [5, 17, 2, 2, 2, 2, 300, 42, 9, 11]  # 2: the placeholder, once per image token (4)

    def run(s, seq_id, picture):
        reused = s.add(seq_id, prompt[:-1], images=[picture])
        s.add_image(seq_id, picture)
        logits = s.step({seq_id: prompt[reused:]})[seq_id]
        s.release(seq_id)
        return reused, logits

    s, fresh = Session(flat), Session(flat, prefix_cache=False)
    assert run(s, "a", image)[0] == 0
    for seq_id, picture, held in (("b", other, 2), ("c", other, 9)):  # b: another image than a's; c: b's image
        reused, got = run(s, seq_id, picture)
        _, want = run(fresh, seq_id, picture)
        assert reused == held, seq_id
        assert float((got - want).abs().max() / (want.max() - want.min())) < 1e-4, seq_id
    assert s.add("d", prompt[:-1], images=[other]) == 9
    with pytest.raises(SessionError, match="adopted a prefix holding the placeholders of another image"):
        s.add_image("d", image)


def test_validation_ran_image_sequences(flat):
    report = json.loads((flat / "validation.json").read_text())
    assert report["passed"] and report["images"]["sequences"] == ["seq1"]
    assert report["images"]["vision_max_relative_error"] < 1e-5


def test_full_artifact_holds_every_method(build_dir):
    """draft=dflash vision=smolvlm_tiny kv=sequence kv.max_seqs=4, XNNPACK: one model.pte."""
    version = build_dir(*FULL)
    manifest = json.loads((version / "manifest.json").read_text())
    assert set(manifest["methods"]) == {"embed_text", "target_forward_from_embeddings", "draft_forward", "vision_encoder"}
    assert (manifest["target"]["layout"], manifest["target"]["causal"], manifest["target"]["max_seqs"]) == ("batched-sequence", True, 4)
    assert (manifest["draft"]["layout"], manifest["draft"]["causal"], manifest["draft"]["max_seqs"]) == ("batched-sequence", False, 4)
    assert manifest["vision"]["n_image_tokens"] == 4 and manifest["vision"]["out_dim"] == 64
    s = Session(version)  # every constant method checked against the manifest
    assert s.constant("has_vision_encoder") == 1 and s.constant("get_max_image_tokens") == 4
    assert s.constant("get_image_size") == 32 and s.constant("get_vision_hidden_size") == 64
    report = json.loads((version / "validation.json").read_text())
    assert report["passed"] and report["speculative"]["equals_greedy"] and report["images"]["sequences"] == ["seq1", "seq3"]


def test_muse_glimmer_artifact_holds_every_method(build_dir):
    """The same artifact for the Muse Glimmer family: its target, its draft (blocks of 16) and its tower."""
    version = build_dir(*GLIMMER)
    manifest = json.loads((version / "manifest.json").read_text())
    assert set(manifest["methods"]) == {"embed_text", "target_forward_from_embeddings", "draft_forward", "vision_encoder"}
    assert (manifest["target"]["causal"], manifest["draft"]["causal"], manifest["draft"]["block_size"]) == (True, False, 16)
    assert manifest["target"]["layout"] == manifest["draft"]["layout"] == "batched-sequence"
    assert manifest["vision"]["family"] == "muse_glimmer" and manifest["vision"]["n_image_tokens"] == 4
    s = Session(version)
    assert s.constant("get_block_size") == 16 and s.constant("get_draft_offgraph_kv_max_seqs") == 4
    report = json.loads((version / "validation.json").read_text())
    assert report["passed"] and report["speculative"]["equals_greedy"] and report["speculative"]["proposal_mismatches"] == 0
    assert report["images"]["vision_max_relative_error"] < 1e-5


def test_images_the_artifact_cannot_take(flat, build_dir):
    s = Session(flat)
    s.add("a")
    with pytest.raises(SessionError, match="the image is 64x48 pixels, larger than the artifact's exported image size 32x32"):
        s.add_image("a", np.zeros((48, 64, 3), dtype=np.uint8))
    for _ in range(7):
        s.step({"a": [5] * 16})
    s.step({"a": [5] * 14})
    with pytest.raises(SessionError, match="the image's 4 tokens would take it to 130 tokens, past the context of 128"):
        s.add_image("a", np.zeros((32, 32, 3), dtype=np.uint8))
    from conftest import BATCHED

    with pytest.raises(SessionError, match="has no vision encoder"):
        Session(build_dir(*BATCHED)).add_image("x", np.zeros((32, 32, 3), dtype=np.uint8))


def test_a_failed_step_keeps_the_image(flat):
    """Transactional: a refused step does not consume the image's features."""
    s = Session(flat)
    s.add("a")
    s.add_image("a", np.zeros((32, 32, 3), dtype=np.uint8))
    with pytest.raises(SessionError):
        s.step({"a": [2] * 4, "nope": [1]})
    assert len(s.images["a"]) == 4
    s.step({"a": [2] * 4})
    assert "a" not in s.images
