"""MXFP4, the 4-bit format the released GPT-OSS checkpoints (openai/gpt-oss-20b, -120b) store their
MoE expert weights in, read back to float32 as transformers dequantizes it.

A quantized tensor `X` of logical shape [..., rows, cols] is stored as two uint8 tensors:

* `X_blocks` [..., rows, cols/32, 16]: FP4 (E2M1) codes, two to a byte, 32 values (one block) in
  16 bytes. The low nibble of a byte is the earlier value of the two (column 2j), the high nibble
  the later (column 2j+1). A code is 1 sign bit and 3 magnitude bits, read through `E2M1`:
  0-7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8-15 the same negated (8 is -0.0).
* `X_scales` [..., rows, cols/32]: one E8M0 exponent per block; a block's values are multiplied
  by 2**(s - 127).

So `dequantize` gives [..., rows, cols]: for the expert weights, [experts, out, in], a torch
Linear's orientation. transformers' GptOssExperts holds the parameter the other way round
(gate_up_proj [experts, hidden, 2 * intermediate], down_proj [experts, intermediate, hidden]: its
forward is `x @ W`), and its loader (`convert_moe_packed_tensors`, transformers/integrations/
mxfp4.py) swaps the last two axes before assigning the parameter; `as_parameter` does the same.

Scales follow transformers (`torch.ldexp`, here `np.ldexp`, in float32) to the bit, edge cases
included: s = 0 gives subnormals, and s = 255, which the OCP MX spec calls NaN, scales by 2**128:
inf for |value| >= 1, 2**127 for 0.5, 0 for 0. Every value has at most two significant bits,
which bfloat16 holds at every exponent float32 does, so the float32 result here equals
transformers' whether it dequantizes to float32 or to bfloat16. The released checkpoints' scales
lie near 127.
"""
from __future__ import annotations

import numpy as np

VALUES_PER_BLOCK = 32  # one E8M0 scale per 32 FP4 values ...
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2  # ... packed two to a byte
SCALE_BIAS = 127  # E8M0: a scale byte s means 2**(s - 127)

# E2M1 code -> value (transformers' FP4_VALUES): sign bit 8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

# byte -> its two values, low nibble first: one gather unpacks a whole tensor, with no index
# arrays the size of the tensor (a gpt-oss-120b layer's gate_up_proj is 8.5 GB in float32).
_BYTE_PAIRS = np.stack([E2M1[np.arange(256) & 0x0F], E2M1[np.arange(256) >> 4]], axis=-1)


def check_shapes(blocks: np.ndarray, scales: np.ndarray) -> None:
    """ValueError unless `blocks` [..., G, 16] and `scales` [..., G] are uint8 and agree."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 blocks are [..., blocks, {BYTES_PER_BLOCK}] bytes, got shape {list(blocks.shape)}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {list(blocks.shape)} need scales of shape "
                         f"{list(blocks.shape[:-1])}, got {list(scales.shape)}")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., rows, G, 16] and scales [..., rows, G] (uint8) -> float32 [..., rows, G * 32],
    the values in stored order (transformers' result before its transpose)."""
    check_shapes(blocks, scales)
    values = _BYTE_PAIRS[blocks].reshape(*scales.shape, VALUES_PER_BLOCK)  # [..., G, 32]
    with np.errstate(over="ignore"):  # s = 255: inf, as in transformers
        np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS, out=values)
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * VALUES_PER_BLOCK)


def as_parameter(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The tensor transformers' unquantized model holds: `dequantize`'s last two axes swapped
    (gate_up_proj [E, hidden, 2 * intermediate], down_proj [E, intermediate, hidden]). A view,
    not a copy: these are the largest tensors an import reads."""
    return dequantize(blocks, scales).swapaxes(-1, -2)
