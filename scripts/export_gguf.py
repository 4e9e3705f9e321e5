#!/usr/bin/env python3
"""Converts the weights of a GGUF file to another tensor type (f32, f16 or q8_0), keeping its
metadata (architecture keys, tokenizer, chat template, ...) byte-identical, then verifies the
result.

Why: the generation benchmark compares docent (mistral.rs) and llama.cpp on the same model in
several weight types; only a quantized GGUF (SmolLM2-135M-Instruct Q4_1) is available, so the
other types are derived from it. Dequantizing loses nothing that the source had, so an F32
export computes exactly the function the Q4_1 file stores (modulo each engine's kernels).

What it does:
  * every tensor is dequantized with gguf.quants.dequantize (gguf-py's numpy port of ggml's
    reference dequantization) and written with gguf.GGUFWriter as
      f32   all float tensors F32
      f16   2-D+ tensors F16, 1-D tensors (norms, biases) F32 (a tensor outside the F16 range
            stays F32, with a warning)
      q8_0  2-D+ tensors Q8_0 when the row length is a multiple of 32, else F32; 1-D tensors
            F32 (gguf.quants.quantize; gguf-py documents it as bit-exact with ggml's reference
            quantize_row_q8_0)
    integer tensors (I8..I64), if any, are copied unchanged;
  * every metadata key is copied in the source order with its exact GGUFValueType (arrays with
    their element type; strings as raw bytes, so even invalid UTF-8 survives). The only key that
    changes is general.file_type (when the source has it), which describes the weight type:
    it is set to ALL_F32 / MOSTLY_F16 / MOSTLY_Q8_0 so that tools do not report an F32 file as
    Q4_1; --keep-file-type keeps the source's value;
  * the file is written to OUT.tmp.<pid> next to OUT, re-read with gguf.GGUFReader and checked:
    every metadata key, its type and its value byte for byte (the raw bytes of each key/value
    record); tensor names, order and shapes; and every tensor dequantized from the output against
    the source's dequantized tensor: bit-exact for f32 (and for tensors kept F32 or copied), and
    within the rounding bound of the type for f16 (half an F16 ulp) and q8_0 (half a quantization
    step per 32-block plus the F16 rounding of the block scale). Only then is it renamed to OUT
    (os.replace: atomic), so OUT is either the old file or a verified new one. Exit status 1 on
    any mismatch, 2 on bad input.
Re-running with the same arguments rewrites the same bytes (the conversion is deterministic).
Memory: the converted tensors are held in memory until written (the size of OUT), plus one
tensor at a time while converting and verifying (peak RSS 1.1-1.5 GB for SmolLM2-135M).

Environment: models/.venv-gguf, made with (versions pinned; gguf 0.19.0 = newest on PyPI at the
time of writing, from llama.cpp's gguf-py):
  python3 -m venv models/.venv-gguf
  models/.venv-gguf/bin/pip install --only-binary=:all: gguf==0.19.0 numpy==2.3.5

Usage:
  models/.venv-gguf/bin/python scripts/export_gguf.py --src IN.gguf --out OUT.gguf --type f32|f16|q8_0
e.g.
  models/.venv-gguf/bin/python scripts/export_gguf.py \\
      --src models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --out models/smollm2/SmolLM2-135M-Instruct.F32.gguf --type f32
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFValueType as VT
except ImportError as e:  # pragma: no cover - environment problem
    sys.exit(f"export_gguf: {e}; run it with the venv's Python: models/.venv-gguf/bin/python "
             "(pip install gguf==0.19.0 numpy==2.3.5)")

EXPECTED_GGUF = "0.19.0"

TARGETS = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
INT_TYPES = {QT.I8, QT.I16, QT.I32, QT.I64}
Q8_BLOCK = gguf.GGML_QUANT_SIZES[QT.Q8_0][0]  # 32
F16_MAX = float(np.finfo(np.float16).max)
FILE_TYPE_KEY = "general.file_type"


class Mismatch(Exception):
    """The written file does not match the source (exit status 1)."""


class BadInput(Exception):
    """The source cannot be converted (exit status 2)."""


def log(msg: str) -> None:
    print(f"export_gguf: {msg}", file=sys.stderr, flush=True)


def human(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

def kv_fields(reader: gguf.GGUFReader):
    """The real key/value fields (GGUFReader also lists GGUF.version/tensor_count/kv_count)."""
    return [(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]


def field_value(field) -> tuple[object, VT, VT | None]:
    """(value, type, element type) of a reader field, in the form GGUFWriter.add_key_value takes."""
    vtype = field.types[0] if field.types else None
    if vtype is None:
        raise BadInput(f"metadata {field.name!r}: no value type")
    if vtype == VT.ARRAY:
        # parts: key length, key bytes, value type, element type, length, elements...
        sub = VT(int(field.parts[3][0]))
        if sub == VT.ARRAY:
            raise BadInput(f"metadata {field.name!r}: nested arrays are not supported")
        if len(field.data) == 0:
            raise BadInput(f"metadata {field.name!r}: empty array (GGUFWriter cannot write one)")
        if sub == VT.STRING:
            val = [bytes(field.parts[i]) for i in field.data]
        else:
            val = [field.parts[i][0].item() for i in field.data]
        return val, vtype, sub
    if vtype == VT.STRING:
        return bytes(field.parts[-1]), vtype, None
    return field.parts[-1][0].item(), vtype, None


def field_bytes(field) -> bytes:
    """The raw bytes of a key/value record (key, type, element type, value): exact comparison."""
    return b"".join(p.tobytes() for p in field.parts)


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

def np_shape(t) -> tuple[int, ...]:
    """numpy shape of a tensor: GGUF lists dimensions innermost first (ne0 = row length)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def source_values(t) -> np.ndarray:
    """The float32 values of a float or quantized reader tensor, in numpy shape."""
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    arr = np.asarray(arr, dtype=np.float32).reshape(np_shape(t))
    return arr


def plan_type(t, values: np.ndarray, target: QT) -> tuple[QT, str | None]:
    """The output type of a float tensor, and why it differs from the target (or None)."""
    ndim = len(t.shape)
    if target == QT.F32:
        return QT.F32, None
    if ndim < 2:
        return QT.F32, None  # norms, biases: F32 as llama.cpp's own converters do
    if not np.all(np.isfinite(values)):
        return QT.F32, "has non-finite values"
    if target == QT.F16:
        if values.size and float(np.abs(values).max()) > F16_MAX:
            return QT.F32, f"values beyond the F16 range (max |x| = {float(np.abs(values).max()):g})"
        return QT.F16, None
    if target == QT.Q8_0:
        row = values.shape[-1]
        if row % Q8_BLOCK != 0:
            return QT.F32, f"row length {row} is not a multiple of {Q8_BLOCK}"
        if values.size and float(np.abs(values).max()) / 127 > F16_MAX:
            return QT.F32, "block scales beyond the F16 range"
        return QT.Q8_0, None
    raise AssertionError(target)


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QT.F16:
        return np.ascontiguousarray(values.astype(np.float16))
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype))  # uint8, byte shape


def tolerance(ref: np.ndarray, qtype: QT) -> np.ndarray | None:
    """Per-element bound of |output - source| for a lossy type (None: must be bit-exact)."""
    a = np.abs(ref.astype(np.float64))
    if qtype == QT.F16:
        # round to nearest: half an ulp, 2^-11 relative for normals, 2^-25 for subnormals
        return np.maximum(a * 2.0 ** -11, 2.0 ** -25) * (1 + 1e-9)
    if qtype == QT.Q8_0:
        # q = round(x / d), d = max|x| / 127 per block of 32, stored as F16 (d16):
        # |x - q*d16| <= d/2 + 127 * |d - d16|, |d - d16| <= max(d * 2^-11, 2^-25)
        blocks = a.reshape(-1, Q8_BLOCK)
        d = blocks.max(axis=1, keepdims=True) / 127
        tol = 0.5 * d + 127 * np.maximum(d * 2.0 ** -11, 2.0 ** -25)
        tol = tol + blocks * 2.0 ** -23  # float32 arithmetic slack
        return (np.broadcast_to(tol, blocks.shape) * (1 + 1e-9)).reshape(ref.shape)
    return None


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def export(src: gguf.GGUFReader, tmp: str, target: QT, file_type: int | None) -> dict[str, QT]:
    """Writes the converted model to tmp; returns the output type of each tensor."""
    arch_field = src.get_field("general.architecture")
    if arch_field is None:
        raise BadInput("the source has no general.architecture")
    arch = bytes(arch_field.parts[-1]).decode("utf-8")

    writer = gguf.GGUFWriter(tmp, arch, endianess=gguf.GGUFEndian.LITTLE)
    # GGUFWriter adds general.architecture itself; start from an empty table instead so that
    # the keys keep the source's order (the architecture key is copied like the others).
    writer.kv_data = [{}]
    for key, field in kv_fields(src):
        val, vtype, sub = field_value(field)
        if key == FILE_TYPE_KEY and file_type is not None:
            if vtype != VT.UINT32:
                raise BadInput(f"{key} has type {vtype.name}, expected UINT32")
            val = int(file_type)
        if key == "general.alignment":
            if vtype != VT.UINT32:
                raise BadInput(f"{key} has type {vtype.name}, expected UINT32")
            writer.data_alignment = int(val)
        writer.add_key_value(key, val, vtype, sub_type=sub)

    out_types: dict[str, QT] = {}
    notes: dict[str, int] = {}
    for t in src.tensors:
        if t.tensor_type in INT_TYPES:
            data = np.ascontiguousarray(t.data)
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
            out_types[t.name] = t.tensor_type
            continue
        try:
            values = source_values(t)
        except NotImplementedError as e:
            raise BadInput(f"tensor {t.name}: {e}") from e
        qtype, why = plan_type(t, values, target)
        if why is not None:
            log(f"{t.name} {list(values.shape)}: kept F32 ({why})")
            notes[why] = notes.get(why, 0) + 1
        data = encode(values, qtype)
        # F32/F16: numpy dtype and shape say it all (GGUFWriter writes the dimensions reversed,
        # i.e. back in GGUF order). Q8_0: uint8 in byte shape (rows, row_bytes) plus raw_dtype;
        # GGUFWriter turns the byte shape back into the element shape. (raw_shape must not be
        # given in elements for uint8 data: it would be converted a second time.)
        writer.add_tensor(t.name, data, raw_dtype=qtype if qtype == QT.Q8_0 else None)
        out_types[t.name] = qtype

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    return out_types


def verify(src: gguf.GGUFReader, out_path: str, out_types: dict[str, QT],
           file_type: int | None, verbose: bool) -> None:
    out = gguf.GGUFReader(out_path)

    # Metadata: same keys in the same order, each record byte-identical.
    src_kv, out_kv = kv_fields(src), kv_fields(out)
    if [k for k, _ in src_kv] != [k for k, _ in out_kv]:
        missing = {k for k, _ in src_kv} - {k for k, _ in out_kv}
        extra = {k for k, _ in out_kv} - {k for k, _ in src_kv}
        raise Mismatch(f"metadata keys differ (missing {sorted(missing)}, extra {sorted(extra)}, or order)")
    for (key, sf), (_, of) in zip(src_kv, out_kv):
        if key == FILE_TYPE_KEY and file_type is not None:
            if of.types != [VT.UINT32] or int(of.parts[-1][0]) != int(file_type):
                raise Mismatch(f"{key}: expected {int(file_type)}, found {of.contents()}")
            continue
        if sf.types != of.types:
            raise Mismatch(f"metadata {key}: type {[t.name for t in sf.types]} != {[t.name for t in of.types]}")
        if field_bytes(sf) != field_bytes(of):
            raise Mismatch(f"metadata {key}: value differs")
    if out.alignment != src.alignment:
        raise Mismatch(f"alignment {out.alignment} != {src.alignment}")

    # Tensors: names, order, shapes, types and values.
    if [t.name for t in src.tensors] != [t.name for t in out.tensors]:
        raise Mismatch("tensor names or order differ")
    worst: dict[str, tuple[float, str]] = {}  # out type -> (max abs err, its tensor)
    worst_ratio: dict[str, float] = {}  # out type -> max err/bound
    for st, ot in zip(src.tensors, out.tensors):
        if st.shape.tolist() != ot.shape.tolist():
            raise Mismatch(f"{st.name}: shape {ot.shape.tolist()} != {st.shape.tolist()}")
        want = out_types[st.name]
        if ot.tensor_type != want:
            raise Mismatch(f"{st.name}: type {ot.tensor_type.name} != {want.name}")
        if st.tensor_type in INT_TYPES:
            if st.data.tobytes() != ot.data.tobytes():
                raise Mismatch(f"{st.name}: integer tensor data differs")
            continue
        ref = source_values(st)
        got = source_values(ot)
        if got.shape != ref.shape:
            raise Mismatch(f"{st.name}: dequantized shape {got.shape} != {ref.shape}")
        bound = tolerance(ref, ot.tensor_type)
        if bound is None:
            # bit-exact (also distinguishes -0.0 and NaN payloads)
            if not np.array_equal(ref.view(np.uint32), got.view(np.uint32)):
                n = int(np.count_nonzero(ref.view(np.uint32) != got.view(np.uint32)))
                raise Mismatch(f"{st.name}: {n} values differ from the source (must be bit-exact)")
            err, ratio = 0.0, 0.0
        else:
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            err = float(diff.max()) if diff.size else 0.0
            ratio = float((diff / bound).max()) if diff.size else 0.0
            if not np.all(diff <= bound):
                i = int(np.argmax(diff - bound))
                raise Mismatch(f"{st.name}: error {diff.flat[i]:.3g} at flat index {i} exceeds the "
                               f"{ot.tensor_type.name} bound {bound.flat[i]:.3g} (source value {ref.flat[i]:.6g})")
        name = ot.tensor_type.name
        if verbose:
            log(f"  {st.name:32s} {st.tensor_type.name:>5s} -> {name:5s} {str(list(ref.shape)):>14s} max|err| {err:.3g}")
        if name not in worst or err > worst[name][0]:
            worst[name] = (err, st.name)
        worst_ratio[name] = max(ratio, worst_ratio.get(name, 0.0))
    counts: dict[str, int] = {}
    for q in out_types.values():
        counts[q.name] = counts.get(q.name, 0) + 1
    for name, (err, tname) in sorted(worst.items()):
        lossy = name in ("F16", "Q8_0")
        extra = f", at most {worst_ratio[name]:.2f} of the rounding bound" if lossy else " (bit-exact)"
        log(f"verified {counts[name]} {name} tensors: max|err| {err:.3g} ({tname}){extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="input GGUF file")
    ap.add_argument("--out", required=True, help="output GGUF file (replaced atomically)")
    ap.add_argument("--type", required=True, choices=sorted(TARGETS), help="weight type of the output")
    ap.add_argument("--keep-file-type", action="store_true",
                    help="keep the source's general.file_type instead of setting it to the new type")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every tensor's check")
    args = ap.parse_args()

    try:
        have = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        have = "unknown"
    if have != EXPECTED_GGUF:
        log(f"warning: written for gguf=={EXPECTED_GGUF}, found {have}")

    if not os.path.isfile(args.src):
        log(f"{args.src}: no such file")
        return 2
    if os.path.exists(args.out) and os.path.samefile(args.src, args.out):
        log("--out must differ from --src")
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        log(f"{out_dir}: no such directory")
        return 2
    target, ftype = TARGETS[args.type]

    t0 = time.perf_counter()
    try:
        src = gguf.GGUFReader(args.src)
    except Exception as e:
        log(f"{args.src}: not a readable GGUF file: {e}")
        return 2
    if src.byte_order != "I" or sys.byteorder != "little":
        log(f"{args.src}: only little-endian GGUF files on little-endian hosts are supported")
        return 2
    types: dict[str, int] = {}
    for t in src.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    log(f"source {args.src}: {human(os.path.getsize(args.src))}, {len(src.tensors)} tensors "
        f"({', '.join(f'{n} {k}' for k, n in sorted(types.items()))}), {len(kv_fields(src))} metadata keys")
    has_ftype = src.get_field(FILE_TYPE_KEY) is not None
    file_type = ftype if (has_ftype and not args.keep_file_type) else None
    if file_type is not None:
        old = src.get_field(FILE_TYPE_KEY).contents()
        try:
            old_name = gguf.LlamaFileType(old).name
        except ValueError:
            old_name = str(old)
        log(f"{FILE_TYPE_KEY}: {old_name} -> {file_type.name} (--keep-file-type keeps it)")

    tmp = f"{args.out}.tmp.{os.getpid()}"
    try:
        out_types = export(src, tmp, target, file_type)
        t1 = time.perf_counter()
        log(f"wrote {tmp}: {human(os.path.getsize(tmp))} in {t1 - t0:.1f} s; verifying")
        verify(src, tmp, out_types, file_type, args.verbose)
        t2 = time.perf_counter()
        os.replace(tmp, args.out)
    except BadInput as e:
        log(f"cannot convert {args.src}: {e}")
        return 2
    except Mismatch as e:
        log(f"VERIFICATION FAILED, {args.out} not written: {e}")
        return 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log(f"ok: {args.out}: {human(os.path.getsize(args.out))} ({args.type}); "
        f"convert+write {t1 - t0:.1f} s, verify {t2 - t1:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
