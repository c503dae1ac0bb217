"""Tokenize and pack text into a mesh-transformer dataset (successor of create_finetune_tfrecords.py).

    python create_finetune_dataset.py data/corpus my_corpus --output-dir datasets/ --seq 2048

Writes ``<output-dir>/<name>.index.json`` (point ``train_set`` / ``val_set`` at it) plus shards.
Exit status 2 on bad input, with the file and line in the message; nothing is left half-written.
"""
import argparse
import json
import sys

from mesh_transformer.io import storage
from mesh_transformer import cli
from mesh_transformer.data import BuildConfig, build_dataset


def parse_args(argv=None) -> BuildConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input_path", help="a .txt/.jsonl file (optionally .gz/.zst/.xz/.bz2) or a directory of them; local or gs://")
    p.add_argument("name", help="dataset name: files are <name>.index.json and <name>-NNNNN.tokens.npy")
    p.add_argument("--output-dir", default=".", help="local directory or gs:// prefix (default: .)")
    p.add_argument("--tokenizer", default="gpt2", help="'gpt2' (offline GPT-2 BPE), a tokenizer directory, or a hub name")
    p.add_argument("--seq", type=int, default=2048, help="context length; sequences hold seq+1 tokens (default 2048)")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text (default 'text'); "
                   "records with 'in_text'/'out_text' (or TRL's 'prompt'/'completion') are prompt/completion examples "
                   "trained on the completion only, "
                   "records with 'messages' (OpenAI's chat format, optional 'tools') conversations trained on the "
                   "assistant's turns only, 'prompt'/'chosen'/'rejected' preference pairs (DPO, CPO, ORPO), "
                   "'prompt'/'completion'/'label' unpaired preferences (KTO); with --label-key, labelled texts "
                   "for a classifier")
    p.add_argument("--label-key", metavar="FIELD",
                   help="JSONL records are labelled texts for a classifier (config key 'classify'): the text "
                        "field (--json-key) and the label in this one (e.g. 'label': a class number, a class "
                        "name, or for a regression a number; a list of class numbers or names: a multi-label "
                        "text, config key 'classify' {\"problem_type\": \"multi_label_classification\"}); "
                        "default: none, records with a text field are documents, other fields ignored")
    p.add_argument("--label-names", nargs="+", metavar="NAME",
                   help="with --label-key, for labels that are class names: the names in class-number order, so "
                        "every dataset of a run numbers them alike (default: the names this data holds, sorted); "
                        "with multi-label class numbers, names every class (even those no text has)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template for 'messages' records (default: the tokenizer's own, else the plain "
                        "'Role: content' one; the server's --chat-template should be the same)")
    p.add_argument("--sequences-per-shard", type=int, default=16384,
                   help="rows per shard file (default 16384: 64 MiB at seq 2048, uint16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset of the same name")
    p.add_argument("--unpair", action="store_true",
                   help="preference pairs become unpaired examples for KTO: chosen desirable, rejected not "
                        "(TRL's unpair_preference_dataset; KTOTrainer does it to pairs it is given)")
    clean = p.add_argument_group("data cleaning")
    clean.add_argument("--normalize-with-ftfy", action="store_true", help="fix text with ftfy (NFKC)")
    clean.add_argument("--normalize-with-wikitext-detokenize", action="store_true", help="undo WikiText tokenization")
    clean.add_argument("--min-unique-tokens", type=int, default=0,
                       help="drop sequences with fewer unique tokens (0 = off; 200 is a good value)")
    clean.add_argument("--treat-eot-as-text", action="store_true",
                       help="keep '<|endoftext|>' inside documents as text instead of splitting on it")
    pack = p.add_argument_group("shuffling and packing")
    pack.add_argument("--n-repack-epochs", type=int, default=1,
                      help="repeat the data N times, each packed from a new file order (default 1)")
    pack.add_argument("--seed", type=int, default=10, help="shuffle seed (default 10)")
    pack.add_argument("--preserve-data-order", action="store_true", help="no shuffling: output order = input order")
    p.add_argument("--verbose", action="store_true", help="print sequences removed by --min-unique-tokens")
    args = p.parse_args(argv)
    cli.check_at_least(p, [("--seq", args.seq, 1), ("--sequences-per-shard", args.sequences_per_shard, 1),
                           ("--n-repack-epochs", args.n_repack_epochs, 1),
                           ("--min-unique-tokens", args.min_unique_tokens, 0)])
    return BuildConfig(**vars(args), progress=True)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    with cli.user_errors() as status:
        index = build_dataset(cfg)
    if status.code:
        return status.code
    info = json.loads(storage.read_text(index))
    print(f"wrote {index}: {info['n_sequences']} sequences of {info['seq']}+1 tokens in "
          f"{len(info['shards'])} shard(s); stats {info['stats']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
