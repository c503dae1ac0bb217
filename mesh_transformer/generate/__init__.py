"""Generation: prefill prompts into a KV cache, then decode inside one compiled loop.

    gen = Generator(config, params, mesh)
    [out] = gen.generate([[15496, 995]], [SamplingOptions(max_new_tokens=32, temperature=0)])
    out.tokens, out.logprobs, out.finish_reason

    sampling.py   per-request options and the sampling functions over [B, V] logits
    decode.py     the KV-cache state and the compiled prefill/decode programs (`Generator`)
    batching.py   requests joining and leaving the rows of a batch (`Sequence`, `Batch`)
    structured.py grammars a row's text must match (JSON schema, regex, choices, Lark/GBNF) as per-step token masks
    lookup.py     drafts from a row's own text for speculative decoding (`Generator(speculate=k)`)
    prefix.py     the prefix cache: prompt blocks' keys and values kept for later prompts
"""
from mesh_transformer.generate.batching import Batch, Sequence  # noqa: F401
from mesh_transformer.generate.decode import (DecodeState, Emitted, Generator, bucket, state_specs)  # noqa: F401
from mesh_transformer.generate.sampling import (FINISH_REASONS, MAX_EOS, MAX_LOGIT_BIAS, MAX_STOPS,  # noqa: F401
                                                STOP_TOKENS, TOP_LOGPROBS, RowOptions, SamplingOptions, argmax,
                                                categorical, choose, top_k_top_p)
