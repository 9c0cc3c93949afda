"""Write JSONL rows whose completions are long enough to fill a whole training row on their own.

The packed runs of ``run_gpu.sh long`` put many short examples in one row; this data gives one sequence per
row instead (``--no-packing``), which is what a long-context fine-tune looks like and what lets stock and
deltafuse be compared on the loss (with one sequence per row stock has no packed sequences to mix). The text is
random lower-case words from a fixed seed; with the byte-level tokenizer of the named models one character is
one token, so ``--chars`` above ``--seq-len`` makes every row a full-length, truncated sequence.

    python benchmarks/long_rows.py rows.jsonl --rows 8 --chars 70000
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="JSONL file to write")
    p.add_argument("--rows", type=int, default=8, help="rows to write (default: %(default)s)")
    p.add_argument("--chars", type=int, default=70000, help="characters per completion (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rows < 1 or args.chars < 1:
        p.error(f"--rows and --chars must be >= 1, got --rows {args.rows} --chars {args.chars}")
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for i in range(args.rows):
            words, n = [], 0
            while n < args.chars:
                w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9)))
                words.append(w)
                n += len(w) + 1
            f.write(json.dumps({"prompt": f"Document {i}:\n", "completion": " ".join(words)[:args.chars]}) + "\n")
    print(f"wrote {args.rows} rows of {args.chars} characters to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
