"""Sample from a model: prompts from --prompt or stdin, the completion streamed as it is generated.

    python device_sample.py --hf ./gpt-j-6b --mp 8                      # interactive: one prompt per line
    echo "The meaning of life is" | python device_sample.py --ckpt gs://bucket/run --temperature 0
    python device_sample.py --hf ./gpt-j-6b --prompt "Hello" --max-new-tokens 64 --seed 1
    python device_sample.py --hf ./llama --prompt "A user as JSON:" --json-schema user.schema.json

Defaults are the original's: 512 tokens, top_p 0.9, temperature 0.75.
"""
import argparse
import sys

from mesh_transformer import cli, host_memory, loading
from mesh_transformer.config import ConfigError
from mesh_transformer.generate import SamplingOptions


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", "--length", type=int, default=512)
    g.add_argument("--temperature", "--temp", type=float, default=0.75, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this x the most likely one (0 = none)")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="fixed seed: the same prompt gives the same completion")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-text tokens (the tokenizer's EOS and "
                                                        "those the generation_config.json beside the weights lists)")
    g.add_argument("--chunk", type=int, default=8, help="tokens decoded between prints")
    f = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    f.add_argument("--json-schema", help="the text is JSON matching this schema (a file, or the schema's JSON)")
    f.add_argument("--json-object", action="store_true", help="the text is a JSON object")
    f.add_argument("--regex", help="the text matches this regular expression")
    f.add_argument("--choice", action="append", help="the text is one of these strings (repeatable)")
    f.add_argument("--grammar", help="the text matches this Lark or GBNF grammar (a file)")


def grammar_from_args(args):
    """(the flag, the structured.Grammar it asks for), or (None, None): read before the model loads,
    so a bad schema or a missing file is one error line at once (UserError naming the flag)."""
    import json
    import os
    from mesh_transformer.errors import UserError
    from mesh_transformer.generate.structured import Grammar
    flag = None
    try:
        if args.json_schema is not None:
            flag, text = "--json-schema", args.json_schema
            if os.path.isfile(text):
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            elif not text.lstrip().startswith("{"):
                raise ValueError(f"{text!r} is neither a file nor a JSON object")
            return flag, Grammar.json_schema(json.loads(text))
        if args.json_object:
            return "--json-object", Grammar.json_object()
        if args.regex is not None:
            return "--regex", Grammar.regex(args.regex)
        if args.choice:
            return "--choice", Grammar.choice(args.choice)
        if args.grammar is not None:
            flag = "--grammar"
            with open(args.grammar, encoding="utf-8") as f:
                return flag, Grammar.lark(f.read())
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(f"{flag}: {e}") from None
    return None, None


def check_grammar(flag, grammar, tokenizer, vocab: int) -> None:
    """UserError naming the flag when the grammar does not compile for this model's tokenizer."""
    from mesh_transformer.errors import UserError
    from mesh_transformer.generate import structured
    if grammar is not None:
        try:
            structured.check(grammar, tokenizer, vocab)
        except ValueError as e:
            raise UserError(f"{flag}: {e}") from None


# SamplingOptions' fields that are flags of their own (--max-new-tokens, ...): a bad value names the flag
FLAG_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
               "presence_penalty", "seed", "stop")


def checked_options(args, eos_token_ids, context: int, grammar=None) -> SamplingOptions:
    """The sampling flags as SamplingOptions, checked against a model of `context` tokens before any
    prompt is read: ConfigError naming the flag at fault."""
    options = options_from_args(args, eos_token_ids, grammar)
    try:
        options.validate(context)
    except ValueError as e:
        field, _, why = str(e).partition(" ")
        raise ConfigError(f"--{field.replace('_', '-')} {why}" if field in FLAG_FIELDS else str(e)) from None
    return options


def options_from_args(args, eos_token_ids, grammar=None) -> SamplingOptions:
    return SamplingOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, seed=args.seed, stop=tuple(args.stop),
        eos_token_id=None if args.no_eos or not eos_token_ids else tuple(eos_token_ids), grammar=grammar)


def prompts(args):
    if args.prompt:
        yield from args.prompt
    elif sys.stdin.isatty():
        while True:
            try:
                line = input("Type input: ")
            except EOFError:
                return
            if line.strip():
                yield line
    else:
        yield sys.stdin.read()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_model_args(parser)
    parser.add_argument("--prompt", action="append", help="prompt (repeatable); default: read stdin")
    add_sampling_args(parser)
    cli.add_speculate_args(parser)
    args = parser.parse_args(argv)
    if args.chunk < 1:
        parser.error(f"--chunk must be at least 1 decode step; got {args.chunk}")
    cli.check_speculate(parser, args)
    host_memory.keep_freed_memory()

    with cli.user_errors(ValueError) as status:  # (SamplingOptions' checks of the sampling flags)
        flag, grammar = grammar_from_args(args)
        model = loading.from_args(args)
        check_grammar(flag, grammar, model.tokenizer, model.config.padded_vocab(model.mesh.shape["mp"]))
        # one prompt at a time; the weights held once
        gen = model.generator(matvec=True, speculate=args.speculate, lookup_ngram=args.lookup_ngram)
        gen.check_generates()  # (a classifier does not)
        cli.check_new_tokens("--max-new-tokens", args.max_new_tokens, model.config.seq)
        options = checked_options(args, model.eos_token_ids, model.config.seq, grammar)
    if status.code:
        return status.code
    for text in prompts(args):
        [seq] = gen.sequences([model.tokenizer.encode(text)], options, model.tokenizer)
        if seq.truncated:
            print(f"[prompt truncated: the first {seq.truncated} tokens were dropped to fit the context]",
                  file=sys.stderr)
        passes = gen.row_passes
        for _ in gen.stream([seq], chunk=args.chunk):
            sys.stdout.write(seq.pop_text())
            sys.stdout.flush()
        # (with --speculate: the passes of the model after the prompt's, which gave the first token)
        passes = f", {gen.row_passes - passes} passes" if args.speculate else ""
        sys.stdout.write(f"\n[{len(seq.tokens)} tokens, finish: {seq.finish_reason}{passes}]\n")


if __name__ == "__main__":
    sys.exit(main())
