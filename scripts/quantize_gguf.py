#!/usr/bin/env python3
"""Quantizes a GGUF file with llama.cpp's own quantizer (through llama-cpp-python), for the
generation benchmark's Q4_0 / Q4_K_M / Q6_K rows.

Why llama.cpp's quantizer: these are the files a user downloads, with llama.cpp's per-tensor
choices. A K-quant needs rows that are whole 256-element super-blocks; SmolLM2-135M's hidden
size is 576, so llama.cpp stores those tensors in its fallback types (Q5_0 for Q4_K, Q8_0 for
Q6_K) and only the 1,536-wide ffn_down tensors as K-quants. docent's kernels implement all of
these types.

The output is written to OUT.tmp.<pid> and renamed to OUT when llama.cpp reports success.

Usage (models/.venv-llama comes from scripts/bench-generate-venv.sh):
  models/.venv-llama/bin/python scripts/quantize_gguf.py --src F32.gguf --out OUT.gguf --type q4_k_m
"""

from __future__ import annotations

import argparse
import os
import sys

FTYPES = {"q4_0": 2, "q8_0": 7, "q4_k_s": 14, "q4_k_m": 15, "q6_k": 18}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--type", required=True, choices=sorted(FTYPES))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - environment problem
        print(f"quantize_gguf: llama_cpp is not importable ({e}); run scripts/bench-generate-venv.sh", file=sys.stderr)
        return 2
    if not os.path.isfile(args.src):
        print(f"quantize_gguf: {args.src}: no such file", file=sys.stderr)
        return 2
    tmp = f"{args.out}.tmp.{os.getpid()}"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[args.type]
    params.nthread = args.threads
    rc = llama_cpp.llama_model_quantize(args.src.encode(), tmp.encode(), params)
    if rc != 0 or not os.path.isfile(tmp):
        print(f"quantize_gguf: llama.cpp failed with {rc}", file=sys.stderr)
        if os.path.exists(tmp):
            os.remove(tmp)
        return 1
    os.replace(tmp, args.out)
    print(f"quantize_gguf: wrote {args.out} ({os.path.getsize(args.out):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
