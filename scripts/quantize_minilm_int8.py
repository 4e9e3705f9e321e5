#!/usr/bin/env python3
"""Quantize the exported all-MiniLM-L6-v2 ONNX model to int8 (ONNX Runtime dynamic quantization).

Steps:
  1. quantize_dynamic(--src-dir/model.onnx) into a temp file in --out-dir: int8 weights (QInt8, per
     channel, full 8-bit range), activations quantized at run time (uint8);
  2. verify it: mean-pooled, L2-normalised embeddings of SENTENCES (each alone, and all in one padded
     batch) must have cosine >= --min-cosine to the fp32 model's, and mean cosine >= --mean-cosine;
  3. only then move it into place (export_minilm_onnx.atomic_write), copy the tokenizer/config files the Rust loader needs
     (each atomically) and write quantization.json (settings, checksums, measured cosines and timing).

Settings, measured on AMD EPYC (AVX-512 VNNI), ORT 1.24.4, 2 threads, 20 sentences (min / mean cosine,
batch of 8x202 tokens; fp32 ~125 ms):
  per_channel=True,  reduce_range=False  0.9866 / 0.9933  ~58 ms   <- chosen
  per_channel=True,  reduce_range=True   0.9814 / 0.9918  ~59 ms
  per_channel=False, reduce_range=False  0.9311 / 0.9597  ~58 ms
  per_channel=False, reduce_range=True   0.7442 / 0.8526  ~58 ms
Speed does not depend on the settings; per-tensor scales lose too much on MiniLM's outlier weights, and
reduce_range (7-bit weights, meant for CPUs without VNNI) only costs accuracy here. The thresholds
(min 0.97, mean 0.985) pass both per-channel variants with margin and reject both per-tensor ones.
Quantizing Gather (the word-embedding table) too changes nothing measurable and shrinks the file to
~23 MB (from 90 MB); ORT's optional pre-processing (quant_pre_process) made no difference either.

Usage:
  python quantize_minilm_int8.py --src-dir models/all-MiniLM-L6-v2 --out-dir models/all-MiniLM-L6-v2-int8

Tested with: numpy==2.3.5 onnx==1.19.1 tokenizers==0.22.1 onnxruntime==1.24.4 (Python 3.11).
Exits with status 1 and an "ERROR:" message if the check fails; --out-dir/model.onnx is then untouched.
"""
import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import QuantType, quantize_dynamic
from tokenizers import Tokenizer

# The export step's helpers (same directory, same environment).
from export_minilm_onnx import CheckFailed, atomic_write, encode, mean_pool_normalize, ort_session

PER_CHANNEL = True
REDUCE_RANGE = False
MAX_TOKENS = 256        # truncation length, as in export_minilm_onnx.py and docent's embedder
BENCH_SHAPE = (8, 202)  # timing batch: 8 texts x (200 tokens + [CLS]/[SEP])
THREADS = 2             # ort_session's intra-op threads
# Copied next to the int8 model.onnx: with it, exactly the files docent's loader reads.
COPIED = ["tokenizer.json", "config.json", "special_tokens_map.json", "tokenizer_config.json"]

# Varied on purpose: queries, prose, code, Markdown, tables, other languages/scripts, log lines, one token.
SENTENCES = [
    "How do I install Rust?",
    "Installing Rust with rustup",
    "The 1973 oil crisis began in October",
    "A cat sleeps on the warm windowsill.",
    "Semantic search ranks documents by the meaning of a query rather than exact keyword matches.",
    'fn main() { println!("Hello, world!"); }',
    "## Ownership\n\nEach value in Rust has an *owner*; when the owner goes out of scope, the value is dropped.",
    "Die Katze schläft auf der Fensterbank.",
    "¿Dónde está la biblioteca más cercana?",
    "東京は日本の首都です。",
    "ERROR 42: connection refused (errno=111) at 10.0.0.1:5432",
    "The quick brown fox jumps over the lazy dog.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "What is the capital of Australia?",
    "Borrowing rules: you can have either one mutable reference or any number of immutable references.",
    "The stock market fell 3% on Tuesday after disappointing earnings reports from major tech companies.",
    "I love this movie!",
    "| Name | Age |\n|------|-----|\n| Ann  | 31  |",
    "Vectors store values of the same type next to each other in memory, and can grow or shrink at run "
    "time; use Vec::with_capacity when the final size is known to avoid reallocations.",
    "A",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def embed(run, feed):
    """Mean-pooled, L2-normalised embeddings; `feed` is (ids, attention mask, type ids)."""
    return mean_pool_normalize(run(*feed), feed[1])


def cosines(fp32, int8, tok):
    """Cosine per sentence (int8 vs fp32): each sentence alone, and all of them in one padded batch."""
    alone = [encode(tok, [s], pad=False) for s in SENTENCES]
    a = np.concatenate([(embed(fp32, f) * embed(int8, f)).sum(1) for f in alone])
    batch = encode(tok, SENTENCES, pad=True)
    b = (embed(fp32, batch) * embed(int8, batch)).sum(1)
    return a, b


def bench_feed(tok):
    """BENCH_SHAPE[0] different texts, each cut to exactly BENCH_SHAPE[1] tokens."""
    texts = [" ".join((SENTENCES[i:] + SENTENCES[:i]) * 3) for i in range(BENCH_SHAPE[0])]
    tok.enable_truncation(max_length=BENCH_SHAPE[1])
    try:
        feed = encode(tok, texts, pad=True)
    finally:
        tok.enable_truncation(max_length=MAX_TOKENS)
    assert feed[0].shape == BENCH_SHAPE, feed[0].shape
    return feed


def median_ms(run, feed, warmup=2, runs=5):
    for _ in range(warmup):
        run(*feed)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run(*feed)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src-dir", required=True, help="fp32 model directory (model.onnx + tokenizer files)")
    ap.add_argument("--out-dir", required=True, help="output directory for the int8 model")
    ap.add_argument("--min-cosine", type=float, default=0.97, help="minimum cosine to fp32 of any sentence")
    ap.add_argument("--mean-cosine", type=float, default=0.985, help="minimum mean cosine to fp32")
    args = ap.parse_args()
    t0 = time.time()

    src = os.path.join(args.src_dir, "model.onnx")
    out = os.path.join(args.out_dir, "model.onnx")
    os.makedirs(args.out_dir, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(args.src_dir, "tokenizer.json"))
    tok.enable_truncation(max_length=MAX_TOKENS)  # tokenizer.json says 128 (encode sets the padding)
    session = lambda path: ort_session(path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    fp32 = session(src)
    measured = {}

    def verify(candidate):
        """Raises CheckFailed unless the quantized model at `candidate` stays close to fp32."""
        int8 = session(candidate)
        alone, batched = cosines(fp32, int8, tok)
        both = np.concatenate([alone, batched])
        worst = SENTENCES[int(np.argmin(alone))]
        print(f"cosine int8 vs fp32 over {len(SENTENCES)} sentences: alone min {alone.min():.4f} mean "
              f"{alone.mean():.4f} (worst {worst!r}); padded batch min {batched.min():.4f} mean {batched.mean():.4f}")
        if not (np.isfinite(both).all() and both.min() >= args.min_cosine and both.mean() >= args.mean_cosine):
            raise CheckFailed(f"int8 embeddings too far from fp32: min cosine {both.min():.4f} "
                              f"(need >= {args.min_cosine}), mean {both.mean():.4f} (need >= {args.mean_cosine})")
        feed = bench_feed(tok)
        ms32, ms8 = median_ms(fp32, feed), median_ms(int8, feed)
        print(f"timing, batch {BENCH_SHAPE[0]}x{BENCH_SHAPE[1]} tokens, {THREADS} threads (median of 5): "
              f"fp32 {ms32:.0f} ms, int8 {ms8:.0f} ms ({ms32 / ms8:.2f}x)")
        if ms8 > ms32:
            print("WARNING: int8 is slower than fp32 on this CPU (no AVX-512 VNNI / AVX-VNNI?)")
        measured.update(both=both, ms32=ms32, ms8=ms8)

    with tempfile.TemporaryDirectory(dir=args.out_dir) as work:
        quantized = os.path.join(work, "model.onnx")
        # The quantizer warns that the model was not pre-processed: measured, it makes no difference here.
        logging.getLogger().setLevel(logging.ERROR)
        quantize_dynamic(src, quantized, per_channel=PER_CHANNEL, reduce_range=REDUCE_RANGE,
                         weight_type=QuantType.QInt8)
        print(f"quantized {src} ({os.path.getsize(src) / 1e6:.1f} MB) -> int8 "
              f"({os.path.getsize(quantized) / 1e6:.1f} MB), per_channel={PER_CHANNEL} reduce_range={REDUCE_RANGE}")
        with open(quantized, "rb") as f:
            atomic_write(out, f.read(), check=verify)
    print(f"wrote {out}")

    for name in COPIED:
        with open(os.path.join(args.src_dir, name), "rb") as f:
            atomic_write(os.path.join(args.out_dir, name), f.read())
    both, ms32, ms8 = measured["both"], measured["ms32"], measured["ms8"]
    record = {
        "source_model_sha256": sha256(src),
        "model_sha256": sha256(out),
        "quantization": {"method": "onnxruntime.quantization.quantize_dynamic", "onnxruntime": ort.__version__,
                         "weight_type": "QInt8", "per_channel": PER_CHANNEL, "reduce_range": REDUCE_RANGE},
        "cosine_vs_fp32": {"sentences": len(SENTENCES), "min": float(both.min()), "mean": float(both.mean()),
                           "min_threshold": args.min_cosine, "mean_threshold": args.mean_cosine},
        "timing_ms": {"batch": list(BENCH_SHAPE), "threads": THREADS, "fp32": round(ms32, 1), "int8": round(ms8, 1)},
    }
    atomic_write(os.path.join(args.out_dir, "quantization.json"), (json.dumps(record, indent=1) + "\n").encode())
    print(f"wrote {', '.join(COPIED)} and quantization.json; done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except CheckFailed as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(1)
