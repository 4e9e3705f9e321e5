#!/usr/bin/env python3
"""The llama.cpp side of the generation benchmark: prefill and greedy decode speed of a GGUF
model on the CPU, through llama-cpp-python (the Python binding of llama.cpp), for prompts given
as token ids.

Why: docent generates with mistral.rs; llama.cpp is the reference CPU engine for GGUF models.
Feeding both the same token ids (produced once by the model's tokenizer, BOS included where the
model uses one) compares the engines, not their tokenizers or chat templates, and greedy
decoding of a fixed length makes the outputs comparable token for token.

Method, for each prompt and repeat (one llama_cpp.Llama for all, n_ctx 4096, n_batch 512,
n_threads = n_threads_batch = --threads; on the CPU, or with --gpu-layers N the first N layers,
all of them with 999, on the GPU of a llama-cpp-python built with CUDA):
  * the KV cache is cleared;
  * prefill: llm.eval(prompt tokens) (batches of n_batch), then the first token is the argmax
    of the last position's logits; TTFT = prefill + that first argmax;
  * decode: --new-tokens - 1 more tokens, one llm.eval([token]) + argmax each (greedy; ties go to
    the lowest id, as llama.cpp's greedy sampler does). EOS does not stop it, so every run
    decodes the same number of tokens; decode_tok_s = (new_tokens - 1) / decode time.
  * --warmup untimed runs of the first prompt come first (pages the weights in, allocates the
    compute buffers), so the first timed repeat is not a cold start.
The results are the medians over the repeats (each metric separately), plus the generated ids of
the first repeat; `deterministic` says whether all repeats generated the same ids.
Contention: llama.cpp's threads wait for each other in spin barriers, so with --threads equal to
the number of cores any other busy process wrecks the numbers (measured on 2 cores with a rustc
running: decode 13 -> 1-4 tok/s). `other_cpu` is the CPU time other processes used during the
timed runs, in cores (from /proc/stat, Linux); above 0.1 a warning is printed and the result
should be measured again on an idle machine.

Input (--prompt-tokens): {"prompts": [{"name": "600", "tokens": [1, 2, ...]}, ...]}
Output (stdout, one JSON object):
  {"peer": "llama.cpp (llama-cpp-python 0.3.36)", "threads": 2, ...,
   "results": [{"name", "prompt_tokens", "prefill_tok_s", "decode_tok_s", "ttft_ms",
                "prefill_ms", "decode_ms", "new_tokens", "deterministic", "other_cpu",
                "generated": [ids]}]}
Progress and errors go to stderr.

Environment: models/.venv-llama (bash scripts/bench-generate-venv.sh).
Usage:
  models/.venv-llama/bin/python scripts/bench_generate_peer.py --model FILE.gguf --threads 2 \\
      --prompt-tokens prompts.json --new-tokens 128 [--repeat 3] [--warmup 1] [--flash-attn]
      [--gpu-layers 999]
On a GPU, each decoded token also pays this script's Python: llm.eval copies the logits into
a numpy array and np.argmax scans them (~0.1 ms for a 151k vocabulary), which docent's side
pays too (mistral.rs copies logits to the host and samples there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

try:
    import numpy as np
    import llama_cpp
except ImportError as e:  # pragma: no cover - environment problem
    sys.exit(f"bench_generate_peer: {e}; run it with models/.venv-llama/bin/python "
             "(made by: bash scripts/bench-generate-venv.sh)")

N_CTX = 4096
N_BATCH = 512


def log(msg: str) -> None:
    print(f"bench_generate_peer: {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    log(msg)
    sys.exit(2)


def busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes have used since boot, CPU seconds of this process), or None
    where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    vals = [int(x) for x in fields[1:9]]
    busy = sum(vals) - vals[3] - vals[4]
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def load_prompts(path: str, n_vocab: int, new_tokens: int) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"{path}: invalid JSON: {e}")
    prompts = doc.get("prompts") if isinstance(doc, dict) else None
    if not isinstance(prompts, list) or not prompts:
        fail(f'{path}: expected {{"prompts": [{{"name": ..., "tokens": [...]}}, ...]}} with at least one prompt')
    names = set()
    for i, p in enumerate(prompts):
        where = f"{path}: prompts[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not isinstance(p.get("tokens"), list):
            fail(f'{where}: expected {{"name": string, "tokens": [ids]}}')
        toks = p["tokens"]
        if not toks or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            fail(f"{where} ({p['name']}): tokens must be a non-empty list of integers")
        bad = [t for t in toks if not 0 <= t < n_vocab]
        if bad:
            fail(f"{where} ({p['name']}): token ids {bad[:5]} outside the model's vocabulary (0..{n_vocab - 1})")
        if len(toks) + new_tokens > N_CTX:
            fail(f"{where} ({p['name']}): {len(toks)} prompt + {new_tokens} new tokens exceed n_ctx {N_CTX}")
        if p["name"] in names:
            fail(f"{where}: duplicate name {p['name']!r}")
        names.add(p["name"])
    return prompts


class Engine:
    def __init__(self, model: str, threads: int, flash_attn: bool, gpu_layers: int = 0):
        self.llm = llama_cpp.Llama(
            model_path=model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=gpu_layers, logits_all=False,
            flash_attn=flash_attn,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def clear(self) -> None:
        """Empties the KV cache (reset() alone only rewinds n_tokens; eval would then drop the
        stale cells, but an explicit clear leaves nothing to chance)."""
        self.llm.reset()
        mem = llama_cpp.llama_get_memory(self.llm.ctx)
        if mem is not None:
            llama_cpp.llama_memory_clear(mem, True)

    def argmax(self) -> int:
        """Greedy pick from the logits of the last evaluated position."""
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return int(np.argmax(logits))  # first maximum, like llama.cpp's greedy sampler

    def run(self, tokens: list[int], new_tokens: int) -> tuple[float, float, float, list[int]]:
        """(prefill s, ttft s, decode s, generated ids) of one greedy generation."""
        self.clear()
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        t1 = time.perf_counter()
        tok = self.argmax()
        t2 = time.perf_counter()
        out = [tok]
        for _ in range(new_tokens - 1):
            self.llm.eval([tok])
            tok = self.argmax()
            out.append(tok)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t0, t3 - t2, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--threads", type=int, required=True, help="CPU threads (prefill and decode)")
    ap.add_argument("--prompt-tokens", required=True, help='JSON file {"prompts": [{"name", "tokens"}]}')
    ap.add_argument("--new-tokens", type=int, required=True, help="tokens to generate (fixed, EOS ignored)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per prompt (default 3; medians)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of the first prompt first (default 1)")
    ap.add_argument("--flash-attn", action="store_true",
                    help="enable llama.cpp's flash attention (llama-cpp-python's default is off)")
    ap.add_argument("--gpu-layers", type=int, default=0,
                    help="layers offloaded to the GPU (999: all; needs a CUDA build of llama-cpp-python)")
    args = ap.parse_args()

    if args.threads < 1:
        fail("--threads must be at least 1")
    if args.new_tokens < 2:
        fail("--new-tokens must be at least 2 (one from the prefill, at least one decoded)")
    if args.repeat < 1 or args.warmup < 0:
        fail("--repeat must be at least 1 and --warmup at least 0")
    if not os.path.isfile(args.model):
        fail(f"{args.model}: no such file")
    if args.gpu_layers > 0 and not llama_cpp.llama_supports_gpu_offload():
        fail("--gpu-layers asks for the GPU, but this llama-cpp-python was built without GPU "
             "support (build it with CMAKE_ARGS=-DGGML_CUDA=on)")

    t = time.perf_counter()
    try:
        engine = Engine(args.model, args.threads, args.flash_attn, args.gpu_layers)
    except Exception as e:  # llama-cpp-python raises ValueError with little detail
        fail(f"{args.model}: llama.cpp could not load it ({e}); run with a llama.cpp build that "
             "supports its architecture and tensor types")
    log(f"loaded {args.model} in {time.perf_counter() - t:.1f} s (n_vocab {engine.n_vocab}, "
        f"{args.threads} threads, llama-cpp-python {llama_cpp.__version__})")
    prompts = load_prompts(args.prompt_tokens, engine.n_vocab, args.new_tokens)

    for i in range(args.warmup):
        engine.run(prompts[0]["tokens"], min(args.new_tokens, 16))
    results = []
    for p in prompts:
        toks = p["tokens"]
        b0, w0 = busy_seconds(), time.perf_counter()
        runs = [engine.run(toks, args.new_tokens) for _ in range(args.repeat)]
        b1, w1 = busy_seconds(), time.perf_counter()
        other = None
        if b0 is not None and b1 is not None:
            other = max(0.0, ((b1[0] - b0[0]) - (b1[1] - b0[1])) / (w1 - w0))
        prefill = statistics.median(r[0] for r in runs)
        ttft = statistics.median(r[1] for r in runs)
        decode = statistics.median(r[2] for r in runs)
        res = {
            "name": p["name"],
            "prompt_tokens": len(toks),
            "prefill_tok_s": round(statistics.median(len(toks) / r[0] for r in runs), 2),
            "decode_tok_s": round(statistics.median((args.new_tokens - 1) / r[2] for r in runs), 2),
            "ttft_ms": round(ttft * 1e3, 2),
            "prefill_ms": round(prefill * 1e3, 2),
            "decode_ms": round(decode * 1e3, 2),
            "new_tokens": args.new_tokens,
            "deterministic": all(r[3] == runs[0][3] for r in runs),
            "other_cpu": None if other is None else round(other, 2),
            "generated": runs[0][3],
        }
        log(f"{p['name']}: {len(toks)} prompt tokens: prefill {res['prefill_tok_s']} tok/s, "
            f"decode {res['decode_tok_s']} tok/s, TTFT {res['ttft_ms']} ms")
        if other is not None and other > 0.1:
            log(f"WARNING: other processes used {other:.2f} cores during the measurement of {p['name']}; "
                "llama.cpp's spin barriers make the numbers unreliable, measure again on an idle machine")
        results.append(res)

    # the widest x86 vector extension this build was compiled with (scripts/bench-generate-venv.sh
    # builds it native or, with PEER_ISA=avx2, without AVX-512)
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    isa = next((name for name in ("AVX512", "AVX2", "AVX") if f"{name} = 1" in info), "other")
    print(json.dumps({
        "peer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {isa})",
        "model": os.path.basename(args.model),
        "threads": args.threads,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "flash_attn": args.flash_attn,
        "gpu_layers": args.gpu_layers,
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "results": results,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
