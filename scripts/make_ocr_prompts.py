"""Generate the OCR prompt set data/ocr/{train,test}.txt (flow_grpo format).

Each line is a scene description containing the text to render once, in double quotes. Targets
come from our own word lists and phrase patterns; train and test targets are disjoint, templates
are shared. Deterministic for a given --seed:

    python scripts/make_ocr_prompts.py --out-dir data/ocr
"""

from __future__ import annotations

import argparse
import os
import random

TEMPLATES = [
    'a wooden storefront sign that reads "{}"',
    'a neon sign glowing on a brick wall with the words "{}"',
    'a chalkboard menu outside a cafe that says "{}"',
    'a coffee mug printed with the text "{}"',
    'a vintage movie poster titled "{}"',
    'a hand-painted banner at a street festival reading "{}"',
    'a white t-shirt with "{}" printed across the chest',
    'a book cover with the title "{}" in bold letters',
    'a birthday cake decorated with icing that spells "{}"',
    'a green highway sign displaying "{}"',
    'a graffiti mural on a concrete wall spelling "{}"',
    'a laptop screen showing a presentation slide that says "{}"',
    'a yellow sticky note on a fridge that reads "{}"',
    'a delivery truck with "{}" painted on its side',
    'a glass jar with a paper label that reads "{}"',
    'a protest placard held above a crowd that says "{}"',
    'a brass museum plaque engraved with "{}"',
    'a bus stop advertisement reading "{}"',
    'a doormat in front of a red door with the words "{}"',
    'a greeting card with "{}" written in gold script',
    'a billboard above a busy intersection announcing "{}"',
    'a stone monument in a park carved with the words "{}"',
    'a sticker on a skateboard deck that says "{}"',
    'a cereal box on a kitchen table labeled "{}"',
    'a sandy beach at sunset with "{}" written in the sand',
    'a shop window decal that reads "{}"',
    'a wooden shipping crate stamped with "{}"',
    'a subway station wall with a tiled sign reading "{}"',
    'a baseball cap embroidered with "{}"',
    'a classroom whiteboard with "{}" written in blue marker',
    'a blue sky where a small plane writes "{}" in white smoke',
    'a sheet of typewriter paper with the words "{}"',
    'a leather-bound restaurant menu titled "{}"',
    'a rural mailbox painted with the name "{}"',
    'a gym poster with the slogan "{}"',
    'a stadium scoreboard at night showing "{}"',
    'a wine bottle with an elegant label that says "{}"',
    'an old red barn with "{}" painted on the roof',
    'a hot air balloon with "{}" written on the envelope',
    'a smartphone lock screen notification that says "{}"',
    'a flag waving in the wind with "{}" printed on it',
    'a library shelf with a small sign that reads "{}"',
    'a canvas tote bag printed with "{}"',
    'a scented candle with a label reading "{}"',
    'a marathon runner wearing a bib printed with "{}"',
    'a snowy cabin with a carved wooden sign reading "{}"',
    'a cinema marquee lit up with "{}"',
    'an embroidered throw pillow that says "{}"',
    'a food truck menu board listing "{}"',
    'a vintage tin can with a faded label that reads "{}"',
]

ADJECTIVES = """fresh golden quiet happy wild silver lucky sunny little grand hidden rusty cozy
bright velvet crimson frozen gentle brave midnight electric urban ancient rapid humble daily
sweet salty spicy royal lonely secret modern rustic tiny mighty noble honest simple""".split()
NOUNS = """bread coffee garden river market bakery studio harbor forest library kitchen
theater lantern mountain ocean orchard bicycle planet rocket compass candle meadow island
castle diner museum garage tavern workshop gallery station canyon valley bridge village
pizza noodles tacos donuts cookies waffles lemonade pancakes tea honey cheese apples""".split()
VERBS = """save visit join enjoy protect explore follow celebrate discover support taste
build share keep love try""".split()
NAMES = """Maria Oliver Amara Kenji Lucia Noah Priya Felix Greta Omar Sofia Hugo Leila Ivan
Nora Mateo Aisha Bruno Clara Dmitri Elena Farid Hana Jonas""".split()
PLACES = """Cafe Bakery Diner Books Garage Studio Market Bistro Salon Pharmacy Gallery Hotel
Pub Deli Florist Tailors Motors Records""".split()
PHRASES = """Open Late|No Parking|Welcome Home|Grand Opening|Closed on Sundays|Free Wifi Inside
|Stay Curious|Keep Calm|Do Not Disturb|Exit Only|Back in Five Minutes|Cash Only|Watch Your Step
|Fresh Every Morning|Made With Love|Dream Big|Hello Summer|Good Vibes Only|Sold Out|Best in Town
|Now Hiring|Thank You|Happy Birthday|Merry Christmas|Happy New Year|Live Music Tonight
|Please Knock|Mind the Gap|Rise and Shine|Gone Fishing""".replace("\n", "").split("|")


def _cap(words: list[str]) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in words)


def candidate_targets() -> list[str]:
    """All targets the patterns produce (deduplicated, 2..30 characters)."""
    out = list(PHRASES)
    out += [_cap([a, n]) for a in ADJECTIVES for n in NOUNS]
    out += [f"{_cap([v])} the {_cap([n])}" for v in VERBS for n in NOUNS]
    out += [f"{name}'s {place}" for name in NAMES for place in PLACES]
    out += [_cap([a, n, "Club"]) for a in ADJECTIVES[:12] for n in NOUNS[:24]]
    out += [f"{_cap([n])} {k}" for n in NOUNS for k in (7, 12, 24, 99, 101, 2049)]
    seen: dict[str, None] = {}
    for text in out:
        if 2 <= len(text) <= 30:
            seen.setdefault(text, None)
    return list(seen)


def styled(text: str, rng: random.Random) -> str:
    """Mostly as written, sometimes upper or lower case."""
    r = rng.random()
    return text.upper() if r < 0.2 else text.lower() if r < 0.3 else text


def make_split(targets: list[str], rng: random.Random) -> list[str]:
    return [rng.choice(TEMPLATES).format(styled(t, rng)) for t in targets]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="data/ocr")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    pool = candidate_targets()
    if args.num_train + args.num_test > len(pool):
        raise SystemExit(f"only {len(pool)} distinct targets for {args.num_train}+{args.num_test}")
    rng.shuffle(pool)
    test, train = pool[: args.num_test], pool[args.num_test: args.num_test + args.num_train]
    os.makedirs(args.out_dir, exist_ok=True)
    for name, targets in (("train", train), ("test", test)):
        path = os.path.join(args.out_dir, f"{name}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in make_split(targets, rng))
        print(f"wrote {len(targets)} prompts to {path}")


if __name__ == "__main__":
    main()
