#!/usr/bin/env python3
"""A model file's layout, and a file of that layout with synthetic weights (GGUF, safetensors).

Why: a GPU machine borrowed for a check receives at most 64 MiB with the command; the Qwen
GGUF files are 0.5 and 1.1 GB and nothing can be downloaded there. Generation speed depends
on the tensors' names, types and shapes, the metadata (architecture, context, tokenizer) and
the bytes moved, not on the weights' values. So the check carries each model's layout (its
header, metadata and tensor table: a few MB, compressed) and writes there a file with the
same bytes up to the data section and random, well-formed quantized blocks after it. Both
engines then read the same file. What such a file cannot tell: answer quality, and how many
draft tokens a target model accepts (random models agree on next to nothing).

  synth_weights.py layout SRC.gguf LAYOUT    the bytes before SRC's tensor data, checked
  synth_weights.py synth LAYOUT OUT.gguf     LAYOUT + synthetic tensor data (numpy)
  synth_weights.py show FILE.gguf            tensor types and sizes, metadata size
  synth_weights.py st-layout SRC.safetensors LAYOUT   the same for a safetensors file (the
  synth_weights.py st-synth LAYOUT OUT.safetensors    embedder of the HTTP load check)

Only the standard library is needed for `layout` and `show`; `synth` uses numpy. The synthetic
blocks are valid for every type the Qwen2.5 Q4_K_M files use (F32, F16, Q4_K, Q5_0, Q6_K,
Q8_0; others are refused), with small scales so that activations stay finite: a weight's
magnitude stays under ~0.05, norm weights are 1.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

GGUF_MAGIC = b"GGUF"
# ggml type id -> (name, elements per block, bytes per block)
TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
# GGUF metadata value types: fixed sizes; 8 = string, 9 = array
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class Layout:
    """Header, metadata and tensor table of a GGUF file (the bytes before its data)."""

    def __init__(self, head: bytes, data_offset: int, tensors: list, alignment: int):
        self.head = head
        self.data_offset = data_offset
        self.tensors = tensors  # (name, type id, shape, offset in the data section)
        self.alignment = alignment

    def data_size(self) -> int:
        end = 0
        for _name, kind, shape, offset in self.tensors:
            end = max(end, offset + nbytes(kind, shape))
        return end


def nbytes(kind: int, shape) -> int:
    if kind not in TYPES:
        raise ValueError(f"ggml type {kind} is not supported")
    _name, per_block, size = TYPES[kind]
    count = 1
    for d in shape:
        count *= d
    if count % per_block:
        raise ValueError(f"{count} elements are not whole blocks of {per_block}")
    return count // per_block * size


def parse(read) -> Layout:
    """Parses the head of a GGUF file through `read(n) -> bytes`."""
    buf = bytearray()

    def take(n: int) -> bytes:
        chunk = read(n)
        if len(chunk) != n:
            raise ValueError("the file ends inside its header")
        buf.extend(chunk)
        return chunk

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def string() -> bytes:
        return take(u64())

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            inner = u32()
            count = u64()
            if inner in VALUE_SIZES:
                take(VALUE_SIZES[inner] * count)
                return None
            return [value(inner) for _ in range(count)]
        if kind not in VALUE_SIZES:
            raise ValueError(f"unknown metadata value type {kind}")
        raw = take(VALUE_SIZES[kind])
        return raw

    if take(4) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    version = u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors = u64()
    n_kv = u64()
    alignment = 32
    for _ in range(n_kv):
        key = string()
        kind = u32()
        v = value(kind)
        if key == b"general.alignment" and kind == 4:
            alignment = struct.unpack("<I", v)[0]
    tensors = []
    for _ in range(n_tensors):
        name = string().decode()
        dims = u32()
        shape = [u64() for _ in range(dims)]
        kind = u32()
        offset = u64()
        tensors.append((name, kind, shape, offset))
    pad = (-len(buf)) % alignment
    take(pad)
    return Layout(bytes(buf), len(buf), tensors, alignment)


def read_layout(path: Path) -> Layout:
    with open(path, "rb") as f:
        return parse(f.read)


def cmd_layout(src: Path, out: Path) -> None:
    layout = read_layout(src)
    size = src.stat().st_size
    expect = layout.data_offset + layout.data_size()
    if size < expect:
        raise SystemExit(f"{src}: {size} bytes, but its tensors need {expect}")
    trailer = struct.pack("<QQ", layout.data_size(), size)
    digest = hashlib.sha256(layout.head).digest()
    out.write_bytes(layout.head + b"DSYNLYT1" + trailer + digest)
    print(f"{out}: {layout.data_offset} header bytes of {src.name} ({size} bytes, "
          f"{len(layout.tensors)} tensors)")


def load_layout_file(path: Path) -> tuple[Layout, int]:
    raw = path.read_bytes()
    marker = raw.rfind(b"DSYNLYT1")
    if marker < 0:
        raise SystemExit(f"{path}: not a layout written by `synth_weights.py layout`")
    head = raw[:marker]
    data_size, file_size = struct.unpack("<QQ", raw[marker + 8: marker + 24])
    if hashlib.sha256(head).digest() != raw[marker + 24: marker + 56]:
        raise SystemExit(f"{path}: the layout's checksum does not match (truncated?)")
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        chunk = head[pos: pos + n]
        pos += n
        return chunk

    layout = parse(read)
    if layout.data_size() != data_size:
        raise SystemExit(f"{path}: the tensor table and the recorded data size disagree")
    return layout, file_size


def synth_tensor(np, rng, name: str, kind: int, shape) -> bytes:
    count = 1
    for d in shape:
        count *= d
    type_name, per_block, size = TYPES[kind]
    if type_name == "F32":
        if name.endswith("norm.weight"):
            return np.ones(count, dtype=np.float32).tobytes()
        return (rng.standard_normal(count, dtype=np.float32) * 0.02).tobytes()
    if type_name in ("F16", "BF16"):
        values = (rng.standard_normal(count, dtype=np.float32) * 0.02)
        if type_name == "F16":
            return values.astype(np.float16).tobytes()
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    blocks = count // per_block
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)

    def f16(values) -> np.ndarray:
        return np.asarray(values, dtype=np.float16).reshape(-1, 1).view(np.uint8)

    scale = lambda lo, hi: rng.uniform(lo, hi, size=blocks)  # noqa: E731
    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        raw[:, 0:2] = f16(scale(1e-4, 3e-3) if type_name != "Q8_0" else scale(1e-4, 4e-4))
    elif type_name in ("Q4_1", "Q5_1"):
        raw[:, 0:2] = f16(scale(1e-4, 3e-3))
        raw[:, 2:4] = f16(-scale(1e-4, 3e-3) * 8)
    elif type_name in ("Q4_K", "Q5_K"):
        raw[:, 0:2] = f16(scale(1e-5, 5e-5))  # d: times a 6-bit scale times a 4/5-bit q
        raw[:, 2:4] = f16(scale(1e-5, 5e-5))  # dmin
    elif type_name == "Q6_K":
        raw[:, 208:210] = f16(scale(2e-6, 1e-5))  # d, after ql, qh and the int8 scales
    elif type_name in ("Q2_K", "Q3_K"):
        raw[:, size - 2: size] = f16(scale(1e-5, 5e-5))
        if type_name == "Q2_K":
            raw[:, size - 4: size - 2] = f16(scale(1e-5, 5e-5))
    else:
        raise ValueError(f"no synthetic blocks for {type_name}")
    return raw.tobytes()


def cmd_synth(layout_path: Path, out: Path, seed: int) -> None:
    import numpy as np

    layout, file_size = load_layout_file(layout_path)
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(layout.head)
        written = 0
        for name, kind, shape, offset in sorted(layout.tensors, key=lambda t: t[3]):
            if offset < written:
                raise SystemExit(f"{layout_path}: tensor {name} overlaps the one before it")
            f.write(b"\0" * (offset - written))
            data = synth_tensor(np, rng, name, kind, shape)
            f.write(data)
            written = offset + len(data)
        f.write(b"\0" * (file_size - layout.data_offset - written))
    tmp.replace(out)
    print(f"{out}: {file_size} bytes, {len(layout.tensors)} synthetic tensors (seed {seed})")


def cmd_show(path: Path) -> None:
    layout = read_layout(path)
    totals: dict[str, list[int]] = {}
    for _name, kind, shape, _offset in layout.tensors:
        t = totals.setdefault(TYPES.get(kind, (str(kind),))[0], [0, 0])
        t[0] += 1
        t[1] += nbytes(kind, shape)
    print(f"{path}: header {layout.data_offset} bytes, {len(layout.tensors)} tensors")
    for type_name, (n, size) in sorted(totals.items()):
        print(f"  {type_name:5} {n:4} tensors {size / 2**20:9.1f} MiB")


def cmd_st_layout(src: Path, out: Path) -> None:
    """The 8-byte length and JSON header of a safetensors file, checked against its size."""
    import json

    raw = src.open("rb").read(8)
    (n,) = struct.unpack("<Q", raw)
    with open(src, "rb") as f:
        head = f.read(8 + n)
    header = json.loads(head[8:])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    if src.stat().st_size != 8 + n + end:
        raise SystemExit(f"{src}: {src.stat().st_size} bytes, its header describes {8 + n + end}")
    out.write_bytes(head)
    print(f"{out}: safetensors header of {src.name} ({len(header) - ('__metadata__' in header)} tensors)")


def cmd_st_synth(layout_path: Path, out: Path, seed: int) -> None:
    """Random weights (normal, sd 0.05) under the layout's header; LayerNorm gains 1, biases 0."""
    import json

    import numpy as np

    head = layout_path.read_bytes()
    (n,) = struct.unpack("<Q", head[:8])
    header = json.loads(head[8: 8 + n])
    rng = np.random.default_rng(seed)
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head[: 8 + n])
        written = 0
        tensors = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in tensors:
            start, end = info["data_offsets"]
            if info["dtype"] not in dtypes:
                raise SystemExit(f"{layout_path}: {name} is {info['dtype']}, not F32/F16/I64")
            f.write(b"\0" * (start - written))
            count = int(np.prod(info["shape"])) if info["shape"] else 1
            if info["dtype"] == "I64":  # position ids: 0, 1, 2, ... along the last axis
                values = np.arange(count) % max(info["shape"][-1], 1)
            elif "LayerNorm.weight" in name or name.endswith("norm.weight"):
                values = np.ones(count)
            elif name.endswith("bias") or "LayerNorm" in name:
                values = np.zeros(count)
            else:
                values = rng.standard_normal(count) * 0.05
            data = values.astype(dtypes[info["dtype"]]).tobytes()
            if len(data) != end - start:
                raise SystemExit(f"{layout_path}: {name} has {end - start} bytes, not {len(data)}")
            f.write(data)
            written = end
    tmp.replace(out)
    print(f"{out}: {len(tensors)} synthetic tensors (seed {seed})")


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "layout":
        cmd_layout(Path(argv[1]), Path(argv[2]))
    elif len(argv) >= 3 and argv[0] == "synth":
        seed = int(argv[3]) if len(argv) > 3 else 0
        cmd_synth(Path(argv[1]), Path(argv[2]), seed)
    elif len(argv) >= 3 and argv[0] == "st-layout":
        cmd_st_layout(Path(argv[1]), Path(argv[2]))
    elif len(argv) >= 3 and argv[0] == "st-synth":
        cmd_st_synth(Path(argv[1]), Path(argv[2]), int(argv[3]) if len(argv) > 3 else 0)
    elif len(argv) == 2 and argv[0] == "show":
        cmd_show(Path(argv[1]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
