#!/usr/bin/env python3
"""Scores greedy continuations with llama.cpp, teacher-forced: an independent reference for
docent's greedy tokens that is not thrown off by near-ties.

Free-running greedy decoding of two engines parts at the first near-tie (two tokens whose
logits differ by less than the engines' rounding), and everything after it differs. So instead
each of docent's tokens is checked on docent's own prefix: llama.cpp reads prompt + the tokens
before it and gives its logits; the token's gap is llama.cpp's best logit minus the logit of
docent's token (0 where docent picked llama.cpp's argmax).

llama.cpp runs with an F32 KV cache (its default is F16) and F32 logits for every position, on
the CPU, --threads threads.

Input (--fixture): {"prompts": [{"name", "tokens"}], "docent": [[ids], ...], ...}
Output: the fixture with "llama_cpp" set to
  {"engine": "llama.cpp (llama-cpp-python 0.3.36)", "kv_cache": "f32",
   "scored": [[ids], ...]  (the ids scored: the fixture's docent ids at the time),
   "gaps": [[float per token], ...], "argmax": [[id per token], ...],
   "margins": [[llama.cpp's best logit minus its second best, per token], ...]}
written back to the same file (--write) or to stdout.

Usage: models/.venv-llama/bin/python scripts/llama_score.py --model FILE.gguf --fixture F.json [--write]
"""

from __future__ import annotations

import argparse
import json
import sys

try:
    import numpy as np
    import llama_cpp
except ImportError as e:  # pragma: no cover - environment problem
    sys.exit(f"llama_score: {e} (run scripts/bench-generate-venv.sh and use models/.venv-llama)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()

    with open(a.fixture) as f:
        fx = json.load(f)
    prompts, docent = fx["prompts"], fx["docent"]
    if len(prompts) != len(docent):
        sys.exit("llama_score: the fixture needs docent's ids for every prompt")
    longest = max(len(p["tokens"]) + len(d) for p, d in zip(prompts, docent))
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_ctx=max(512, longest + 8),
        n_batch=512,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        verbose=False,
    )
    gaps, argmax, margins = [], [], []
    for p, ids in zip(prompts, docent):
        llm.reset()
        seq = list(p["tokens"]) + list(ids[:-1])
        llm.eval(seq)
        start = len(p["tokens"]) - 1
        logits = np.asarray(llm.scores[start : start + len(ids)], dtype=np.float32)
        best = logits.max(axis=1)
        chosen = logits[np.arange(len(ids)), ids]
        g = (best - chosen).tolist()
        gaps.append([round(x, 4) for x in g])
        top2 = np.sort(logits, axis=1)[:, -2:]
        margins.append([round(float(x), 4) for x in top2[:, 1] - top2[:, 0]])
        argmax.append([int(x) for x in logits.argmax(axis=1)])
        print(
            f"llama_score: prompt {p['name']}: {sum(1 for x in g if x == 0)} of {len(ids)} "
            f"tokens are llama.cpp's argmax, largest gap {max(g):.4f}",
            file=sys.stderr,
        )
    fx["llama_cpp"] = {
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "kv_cache": "f32",
        "scored": docent,
        "gaps": gaps,
        "argmax": argmax,
        "margins": margins,
    }
    out = json.dumps(fx)
    if a.write:
        with open(a.fixture, "w") as f:
            f.write(out)
    else:
        print(out)


if __name__ == "__main__":
    main()
