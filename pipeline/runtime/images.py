"""Images for an artifact's vision encoder: SmolVLM's image processor (transformers', its PIL
backend: no torchvision), set to the exported image size (resize, scale to [-1, 1]: what both vision
families take), the refusal of images it would shrink, and each family's encoder input."""

import numpy as np
import torch

from pipeline.errors import SessionError


def image_processor(image_size: int):
    """SmolVLM's processor for one ``image_size`` square per image (no splitting into tiles): resize,
    rescale to [0, 1], normalise with mean and std 0.5."""
    from transformers import SmolVLMImageProcessorPil

    edge = {"longest_edge": image_size}
    return SmolVLMImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)


def load_processor(path):
    from transformers import SmolVLMImageProcessorPil

    return SmolVLMImageProcessorPil.from_pretrained(str(path))


def pixels(processor, image, image_size: int, seq_id=None) -> torch.Tensor:
    """The encoder's input [1, 3, image_size, image_size] for ``image`` (a PIL image or an H x W x 3
    array); an image larger than the exported size is refused, naming both sizes (the artifact
    would otherwise shrink it silently)."""
    height, width = (image.height, image.width) if hasattr(image, "height") else np.asarray(image).shape[:2]
    if height > image_size or width > image_size:
        who = f"sequence {seq_id!r}: " if seq_id is not None else ""
        raise SessionError(f"{who}the image is {width}x{height} pixels, larger than the artifact's exported image size "
                           f"{image_size}x{image_size}; resize it first or build with a larger vision.image_size")
    out = processor(images=[[image]], return_tensors="pt")
    return out["pixel_values"][0].float()


def encoder_input(section: dict, px: torch.Tensor) -> torch.Tensor:
    """What the artifact's ``vision_encoder`` takes for the processed pixels ``px`` [1, 3, N, N]: the
    pixels (smolvlm), or Muse Glimmer's patches [1, P, patch_dim] (ExecuTorch's host ``patchify_image``)."""
    if section["family"] != "muse_glimmer":
        return px
    from executorch.examples.models.muse_glimmer.vision.precompute import MuseGlimmerVisionConfig, patchify_image

    config = MuseGlimmerVisionConfig(patch_size=section["patch_size"], patch_temporal=section["patch_temporal"])
    return patchify_image(px[0], config)[0]


def splice(embeddings: torch.Tensor, tokens, placeholder: int, features: torch.Tensor, offset: int = 0) -> int:
    """Write ``features`` over the embeddings [1, T, dim] of the first placeholder tokens of ``tokens``
    (rows ``offset``.. of the step), in order, as many as there are of both; returns how many it used.
    The session, the episode's oracles and the eager greedy reference all splice through this."""
    rows = [offset + i for i, t in enumerate(tokens) if t == placeholder][: len(features)]
    embeddings[0, rows] = features[: len(rows)].to(embeddings.dtype)
    return len(rows)


def image_key(image) -> str:
    """A digest of an image's pixels (its mode, shape, dtype and bytes): the prefix cache's key of an
    image, so that the same tokens with another image are not a match."""
    import hashlib

    array = np.ascontiguousarray(np.asarray(image))
    digest = hashlib.sha256(f"{getattr(image, 'mode', None)} {array.shape} {array.dtype.str}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()
