"""GGUF block formats that ``quant=from_checkpoint`` keeps (torch-free: the config check reads them)."""

BLOCK = 32  # llama.cpp's block of Q4_0 / Q4_1 / Q8_0: 32 columns of one row
KEPT = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF types quant=from_checkpoint keeps (gguf.py)
FLOAT = ("F32", "F16", "BF16")


def weights_2d(reader) -> list:
    """A GGUF's matrices (the tensors a quantization concerns; norms are vectors)."""
    return [t for t in reader.tensors if len(t.shape) == 2]
