"""Write the copy-heavy workload of the speculative-decoding scenario: a ShareGPT-format JSON file
whose prompts hold a passage and ask for it again, so that the continuation can be looked up in the
prompt (what prompt-lookup speculation is for: rewriting, code edits, quoting retrieved text).

    python benchmarks/speculative/copy_prompts.py --output FILE [--num-prompts 8] [--words 100]

The passages are seeded random sequences of common English words: every run writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different home "
         "us move try kind hand picture again change off play spell air away animal house point page letter "
         "mother answer found study still learn should world high every near add food between own below country "
         "plant last school father keep tree never start city earth eye light thought head under story saw left "
         "few while along might close something seem next hard open example begin life always those both paper "
         "together got group often run important until children side feet car mile night walk white sea began").split()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write the copy-heavy ShareGPT file of the speculative scenario.")
    p.add_argument("--output", required=True, help="the JSON file to write")
    p.add_argument("--num-prompts", type=int, default=8, help="passages (default: 8)")
    p.add_argument("--words", type=int, default=100, help="words in each passage (default: 100)")
    args = p.parse_args(argv)
    rng = random.Random(0)
    data = []
    for _ in range(args.num_prompts):
        passage = " ".join(rng.choice(WORDS) for _ in range(args.words)).capitalize() + "."
        prompt = f"{passage}\n\nThe same passage, copied word for word:\n"
        data.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": passage}]})
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
