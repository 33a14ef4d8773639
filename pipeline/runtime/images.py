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


class SequenceImages:
    """Each live sequence's images (an artifact with a vision encoder): the features not yet spliced
    over its placeholder tokens (``queued``), the keys of the images it was given, in order (the prefix
    cache's key, ``image_key``), and for a sequence that adopted a prefix the images that prefix
    holds, which ``add_image`` must be given first, and how many of their features it holds already."""

    def __init__(self, placeholder: int | None):
        self.placeholder = placeholder
        self.queued: dict[object, torch.Tensor] = {}
        self.keys: dict[object, list[str]] = {}
        self.adopted: dict[object, tuple[list[str], int]] = {}

    def __contains__(self, seq_id) -> bool:
        """Whether ``seq_id`` has features whose placeholder tokens were not fed yet."""
        return seq_id in self.queued

    def __getitem__(self, seq_id) -> torch.Tensor:
        return self.queued[seq_id]

    def start(self, seq_id, adopted: list[str] | None = None, held: int = 0) -> None:
        """A new sequence; ``adopted``: the keys of the images of the prefix it adopted, whose first
        ``held`` features (placeholders) that prefix holds."""
        self.keys[seq_id] = []
        if adopted:
            self.adopted[seq_id] = (list(adopted), held)

    def end(self, seq_id) -> list[str]:
        """Forget a released sequence; returns its images' keys."""
        self.queued.pop(seq_id, None)
        self.adopted.pop(seq_id, None)
        return self.keys.pop(seq_id)

    def held(self, seq_id, key: str, n_image_tokens: int) -> int:
        """How many of the features of the image ``key`` that ``seq_id`` is given next its adopted prefix
        holds already; refused if that prefix holds another image's placeholders."""
        expected, skip = self.adopted.get(seq_id, ([], 0))
        if expected and key != expected[0]:
            raise SessionError(f"sequence {seq_id!r} adopted a prefix holding the placeholders of another image than "
                               f"this one (image {len(self.keys[seq_id])}); pass add() the images the sequence adds")
        return min(skip, n_image_tokens)

    def pending(self, seq_id, width: int) -> torch.Tensor:
        """The features queued for ``seq_id`` (none: an empty [0, width])."""
        return self.queued.get(seq_id, torch.zeros(0, width))

    def add(self, seq_id, key: str, features: torch.Tensor, held: int) -> None:
        """The image ``key``'s features for ``seq_id``, its first ``held`` ones left out (the adopted
        prefix holds them)."""
        queued = self.queued.get(seq_id)
        if queued is not None or held < len(features):  # (features the prefix holds entirely are not queued at all)
            rest = features[held:].float()
            self.queued[seq_id] = rest if queued is None else torch.cat([queued, rest])
        self.keys[seq_id].append(key)
        expected, skip = self.adopted.get(seq_id, ([], 0))
        if expected:
            self.adopted[seq_id] = (expected[1:], skip - held)

    def spliced(self, order, embeddings: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Queued features over the step's placeholder tokens (``order``: (seq_id, state, tokens) in
        the step's rows), in order, while a sequence has some; and the features left once the step ran
        (``commit``)."""
        left = dict(self.queued)
        if not any(seq_id in left for seq_id, *_ in order):
            return embeddings, left
        embeddings, row = embeddings.clone(), 0
        for seq_id, _, toks in order:
            if (queued := left.get(seq_id)) is not None:
                used = splice(embeddings, toks, self.placeholder, queued, row)
                if used == len(queued):
                    del left[seq_id]
                else:
                    left[seq_id] = queued[used:]
            row += len(toks)
        return embeddings, left

    def commit(self, left: dict) -> None:
        """The step ran: what it did not splice stays queued."""
        self.queued = left
