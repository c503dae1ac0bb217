"""MXFP4 expert weights (the released GPT-OSS checkpoints'): our numpy dequantization against
transformers' (`convert_moe_packed_tensors`, and its loader end to end), bit for bit, and the
importer's reader finding `X` in a checkpoint that stores `X_blocks` and `X_scales`."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from mesh_transformer.config import ConfigError
from mesh_transformer.io import hf, mxfp4

EXPERTS, HIDDEN, INTERMEDIATE = 3, 64, 96  # gate_up_proj [3, 64, 192], down_proj [3, 96, 64]
GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"


def packed(rows, cols, seed, scales=(118, 131)):
    """Random (blocks, scales) of a [EXPERTS, rows, cols] tensor; scales drawn from [lo, hi)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=np.uint8),
            rng.integers(*scales, (EXPERTS, rows, cols // 32), dtype=np.uint8))


def transformers_parameter(blocks, scales, dtype=torch.float32) -> np.ndarray:
    """What transformers' MXFP4 loader assigns to the parameter, as float32."""
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    return out.to(torch.float32).numpy()


def assert_bitwise_equal(ours, theirs):
    """Equal to the bit (-0.0 is not 0.0); NaNs where the other has NaN."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == np.float32
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan], theirs.view(np.uint32)[~nan])


def test_e2m1_table_is_transformers():
    assert_bitwise_equal(mxfp4.E2M1, np.array(FP4_VALUES, np.float32))


def test_low_nibble_first_and_power_of_two_scales():
    """By hand: byte 0x1F holds 0xF (-6) then 0x1 (0.5); scale 128 doubles, 125 quarters."""
    blocks = np.zeros((2, 1, 16), np.uint8)
    blocks[:, 0, 0] = 0x1F
    blocks[1, 0, 15] = 0x70  # the block's last byte: 0 then 6, columns 30 and 31
    values = mxfp4.dequantize(blocks, np.array([[128], [125]], np.uint8))
    assert values.shape == (2, 32) and values.dtype == np.float32
    np.testing.assert_array_equal(values[0, :2], [-12.0, 1.0])
    np.testing.assert_array_equal(values[1, [0, 1, 30, 31]], [-1.5, 0.125, 0.0, 1.5])
    assert np.count_nonzero(values) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(dtype):
    """The released checkpoints' shapes in small: several experts, rows, 32-value blocks. Every
    product is exact in bfloat16 too, so transformers' bf16 result equals ours to the bit."""
    for rows, cols, seed in ((2 * INTERMEDIATE, HIDDEN, 0), (HIDDEN, INTERMEDIATE, 1)):
        blocks, scales = packed(rows, cols, seed)
        ours = mxfp4.as_parameter(blocks, scales)
        assert ours.shape == (EXPERTS, cols, rows)
        assert_bitwise_equal(ours, transformers_parameter(blocks, scales, dtype))
        assert_bitwise_equal(mxfp4.dequantize(blocks, scales), transformers_parameter(blocks, scales).swapaxes(1, 2))
        assert np.abs(ours).max() == 6 * 2.0 ** 3 and np.count_nonzero(ours == 0) < ours.size / 4


def test_every_byte_at_every_scale_matches_transformers():
    """All 256 bytes under all 256 scales, the extremes included: s = 0 (subnormals), s = 255
    (the OCP spec's NaN scale, which transformers reads as 2**128: inf from 1 up)."""
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (1, 256, 16, 16)).copy()
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (1, 256, 16)).copy()
    ours = mxfp4.as_parameter(blocks, scales)
    assert_bitwise_equal(ours, transformers_parameter(blocks, scales))
    assert np.isinf(ours[0, :, 255]).sum() == 2 * 12 * 16 and not np.isnan(ours).any()
    assert np.abs(ours[0, 2, 255]) == 2.0 ** 127  # the low nibble of byte 1 (0.5) under s = 255
    assert ours[0, 2, 0] == 2.0 ** -128  # the low nibble of byte 1 (0.5) under s = 0: subnormal
    assert_bitwise_equal(ours, transformers_parameter(blocks, scales, torch.bfloat16))  # bf16 holds every value


# --------------------------------------------------------------------------------------------
# The importer's reader
# --------------------------------------------------------------------------------------------

def checkpoint_tensors():
    """An MXFP4 layer's expert weights plus an ordinary tensor, as a checkpoint stores them."""
    (gu_blocks, gu_scales), (dn_blocks, dn_scales) = packed(2 * INTERMEDIATE, HIDDEN, 2), packed(HIDDEN, INTERMEDIATE, 3)
    return {GATE_UP + "_blocks": gu_blocks, GATE_UP + "_scales": gu_scales,
            DOWN + "_blocks": dn_blocks, DOWN + "_scales": dn_scales,
            "model.embed_tokens.weight": np.random.default_rng(4).normal(size=(10, HIDDEN)).astype(np.float32)}


def save_sharded(path, shards: list[dict]):
    """`shards` as model-0000i.safetensors files and their model.safetensors.index.json."""
    weight_map = {}
    for i, tensors in enumerate(shards):
        save_file(tensors, path / f"model-{i:05d}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"model-{i:05d}.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_reads_as_transformers(read, tensors):
    gate_up, down = read(GATE_UP), read(DOWN)
    assert gate_up.shape == (EXPERTS, HIDDEN, 2 * INTERMEDIATE) and down.shape == (EXPERTS, INTERMEDIATE, HIDDEN)
    assert_bitwise_equal(gate_up, transformers_parameter(tensors[GATE_UP + "_blocks"], tensors[GATE_UP + "_scales"]))
    assert_bitwise_equal(down, transformers_parameter(tensors[DOWN + "_blocks"], tensors[DOWN + "_scales"]))
    np.testing.assert_array_equal(read("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"])
    with pytest.raises(KeyError):
        read("model.layers.0.mlp.experts.gate_up_proj_bias")


def test_reader_dequantizes_a_single_file(tmp_path):
    tensors = checkpoint_tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    assert_reads_as_transformers(hf._tensor_reader(tmp_path), tensors)


def test_reader_dequantizes_across_shards(tmp_path):
    """An index may put a tensor's blocks and its scales in different shards."""
    tensors = checkpoint_tensors()
    save_sharded(tmp_path, [{k: v for k, v in tensors.items() if not k.endswith("_scales")},
                            {k: v for k, v in tensors.items() if k.endswith("_scales")}])
    assert_reads_as_transformers(hf._tensor_reader(tmp_path), tensors)


def test_reader_matches_transformers_loader(tmp_path):
    """End to end: a tiny GPT-OSS checkpoint in MXFP4, loaded by transformers (dequantized, on
    CPU), holds exactly the expert parameters our reader returns, and `--hf` of it computes
    transformers' logits."""
    from tests.helpers import PARITY_TOL, parity_error
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
    config = GptOssConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, layer_types=["full_attention"],
                          quantization_config={"quant_method": "mxfp4"})
    tensors = {k: v for k, v in checkpoint_tensors().items() if k.startswith(GATE_UP) or k.startswith(DOWN)}
    others = {k: v.numpy() for k, v in GptOssForCausalLM(config).state_dict().items() if k not in (GATE_UP, DOWN)}
    save_file({**others, **tensors}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    model = GptOssForCausalLM.from_pretrained(tmp_path, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    read = hf._tensor_reader(tmp_path)
    assert_bitwise_equal(read(GATE_UP), experts.gate_up_proj.detach().numpy())
    assert_bitwise_equal(read(DOWN), experts.down_proj.detach().numpy())
    ours, params = hf.load_hf(tmp_path, compute_dtype="float32", remat="none")
    assert (ours.family, ours.n_experts) == ("gpt_oss", EXPERTS)
    assert parity_error(ours, params, model.eval()) < PARITY_TOL


def test_blocks_without_scales_is_refused_by_name(tmp_path):
    tensors = checkpoint_tensors()
    del tensors[GATE_UP + "_scales"], tensors[DOWN + "_blocks"]
    save_file(tensors, tmp_path / "model.safetensors")
    read = hf._tensor_reader(tmp_path)
    with pytest.raises(ConfigError, match=f"MXFP4 tensor '{GATE_UP}' lacks '{GATE_UP}_scales'"):
        read(GATE_UP)
    with pytest.raises(ConfigError, match=f"MXFP4 tensor '{DOWN}' lacks '{DOWN}_blocks'"):
        read(DOWN)


@pytest.mark.parametrize("blocks, scales, message", [
    ((3, 8, 2, 16), (3, 8, 3), r"blocks of shape \[3, 8, 2, 16\] need scales of shape \[3, 8, 2\], got \[3, 8, 3\]"),
    ((3, 8, 2, 32), (3, 8, 2), r"blocks are \[..., blocks, 16\] bytes, got shape \[3, 8, 2, 32\]"),
    ((3, 8, 2, 16), (3, 8, 2), "blocks and scales are uint8, got float32 and uint8"),
])
def test_disagreeing_blocks_and_scales_are_refused_by_name(tmp_path, blocks, scales, message):
    dtype = np.float32 if "float32" in message else np.uint8
    save_sharded(tmp_path, [{GATE_UP + "_blocks": np.zeros(blocks, dtype)}, {GATE_UP + "_scales": np.zeros(scales, np.uint8)}])
    with pytest.raises(ConfigError, match=f"{tmp_path}: MXFP4 tensor '{GATE_UP}': MXFP4 {message}"):
        hf._tensor_reader(tmp_path)(GATE_UP)
