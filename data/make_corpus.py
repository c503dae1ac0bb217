"""Regenerate the demo corpus in this folder (deterministic; the text is ours, so no license questions).

    python data/make_corpus.py

corpus/stories.txt      short templated stories separated by <|endoftext|>  (plain-text pre-training)
val/stories.txt         80 more stories from another seed (held-out validation set)
corpus/facts.jsonl      arithmetic and calendar facts, one {"text": ...} per line
qa.jsonl                {"in_text": question, "out_text": answer} pairs (completion-only fine-tuning)

A small model learns these patterns within minutes, so the README demo shows its loss falling.
"""
import json
import pathlib
import random

HERE = pathlib.Path(__file__).parent
NAMES = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonah", "Kemi", "Luca",
         "Mira", "Nils", "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tove", "Uma", "Viktor", "Wen", "Yara"]
PLACES = ["the harbour", "the old mill", "the hill above the town", "the market", "the library", "the forest edge",
          "the river bank", "the train station", "the lighthouse", "the orchard", "the bakery", "the bridge"]
THINGS = ["a red kite", "a brass key", "a map", "a lantern", "a wooden boat", "a letter", "a jar of honey",
          "a blue umbrella", "a compass", "a small drum", "a bag of apples", "a paper crane"]
WEATHER = ["It was raining softly", "The sun was bright", "A cold wind blew from the sea", "Fog lay over the fields",
           "The evening was warm and still", "Snow had fallen in the night"]
FEELINGS = ["happy", "curious", "tired", "surprised", "proud", "nervous", "calm", "hopeful"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


def story(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    place, other, thing = r.choice(PLACES), r.choice(PLACES), r.choice(THINGS)
    lines = [f"{r.choice(WEATHER)} when {a} walked to {place}.",
             f"There {a} met {b}, who was carrying {thing}.",
             f'"Where are you going?" asked {a}.',
             f'"To {other}," said {b}. "I promised to bring {thing} before {r.choice(DAYS)}."']
    for _ in range(r.randint(1, 4)):
        lines.append(r.choice([
            f"They walked together past {r.choice(PLACES)}, talking about {r.choice(THINGS)}.",
            f"{r.choice([a, b])} felt {r.choice(FEELINGS)} and hummed a song about {r.choice(MONTHS)}.",
            f"On the way they counted {r.randint(2, 40)} birds and {r.randint(2, 9)} boats.",
            f"{b} dropped {thing}, and {a} picked it up again.",
        ]))
    lines.append(f"When they reached {other}, {b} said thank you, and {a} went home feeling {r.choice(FEELINGS)}.")
    return " ".join(lines) + "\n"


def fact(r: random.Random) -> str:
    x, y = r.randint(0, 99), r.randint(0, 99)
    d, m = r.randrange(7), r.randrange(12)
    return r.choice([f"{x} plus {y} is {x + y}.", f"{x} times {y} is {x * y}.",
                     f"{max(x, y)} minus {min(x, y)} is {max(x, y) - min(x, y)}.",
                     f"The day after {DAYS[d]} is {DAYS[(d + 1) % 7]}.",
                     f"The month after {MONTHS[m]} is {MONTHS[(m + 1) % 12]}."])


def qa(r: random.Random) -> dict:
    x, y = r.randint(0, 99), r.randint(0, 99)
    d = r.randrange(7)
    q, a = r.choice([(f"What is {x} plus {y}?", str(x + y)), (f"What is {x} times {y}?", str(x * y)),
                     (f"Which day comes after {DAYS[d]}?", DAYS[(d + 1) % 7])])
    return {"in_text": f"Question: {q}\nAnswer:", "out_text": f" {a}"}


def main():
    r = random.Random(2021)
    (HERE / "corpus").mkdir(exist_ok=True)
    (HERE / "corpus" / "stories.txt").write_text("<|endoftext|>".join(story(r) for _ in range(700)))
    held_out = random.Random(7)
    (HERE / "val").mkdir(exist_ok=True)
    (HERE / "val" / "stories.txt").write_text("<|endoftext|>".join(story(held_out) for _ in range(80)))
    with open(HERE / "corpus" / "facts.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(fact(r) for _ in range(r.randint(3, 8)))}) + "\n")
    with open(HERE / "qa.jsonl", "w") as f:
        for _ in range(1500):
            f.write(json.dumps(qa(r)) + "\n")


if __name__ == "__main__":
    main()
