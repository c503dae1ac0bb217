"""Small builders shared by the tests (tiny configs, meshes, random HF GPT-J checkpoints)."""
from __future__ import annotations

import os
import re
import threading

import jax
import numpy as np

from mesh_transformer import parallel
from mesh_transformer.config import Config, ModelConfig, TrainConfig, config_from_dict

TINY = dict(layers=3, d_model=64, n_heads=8, n_vocab=250, seq=16, d_ff=128, pe_rotary_dims=4,
            compute_dtype="float32", remat="full", lr=1e-3, warmup_steps=0, anneal_steps=10, total_steps=10)


def tiny_config(**overrides) -> Config:
    return config_from_dict({**TINY, **overrides})


def config_for(model: ModelConfig, **train) -> Config:
    return Config(model, TrainConfig(**train))


def mesh(dp: int, mp: int):
    return parallel.make_mesh(mp, dp, jax.devices()[: dp * mp])


def random_tokens(shape, vocab, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def layer_loop_bodies(hlo: str, layers: int) -> list[str]:
    """Text of each while-loop body in a compiled HLO module that runs `layers` times: the scanned
    layer stacks. XLA:CPU writes loops of its own too (a scatter expanded into one per index)."""
    bodies = []
    for line in hlo.splitlines():
        loop = re.search(r"\bwhile\(.*?body=(%[\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"", line)
        if loop and int(loop.group(2)) == layers:
            start = hlo.index(f"\n{loop.group(1)} ")
            bodies.append(hlo[start:hlo.find("\n}\n", start)])
    return bodies


def make_hf_gptj(path, seed=0, **kwargs):
    """Save a random tiny `GPTJForCausalLM` to `path`; return the (eval-mode, fp32) torch model."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    defaults = dict(vocab_size=101, n_positions=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4,
                    bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPTJForCausalLM(GPTJConfig(**{**defaults, **kwargs})).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to 0/1; perturb them so parity covers them
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))



NEW = 16
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs!",
          "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow.",
          "def main():\n    return 42\n", "0123456789 naïve café — ünïcödé"] * 20


COMMA = 14  # "," in tiny_long's vocabulary (tests/conftest.py)
THINK_ID, END_THINK_ID = 1, 2  # its reasoning markers: one token each (special), as in Qwen 3's and R1's vocabularies


class Tiny:
    """A random tiny GPT-J with its own byte-level BPE tokenizer saved beside the weights."""

    def __init__(self, path, n_positions: int = 32, specials: tuple = ()):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>", *specials], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        tokenizer.save_pretrained(path)
        # initializer_range 0.2: peaked logits, so greedy choices are not near-ties that 1e-7 noise could flip
        self.torch = make_hf_gptj(path, vocab_size=len(tokenizer), n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                                  rotary_dim=4, initializer_range=0.2, bos_token_id=tokenizer.eos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        self.path, self.tokenizer, self.eos = path, tokenizer, tokenizer.eos_token_id

    def hf_greedy(self, prompt: list[int], new: int = NEW, eos: bool = False, **generate):
        """(tokens, log p of each) from transformers' generate(do_sample=False), with `generate`'s
        further arguments (sequence_bias, min_new_tokens, eos_token_id ...)."""
        import torch
        kw = dict(do_sample=False, max_new_tokens=new, eos_token_id=self.eos if eos else None, pad_token_id=self.eos,
                  output_scores=True, return_dict_in_generate=True)
        out = self.torch.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  **{**kw, **generate})
        tokens = out.sequences[0, len(prompt):].tolist()
        scores = torch.stack(out.scores, 1)[0].log_softmax(-1)
        return tokens, scores[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()

    def hf_logits(self, tokens: list[int]) -> np.ndarray:
        import torch
        with torch.no_grad():
            return self.torch(torch.tensor([tokens])).logits[0].numpy()


# --------------------------------------------------------------------------------------------
# Random tiny HF models of every family (the oracle for parity tests)
# --------------------------------------------------------------------------------------------

def hf_grads_as_params(model, directory, peft_model=False, config=None):
    """torch's gradients, written where the weights were and read back through our HF (or PEFT) import."""
    from mesh_transformer import lora
    from mesh_transformer.io import hf
    for p in model.parameters():
        if p.requires_grad:
            p.data.copy_(p.grad)
    model.save_pretrained(directory)
    return lora.load_peft(str(directory), config)[1] if peft_model else hf.load_hf(str(directory))[1]


def hf_classifier(torch_model, labels: int, path, seed: int = 3, names=None):
    """transformers' ForSequenceClassification of `torch_model`'s architecture with its weights and a
    random score head of `labels` outputs (class names `names`, default LABEL_i), padding id 0,
    saved to `path`."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES
    names = dict(enumerate(names or [f"LABEL_{i}" for i in range(labels)]))
    config = type(torch_model.config).from_dict({**torch_model.config.to_dict(), "id2label": names, "pad_token_id": 0,
                                                 "label2id": {v: k for k, v in names.items()}, "architectures": None})
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[config.model_type])(config).eval()
    missing, _ = model.load_state_dict(torch_model.state_dict(), strict=False)
    assert missing == ["score.weight"]
    model.save_pretrained(path)
    return model


# initializer_range 0.2 (OPT: init_std): attention is far from uniform and activations leave their
# linear range, so a wrong GELU, rotary pairing or norm epsilon shows up well above float32 noise.
# Odd sizes: vocabularies not divisible by mp, partial rotary, GQA with 1 and 2 kv heads, tied and untied.
FAMILY_CASES = {
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=101, n_positions=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_inner=48,
        bos_token_id=0, eos_token_id=0, initializer_range=0.2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=103, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, rotary_pct=0.25, rotary_emb_base=500.0, initializer_range=0.2)),
    "gpt_neox_sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=103, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, rotary_pct=0.5, use_parallel_residual=False, initializer_range=0.2)),
    "llama_gqa2_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, rope_theta=500.0, initializer_range=0.2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama_mqa_tied_bias_linear_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=40, tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, initializer_range=0.2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(  # YaRN over a 16-token original context
        vocab_size=97, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, initializer_range=0.2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0, "attention_factor": 1.5})),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(  # a sliding window shorter than the tests' rows
        vocab_size=99, max_position_embeddings=64, sliding_window=5, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=40, initializer_range=0.2)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(  # q/k norms; n_heads * head_dim != hidden_size
        vocab_size=97, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, intermediate_size=40, initializer_range=0.2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "granite_tied_bias": ("GraniteConfig", "GraniteForCausalLM", dict(  # Granite 3's four constants, none at 1
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, initializer_range=0.2, tie_word_embeddings=True,
        attention_bias=True, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
        logits_scaling=8.0)),
    "olmo2_gqa": ("Olmo2Config", "Olmo2ForCausalLM", dict(  # norms after each sublayer, q/k normed across heads
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, initializer_range=0.2, rope_theta=500.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "olmo3_window_yarn": ("Olmo3Config", "Olmo3ForCausalLM", dict(  # sliding layers around a full one with YaRN
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, initializer_range=0.2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0, bos_token_id=1,
        eos_token_id=2, rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "rope_theta": 500.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    "phi3_window_partial": ("Phi3Config", "Phi3ForCausalLM", dict(  # fused qkv/gate_up, rotary on half of each head
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, sliding_window=6, initializer_range=0.2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5})),
    "phi_gqa_yarn": ("PhiConfig", "PhiForCausalLM", dict(  # Phi-2's 0.4 of each head rotary (YaRN on it), biases, GQA
        vocab_size=99, max_position_embeddings=64, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "beta_fast": 4.0,
                         "rope_theta": 500.0, "partial_rotary_factor": 0.4})),
    "starcoder2_window": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(  # LayerNorms, biases, plain MLP, tied
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, sliding_window=5, initializer_range=0.2, bos_token_id=0,
        eos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
    "gemma_mqa": ("GemmaConfig", "GemmaForCausalLM", dict(  # (1 + w) norms, GeGLU, scaled embeddings; head_dim 12
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=12, intermediate_size=40, initializer_range=0.2)),
    "gemma2_softcap_window": ("Gemma2Config", "Gemma2ForCausalLM", dict(  # sandwich norms, soft-caps, 1 in 2 slides
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=40, sliding_window=5, query_pre_attn_scalar=12,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.2)),
    "gemma3_local_rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(  # q/k norms, a rope per layer kind
        vocab_size=99, max_position_embeddings=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=40, sliding_window=6, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM", dict(  # 4 experts, top 2, sliding window 5
        vocab_size=91, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        router_aux_loss_coef=0.5, initializer_range=0.2)),  # (trained with it: test_loss_and_grads_match_hf_autograd)
    "qwen3_moe_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # q/k norms, top 3 of 6 not renormalised
        vocab_size=93, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=12, moe_intermediate_size=16, intermediate_size=40, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=True, initializer_range=0.2)),
    "qwen2_moe_shared": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(  # q/k/v biases, a gated shared expert
        vocab_size=95, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=40, intermediate_size=40,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, initializer_range=0.2)),
    "gpt_oss_window_yarn": ("GptOssConfig", "GptOssForCausalLM", dict(  # sinks, biased experts, a clamp that bites
        vocab_size=91, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.0,
        initializer_range=0.2, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "rope_theta": 500.0})),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        initializer_range=0.2)),
    "opt_projected": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=95, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=48, word_embed_proj_dim=16, init_std=0.2, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    "opt_post_norm": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=95, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=48, do_layer_norm_before=False, init_std=0.2, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
}

# A case of each family (a mixture's two layouts: experts alone, and with a shared expert), for the
# checks whose code paths differ by family, not by each variant's details.
ONE_CASE_PER_FAMILY = ["gptj", "gpt_neox", "llama_gqa2_llama3_rope", "gpt2", "opt_projected", "phi3_window_partial",
                       "gemma2_softcap_window", "mixtral_window", "qwen2_moe_shared", "olmo2_gqa", "phi_gqa_yarn",
                       "starcoder2_window", "gpt_oss_window_yarn"]


def refusal(main, argv, capsys) -> str:
    """Run a tool's `main(argv)` on input it must refuse: exit code 2 (parser.error's SystemExit, or
    the code `main` returns) -> what it wrote to stderr."""
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def in_pieces(stream, pieces, tries: int = 4):
    """What `stream()` returned the first time `pieces(it)` counted more than one piece (else the
    last try's): a server hands a stream's reader all the text made since it last read, so a
    reader that falls behind the engine on a loaded machine can get a whole short reply at once;
    the engine side of this is pinned deterministically in test_serve."""
    for _ in range(tries):
        got = stream()
        if pieces(got) > 1:
            break
    return got


def one_device_env(**extra: str) -> dict:
    """os.environ for a script the test starts as a user runs it, on one CPU device (the suite's other
    XLA flags kept), plus `extra`."""
    from mesh_transformer.cli import cpu_devices_env
    return {**os.environ, **cpu_devices_env(1), **extra}


def make_hf_model(path, case: str, seed: int = 0, **overrides):
    """Save a random tiny HF model of FAMILY_CASES[case] to `path`; return the (eval, fp32) torch model."""
    import torch
    import transformers

    config_name, model_name, kwargs = FAMILY_CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**kwargs, **overrides})).eval()
    with torch.no_grad():  # HF initialises biases and norms to 0/1; perturb them so parity covers them
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):  # (GPT-OSS's experts' biases: [E, out])
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def rounded_like_int8(torch_model):
    """A copy of `torch_model` whose Linear/Conv1D weights, and a mixture's experts' (per expert), are
    what int8 weight-only quantization keeps (per output feature: scale = max |w| / 127, round to
    nearest, clip to +-127, times the scale), the embedding (and a head tied to it) and a router
    left as they are: transformers' computation on the weights `Generator(quantize="int8")` decodes with."""
    import copy

    import torch
    from transformers.pytorch_utils import Conv1D

    rounded = copy.deepcopy(torch_model)
    embedding = rounded.get_input_embeddings().weight
    with torch.no_grad():
        for module in rounded.modules():
            if type(module).__name__.endswith("Experts"):  # a mixture's: [E, out, in] per expert and output
                inputs = -2 if type(module).__name__ == "GptOssExperts" else -1  # GPT-OSS's: [E, in, out]
                for weight in (module.gate_up_proj, module.down_proj):
                    absmax = weight.abs().amax(dim=inputs, keepdim=True)
                    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
                    weight.copy_(torch.clamp(torch.round(weight / scale), -127, 127) * scale)
                continue
            if not isinstance(module, (torch.nn.Linear, Conv1D)) or module.weight is embedding:
                continue
            inputs = 1 if isinstance(module, torch.nn.Linear) else 0  # Linear [out, in], Conv1D [in, out]
            absmax = module.weight.abs().amax(dim=inputs, keepdim=True)
            scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
            module.weight.copy_(torch.clamp(torch.round(module.weight / scale), -127, 127) * scale)
    return rounded


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy `generate` continuation of one prompt, EOS an ordinary token (no stop:
    not `min_new_tokens`, which keeps going by forbidding EOS, so a model whose best token is its
    EOS would continue with its second best)."""
    import copy

    import torch
    config = copy.deepcopy(model.generation_config)  # eos None would mean "the model config's": [] is none
    config.update(do_sample=False, max_new_tokens=new, min_new_tokens=None, pad_token_id=0, eos_token_id=[])
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=config)
    return out[0, len(prompt):].tolist()


PARITY_TOL = 1e-5  # 3-10x the measured float32 error of our logits against HF's (tests/test_families.py)


def parity_error(config, params, torch_model, seed: int = 1) -> float:
    """Max |our logits - HF's| on random tokens (traced afresh, so code patched in memory is used)."""
    from mesh_transformer import models
    tokens = random_tokens((2, 13), config.n_vocab, seed=seed)
    ours = jax.jit(lambda p, t: models.build(config).apply(p, t)[0])(params, tokens)
    return float(np.max(np.abs(np.asarray(ours)[..., :config.n_vocab] - hf_logits(torch_model, tokens))))


def word_tokenizer(path, n_words: int = 200):
    """Save a word-level HF tokenizer ("w0" ... "w{n-1}" -> 0 ... n-1, whitespace-split) to `path`
    whose EOS is the ordinary word "w0": text can contain the EOS id (as a prompt that holds the
    model's EOS token does), which the EOS rule for segments would split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_words)}, unk_token="w1"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="w0").save_pretrained(path)
    return str(path)


def save_peft_adapters(base_dir, cls, adapters: dict, out_dir, conv1d: bool = False, scale_b: float = 3.0) -> dict:
    """PEFT LoRA adapters made by peft on the HF model (class `cls`) in `base_dir`, B random and
    `scale_b` times PEFT's random init (so each changes greedy tokens), saved under `out_dir`.
    adapters: {name: (rank, alpha, target_modules[, use_rslora])} -> {name: directory}."""
    import peft
    import torch
    out = {}
    for seed, (name, (rank, alpha, targets, *rslora)) in enumerate(adapters.items(), 1):
        torch.manual_seed(seed)
        model = peft.get_peft_model(cls.from_pretrained(base_dir).eval(), peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, fan_in_fan_out=conv1d,
            use_rslora=bool(rslora and rslora[0])))
        with torch.no_grad():  # B larger than PEFT's random init: every adapter changes the greedy tokens
            for key, p in model.named_parameters():
                if "lora_B" in key:
                    p.mul_(scale_b)
        out[name] = str(out_dir / f"adapter_{name}")
        model.save_pretrained(out[name])
    return out


def decoding_held_past(monkeypatch, engine, tokens: int = 64) -> threading.Event:
    """Make `engine`'s decode calls wait, once a running row holds `tokens` tokens, until the
    returned event is set: a test that aborts a stream part way cannot see the text end first
    (a busy machine once decoded all 700 tokens before the client read its first delta)."""
    released, step, batch = threading.Event(), engine.batch.step, engine.batch

    def step_when_released(limit=None):
        if any(len(batch.rows[r].tokens) >= tokens for r in batch.active()):
            assert released.wait(60), f"not released in 60 s: did the client see no text in {tokens} tokens?"
        return step(limit)

    monkeypatch.setattr(batch, "step", step_when_released)
    return released
