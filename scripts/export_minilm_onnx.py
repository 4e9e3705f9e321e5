#!/usr/bin/env python3
"""Export sentence-transformers all-MiniLM-L6-v2 (a BERT encoder) from safetensors to ONNX, without torch.

Steps:
  1. read model.safetensors with plain numpy and build the ONNX graph with onnx.helper (opset 17);
  2. run onnx.checker and compare onnxruntime's output against an independent float64 numpy forward
     pass on a padded batch, then check that mean-pooled embeddings rank sentences sensibly;
  3. only if every check passes, move the model into place atomically (temp file + os.replace) and
     write reference sentence embeddings (numpy, mean-pooled, L2-normalised) to --reference.

Usage:
  python export_minilm_onnx.py --model-dir DIR --out DIR/model.onnx --reference DIR/reference.json

Tested with: numpy==2.3.5 onnx==1.19.1 tokenizers==0.22.1 onnxruntime==1.24.4 (Python 3.11).
Exits with status 1 and an "ERROR:" message if a check fails; --out is then left untouched.
"""
import argparse
import json
import math
import os
import struct
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

OPSET = 17        # first opset with LayerNormalization
IR_VERSION = 8    # the IR version that introduced opset 17; keeps the file loadable by older runtimes
MASK_NEG = -1e9   # added to attention scores of padded keys; finite, so outputs never become inf/nan
SYNTHETIC = False  # --synthetic: random weights (scripts/synth_weights.py), no semantic check
MAX_TOKENS = 256  # truncation length (tokenizer.json itself says 128: we override it)
TOL = 1e-4        # max |onnx - numpy| allowed on non-padded positions

SENTENCES = [
    "How do I install Rust?",
    "Installing Rust with rustup",
    "The 1973 oil crisis began in October",
    "A cat sleeps on the warm windowsill.",
    "Semantic search ranks documents by the meaning of a query rather than exact keyword matches.",
    # ~200 tokens: exercises positions beyond tokenizer.json's fixed 128-token padding/truncation.
    "The history of computing spans several centuries, beginning with mechanical calculators such as "
    "the abacus, Pascal's adding machine and Babbage's difference engine, which was designed to tabulate "
    "polynomial functions without human error. In the twentieth century, electromechanical relays gave "
    "way to vacuum tubes, and machines like ENIAC and Colossus demonstrated that electronic circuits could "
    "perform thousands of operations per second. The invention of the transistor at Bell Labs in 1947, "
    "followed by the integrated circuit a decade later, shrank computers from room-sized installations to "
    "desktop devices. Operating systems, compilers and high-level programming languages such as Fortran, "
    "COBOL, C and later Rust made it possible for ordinary engineers to write reliable software. Networks "
    "connected these machines, first within universities and laboratories, then across the globe through "
    "the internet, which transformed commerce, science, entertainment and everyday communication for "
    "billions of people around the world.",
]


class CheckFailed(Exception):
    pass


# Inputs: safetensors (plain numpy) and config
def read_safetensors(path):
    """Layout: u64 LE header length, JSON header {name: {dtype, shape, data_offsets}}, raw bytes."""
    dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4"}
    with open(path, "rb") as f:
        buf = memoryview(f.read())
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(bytes(buf[8:8 + n]))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = np.frombuffer(buf[8 + n + start:8 + n + end], dtype=dtypes[info["dtype"]])
        tensors[name] = arr.reshape(info["shape"])
    return tensors


def load_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("hidden_act") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
        raise CheckFailed(f"unsupported config: {cfg.get('hidden_act')}, {cfg.get('position_embedding_type')}")
    return cfg


# ONNX graph
class Graph:
    """Tiny helper that names node outputs and collects nodes/initializers."""

    def __init__(self):
        self.nodes, self.inits, self.count = [], [], 0

    def const(self, name, arr):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type, inputs, out=None, **attrs):
        self.count += 1
        out = out or f"{op_type}_{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self.count}_{op_type}", **attrs))
        return out


def build_onnx(w, cfg):
    g = Graph()
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    head_dim = hidden // heads
    f32 = lambda a: np.asarray(a, dtype=np.float32)
    i64 = lambda a: np.asarray(a, dtype=np.int64)
    c_zero = g.const("c_zero_1d", i64([0]))
    c_one_f, c_half = g.const("c_one_f", f32(1.0)), g.const("c_half", f32(0.5))
    c_sqrt2, c_neg = g.const("c_sqrt2", f32(math.sqrt(2.0))), g.const("c_mask_neg", f32(MASK_NEG))
    c_scale = g.const("c_scale", f32(1.0 / math.sqrt(head_dim)))
    c_heads = g.const("c_split_heads", i64([0, 0, heads, head_dim]))  # 0 = copy batch/seq dims
    c_merge = g.const("c_merge_heads", i64([0, 0, hidden]))
    c_axes12 = g.const("c_axes_1_2", i64([1, 2]))

    def linear(x, prefix):  # torch Linear stores [out, in]; MatMul wants [in, out]
        wt = g.const(prefix + ".weight_t", w[prefix + ".weight"].T)
        return g.op("Add", [g.op("MatMul", [x, wt]), g.const(prefix + ".bias", w[prefix + ".bias"])])

    def layer_norm(x, prefix, out=None):
        return g.op("LayerNormalization", [x, g.const(prefix + ".weight", w[prefix + ".weight"]),
                                           g.const(prefix + ".bias", w[prefix + ".bias"])],
                    out=out, axis=-1, epsilon=eps)

    # Embeddings: word[ids] + position[0..seq-1] + token_type[tt], then LayerNorm.
    # Position rows 0..seq-1 are taken with Slice(table, [0], Shape(input_ids)[1:2]) rather than
    # Gather(table, Range(0, seq, 1)): onnxruntime 1.24's extended optimizer rewrites the Range+Gather
    # pattern into a Slice with 2-D starts that then fails at run time ("Starts must be a 1-D array").
    table = lambda kind: g.const(f"embeddings.{kind}.weight", w[f"embeddings.{kind}.weight"])
    seq_len = g.op("Shape", ["input_ids"], start=1, end=2)  # 1-D [seq]
    word = g.op("Gather", [table("word_embeddings"), "input_ids"], axis=0)
    pos = g.op("Slice", [table("position_embeddings"), c_zero, seq_len, c_zero])  # rows 0..seq-1
    ttype = g.op("Gather", [table("token_type_embeddings"), "token_type_ids"], axis=0)
    h = layer_norm(g.op("Add", [g.op("Add", [word, pos]), ttype]), "embeddings.LayerNorm")

    # Extended attention mask [batch, 1, 1, seq]: 0 for real tokens, MASK_NEG for padding.
    mask = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT), c_axes12])
    ext_mask = g.op("Mul", [g.op("Sub", [c_one_f, mask]), c_neg])

    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        split = lambda x, perm: g.op("Transpose", [g.op("Reshape", [x, c_heads])], perm=perm)
        q = split(linear(h, p + "attention.self.query"), [0, 2, 1, 3])  # [b, heads, seq, d]
        k = split(linear(h, p + "attention.self.key"), [0, 2, 3, 1])    # [b, heads, d, seq]
        v = split(linear(h, p + "attention.self.value"), [0, 2, 1, 3])  # [b, heads, seq, d]
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), c_scale]), ext_mask])
        ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), c_merge])
        attn = layer_norm(g.op("Add", [linear(ctx, p + "attention.output.dense"), h]),
                          p + "attention.output.LayerNorm")
        # Exact GELU: 0.5 * x * (1 + erf(x / sqrt(2)))
        x = linear(attn, p + "intermediate.dense")
        erf = g.op("Erf", [g.op("Div", [x, c_sqrt2])])
        gelu = g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, c_one_f])]), c_half])
        last = i == cfg["num_hidden_layers"] - 1
        h = layer_norm(g.op("Add", [linear(gelu, p + "output.dense"), attn]), p + "output.LayerNorm",
                       out="last_hidden_state" if last else None)

    dyn = ["batch", "seq"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, dyn)
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, dyn + [hidden])]
    graph = helper.make_graph(g.nodes, "all-MiniLM-L6-v2", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="export_minilm_onnx.py")
    model.ir_version = IR_VERSION
    return model


# Independent numpy reference (float64), written directly from the weights
_erf = np.vectorize(math.erf, otypes=[np.float64])


def numpy_forward(w, cfg, ids, mask, tt):
    W = lambda name: w[name].astype(np.float64)
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    d = hidden // heads
    batch, seq = ids.shape

    def ln(x, prefix):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * W(prefix + ".weight") + W(prefix + ".bias")

    def lin(x, prefix):
        return x @ W(prefix + ".weight").T + W(prefix + ".bias")

    emb = lambda kind, rows: w[f"embeddings.{kind}.weight"][rows].astype(np.float64)
    x = emb("word_embeddings", ids) + emb("position_embeddings", slice(0, seq)) + emb("token_type_embeddings", tt)
    x = ln(x, "embeddings.LayerNorm")
    ext = (1.0 - mask.astype(np.float64))[:, None, None, :] * MASK_NEG
    heads_of = lambda t: t.reshape(batch, seq, heads, d).transpose(0, 2, 1, 3)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (heads_of(lin(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + ext
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
        a = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        u = lin(a, p + "intermediate.dense")
        u = 0.5 * u * (1.0 + _erf(u / math.sqrt(2.0)))
        x = ln(lin(u, p + "output.dense") + a, p + "output.LayerNorm")
    return x


def mean_pool_normalize(h, mask):
    m = mask[..., None].astype(np.float64)
    emb = (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)


# Verification and output
def encode(tok, sentences, pad):
    if pad:
        tok.enable_padding(pad_id=0, pad_type_id=0, pad_token="[PAD]")  # pad to longest in batch
    else:
        tok.no_padding()
    encs = tok.encode_batch(sentences)
    arr = lambda key: np.array([getattr(e, key) for e in encs], dtype=np.int64)
    return arr("ids"), arr("attention_mask"), arr("type_ids")


def ort_session(model_path, level):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    opts.graph_optimization_level = level
    sess = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    return lambda ids, m, tt: sess.run(["last_hidden_state"],
                                       {"input_ids": ids, "attention_mask": m, "token_type_ids": tt})[0]


def verify(model_path, w, cfg, tok):
    ids, mask, tt = encode(tok, SENTENCES, pad=True)
    lengths = mask.sum(1)
    print(f"batch shape {ids.shape}, token counts {lengths.tolist()}")
    if lengths.max() <= 128:
        raise CheckFailed("long sentence was truncated to <=128 tokens (tokenizer.json padding/truncation trap)")
    if len(set(lengths.tolist())) < 5:
        raise CheckFailed("expected at least 5 different sentence lengths in the test batch")
    ref_out = numpy_forward(w, cfg, ids, mask, tt)

    # Check the graph as written (no optimizations) and as consumers run it (all fusions enabled).
    max_diff = 0.0
    for label, level in (("unoptimized", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
                         ("optimized", ort.GraphOptimizationLevel.ORT_ENABLE_ALL)):
        run = ort_session(model_path, level)
        onnx_out = run(ids, mask, tt)
        if onnx_out.shape != ids.shape + (cfg["hidden_size"],) or not np.isfinite(onnx_out).all():
            raise CheckFailed(f"bad onnx output: shape {onnx_out.shape}, finite={np.isfinite(onnx_out).all()}")
        diff = float(np.abs(onnx_out - ref_out)[mask == 1].max())
        print(f"max |onnx - numpy| over unpadded positions ({label} onnxruntime graph): {diff:.3e}")
        max_diff = max(max_diff, diff)
    if not max_diff <= TOL:
        raise CheckFailed(f"onnx and numpy disagree: max abs diff {max_diff:.3e} > {TOL:g}")

    emb = mean_pool_normalize(onnx_out, mask)
    cos_close, cos_far = float(emb[0] @ emb[1]), float(emb[0] @ emb[2])
    print(f"cos({SENTENCES[0]!r}, {SENTENCES[1]!r}) = {cos_close:.6f}")
    print(f"cos({SENTENCES[0]!r}, {SENTENCES[2]!r}) = {cos_far:.6f}")
    if not cos_close > cos_far and not SYNTHETIC:
        raise CheckFailed("semantic sanity check failed: related pair is not closer than the unrelated pair")

    # Reference embeddings: each sentence tokenized alone (no padding), as a consumer would embed it.
    ref_emb, ort_emb = [], []
    for s in SENTENCES:
        one = encode(tok, [s], pad=False)
        ref_emb.append(mean_pool_normalize(numpy_forward(w, cfg, *one), one[1])[0])
        ort_emb.append(mean_pool_normalize(run(*one), one[1])[0])
    ref_emb = np.stack(ref_emb)
    pad_diff = float(np.abs(mean_pool_normalize(ref_out, mask) - ref_emb).max())
    ort_diff = float(np.abs(np.stack(ort_emb) - ref_emb).max())
    print(f"max |embedding| diff: padded-batch vs alone (numpy) {pad_diff:.3e}, onnx vs numpy (alone) {ort_diff:.3e}")
    if not (pad_diff <= TOL and ort_diff <= TOL):
        raise CheckFailed("sentence embeddings depend on padding or differ between onnx and numpy")
    return max_diff, ref_emb


def atomic_write(path, data, check=None):
    """Write bytes to a temp file next to `path`, run `check(temp_path)`, then os.replace into place.

    An interrupted run or a failed check never leaves a partial or unverified file at `path`.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the final file normal permissions
        result = check(tmp) if check else None
        os.replace(tmp, path)
        return result
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="directory with model.safetensors, tokenizer.json, config.json")
    ap.add_argument("--out", required=True, help="output .onnx path (written atomically, only if verified)")
    ap.add_argument("--reference", help="output JSON with reference sentence embeddings")
    ap.add_argument("--synthetic", action="store_true",
                    help="the weights are random (scripts/synth_weights.py): every check but the "
                         "semantic one (a related pair closer than an unrelated one)")
    args = ap.parse_args()
    global SYNTHETIC
    SYNTHETIC = args.synthetic
    t0 = time.time()

    cfg = load_config(args.model_dir)
    w = read_safetensors(os.path.join(args.model_dir, "model.safetensors"))
    tok = Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json"))
    tok.no_padding()                                 # tokenizer.json pads everything to 128 ...
    tok.enable_truncation(max_length=MAX_TOKENS)     # ... and truncates at 128: override both

    def check(tmp_path):  # runs on the serialized temp file, before it becomes --out
        try:
            onnx.checker.check_model(tmp_path, full_check=True)
        except onnx.checker.ValidationError as e:
            raise CheckFailed(f"onnx.checker rejected the model: {e}") from e
        print("onnx.checker.check_model: ok")
        return verify(tmp_path, w, cfg, tok)

    max_diff, ref_emb = atomic_write(args.out, build_onnx(w, cfg).SerializeToString(), check)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")

    if args.reference:
        ref = {"max_abs_diff": max_diff, "sentences": SENTENCES,
               "embeddings": [[float(v) for v in e] for e in ref_emb]}
        atomic_write(args.reference, json.dumps(ref, indent=1).encode())
        print(f"wrote {args.reference}")
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except CheckFailed as e:
        print(f"ERROR: {e}", file=sys.stderr)
        sys.exit(1)
