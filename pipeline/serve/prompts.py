"""Requests into token ids: a completion's prompt through the artifact's tokenizer, a chat through its
chat template (``transformers``' ``apply_chat_template``), with each image part replaced by the
artifact's placeholder tokens (``image_token_id``, once per image token) and decoded from its
base64 ``data:`` URL."""

import base64
import binascii
import io
import threading

from pipeline.serve.protocol import APIError, ChatRequest, CompletionRequest, ImagePart

_IMAGE = "\x00image\x00"  # where an image goes in the rendered template; split out before tokenizing


class Prompts:
    """Tokenization for the HTTP side (its own tokenizer, behind a lock: a fast tokenizer is not
    meant to be shared between threads); ``vision``: the artifact's vision section, or None."""

    def __init__(self, tokenizer, vision: dict | None, vocab_size: int):
        self.tokenizer = tokenizer
        self.vision = vision
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def completion(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            if bad := [t for t in prompt if not 0 <= t < self.vocab_size]:
                raise APIError(400, f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
            return list(prompt)
        text = prompt[0] if isinstance(prompt, list) and prompt else prompt
        if not text:
            raise APIError(400, "the prompt is empty", param="prompt")
        with self._lock:
            return self.tokenizer(text).input_ids

    def chat(self, request: ChatRequest) -> tuple[list[int], list]:
        """The templated conversation's token ids, and its images in order."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this artifact's tokenizer has no chat template: use /v1/completions, or build from a "
                                "chat model's checkpoint", param="messages")
        messages, images = [], []
        for i, message in enumerate(request.messages):
            if isinstance(message.content, str):
                content = message.content
            else:
                pieces = []
                for part in message.content:
                    if isinstance(part, ImagePart):
                        images.append(self.image(part.image_url.url, f"messages[{i}].content"))
                        pieces.append(_IMAGE)
                    else:
                        pieces.append(part.text)
                content = "".join(pieces)
            messages.append({"role": message.role, "content": content})
        if not any(m["content"] for m in messages):
            raise APIError(400, "the messages are empty", param="messages")
        with self._lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            pieces = [self.tokenizer(piece, add_special_tokens=False).input_ids for piece in text.split(_IMAGE)]
        ids = list(pieces[0])
        if images:
            placeholder, n = self.vision["image_token_id"], self.vision["n_image_tokens"]
            if any(placeholder in piece for piece in pieces):
                raise APIError(400, f"the conversation's text contains token {placeholder}, the artifact's image "
                                    "placeholder (vision.image_token_id); build with an image_token_id the tokenizer's "
                                    "text never produces", param="messages")
            for piece in pieces[1:]:
                ids += [placeholder] * n + piece
        return ids, images

    def image(self, url: str, where: str):
        """A ``data:image/...;base64,`` URL as an RGB PIL image, no larger than the artifact's image size
        (a larger one is scaled down to fit, keeping its aspect; the artifact's processor then takes it)."""
        if self.vision is None:
            raise APIError(400, "this artifact has no vision encoder: it takes text only (build with vision=... for images)",
                           param=where)
        if not url.startswith("data:"):
            raise APIError(400, "remote image URLs are not fetched (the server has no network); send the image as a "
                                "base64 data: URL", param=where)
        header, _, payload = url.partition(",")
        if not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise APIError(400, f"an image URL must be data:image/<type>;base64,<data>; got {header[:40]!r}", param=where)
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
            image.load()
        except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as err:
            raise APIError(400, f"the image could not be decoded ({err})", param=where) from None
        image = image.convert("RGB")
        size = self.vision["image_size"]
        if image.width > size or image.height > size:
            image.thumbnail((size, size))
        return image
