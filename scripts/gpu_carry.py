#!/usr/bin/env python3
"""Carry files larger than one call allows to the GPU machine, over several calls.

A call of the device tool carries the working tree and the paths named in `carry`, 64 MiB in
all, and files left in ignored folders there stay while the machine is warm. So a file of
hundreds of MB (the real Qwen2.5-Coder 0.5B is 491 MB) goes as numbered parts, one or more
a call, each checked by its sha256 on arrival, and is put together there once every part has
come, then checked again against the sha256 of the whole file.

Here:
  scripts/gpu_carry.py plan FILE...           what it takes: parts, calls, bytes per call
  scripts/gpu_carry.py split FILE...          write .gpu-carry/ (manifest.json, part-NNN)
There, once per call, carrying .gpu-carry/manifest.json and the call's parts:
  python3 scripts/gpu_carry.py take           move the parts that came into .gpu-stage/,
                                              and when all have come, write .gpu-stage/files/
Anywhere:
  scripts/gpu_carry.py self-test              split and take small files in a temporary folder

The room a call leaves for parts is 64 MiB less what travels anyway (the tracked files and
the untracked ones git does not ignore, measured here) less a margin; `--budget-mib` sets it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALL_LIMIT = 64 * 1024 * 1024
MARGIN = 2 * 1024 * 1024
CARRY_DIR = ".gpu-carry"
STAGE_DIR = ".gpu-stage"
CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def travelling_bytes(repo: Path) -> int:
    """What a call sends anyway: tracked files and untracked files git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, check=True, capture_output=True,
    ).stdout
    total = 0
    for name in out.split(b"\0"):
        if not name:
            continue
        p = repo / os.fsdecode(name)
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def budget(args: argparse.Namespace) -> int:
    if args.budget_mib:
        return int(args.budget_mib * 1024 * 1024)
    room = CALL_LIMIT - travelling_bytes(REPO) - MARGIN
    if room < 4 * 1024 * 1024:
        sys.exit(f"gpu_carry: a call has {room / 2**20:.1f} MiB left for parts; shrink the tree")
    return room


def plan(files: list[Path], per_call: int, part_size: int) -> dict:
    total = sum(f.stat().st_size for f in files)
    parts = -(-total // part_size)
    per = max(1, per_call // part_size)
    return {
        "files": [{"name": f.name, "bytes": f.stat().st_size} for f in files],
        "bytes": total,
        "part_bytes": part_size,
        "parts": parts,
        "parts_per_call": per,
        "calls": -(-parts // per),
        "room_per_call_bytes": per_call,
    }


def cmd_plan(args: argparse.Namespace) -> None:
    files = [Path(f).absolute() for f in args.files]
    room = budget(args)
    print(json.dumps(plan(files, room, min(room, args.part_mib * 2**20)), indent=2))


def cmd_split(args: argparse.Namespace) -> None:
    files = [Path(f).absolute() for f in args.files]
    for f in files:
        if not f.is_file():
            sys.exit(f"gpu_carry: {f} is not a file")
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        sys.exit("gpu_carry: two files share a name")
    room = budget(args)
    part_size = min(room, args.part_mib * 2**20)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # one stream: the files one after another; the manifest says where each starts
    manifest = {"part_bytes": part_size, "files": [], "parts": []}
    offset = 0
    for f in files:
        size = f.stat().st_size
        manifest["files"].append({"name": f.name, "offset": offset, "bytes": size, "sha256": sha256(f)})
        offset += size
    reader = _Stream(files)
    while True:
        name, h, filled = f"part-{len(manifest['parts']):03d}", hashlib.sha256(), 0
        with open(out / name, "wb") as dst:
            while filled < part_size and (block := reader.read(min(CHUNK, part_size - filled))):
                dst.write(block)
                h.update(block)
                filled += len(block)
        if not filled:
            (out / name).unlink()
            break
        manifest["parts"].append({"name": name, "bytes": filled, "sha256": h.hexdigest()})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    p = plan(files, room, part_size)
    print(f"{out}: {len(manifest['parts'])} parts of up to {part_size / 2**20:.1f} MiB, "
          f"{p['parts_per_call']} a call, {p['calls']} calls")


def cmd_take(args: argparse.Namespace) -> int:
    src, stage = Path(args.carried), Path(args.stage)
    manifest = json.loads((src / "manifest.json").read_text())
    parts_dir = stage / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    # a manifest of other files starts over
    old = stage / "manifest.json"
    if old.exists() and json.loads(old.read_text()) != manifest:
        shutil.rmtree(stage)
        parts_dir.mkdir(parents=True)
    shutil.copyfile(src / "manifest.json", stage / "manifest.json")
    for part in manifest["parts"]:
        came = src / part["name"]
        if not came.exists():
            continue
        if came.stat().st_size != part["bytes"] or sha256(came) != part["sha256"]:
            print(f"gpu_carry: {part['name']} arrived damaged; carry it again", file=sys.stderr)
            return 1
        shutil.move(str(came), parts_dir / part["name"])
    have = [p for p in manifest["parts"] if (parts_dir / p["name"]).exists()]
    missing = [p["name"] for p in manifest["parts"] if p not in have]
    print(f"gpu_carry: {len(have)}/{len(manifest['parts'])} parts here"
          + (f"; missing: {' '.join(missing)}" if missing else ""))
    if missing:
        return 0
    files = stage / "files"
    files.mkdir(exist_ok=True)
    stream = [parts_dir / p["name"] for p in manifest["parts"]]
    reader = _Stream(stream)
    for f in manifest["files"]:
        dst = files / f["name"]
        h = hashlib.sha256()
        with open(dst, "wb") as out:
            left = f["bytes"]
            while left:
                block = reader.read(min(CHUNK, left))
                if not block:
                    print("gpu_carry: the parts end early", file=sys.stderr)
                    return 1
                out.write(block)
                h.update(block)
                left -= len(block)
        if h.hexdigest() != f["sha256"]:
            print(f"gpu_carry: {f['name']}: sha256 differs after assembly", file=sys.stderr)
            return 1
        print(f"gpu_carry: {dst} ({f['bytes']} bytes, sha256 {f['sha256'][:16]}…) checked")
    for p in stream:
        p.unlink()
    return 0


class _Stream:
    """The parts read one after another as one file."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.f = list(paths), None

    def read(self, n: int) -> bytes:
        while True:
            if self.f is None:
                if not self.paths:
                    return b""
                self.f = open(self.paths.pop(0), "rb")
            block = self.f.read(n)
            if block:
                return block
            self.f.close()
            self.f = None


def cmd_self_test(_: argparse.Namespace) -> int:
    """Three files over seven parts, taken over calls out of order, one damaged part refused."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        sizes = [3_000_001, 17, 2_500_000]
        files = []
        for i, n in enumerate(sizes):
            p = t / f"f{i}.bin"
            p.write_bytes(os.urandom(n))
            files.append(p)
        here, there = t / "here", t / "there"
        there.mkdir()
        ns = argparse.Namespace(files=[str(f) for f in files], out=str(here / CARRY_DIR),
                                budget_mib=2.0, part_mib=1)
        cmd_split(ns)
        manifest = json.loads((here / CARRY_DIR / "manifest.json").read_text())
        parts = [p["name"] for p in manifest["parts"]]
        assert len(parts) == 6, parts
        take = argparse.Namespace(carried=str(there / CARRY_DIR), stage=str(there / STAGE_DIR))

        def call(names: list[str], damage: bool = False) -> int:
            c = there / CARRY_DIR
            c.mkdir(exist_ok=True)
            shutil.copyfile(here / CARRY_DIR / "manifest.json", c / "manifest.json")
            for n in names:
                shutil.copyfile(here / CARRY_DIR / n, c / n)
                if damage:
                    with open(c / n, "r+b") as f:
                        f.write(b"\0")
            return cmd_take(take)

        assert call([parts[0], parts[1]], damage=True) == 1, "a damaged part is refused"
        for n in parts[0:2]:
            (there / CARRY_DIR / n).unlink(missing_ok=True)
        assert call([parts[4], parts[5]]) == 0
        assert not (there / STAGE_DIR / "files" / "f0.bin").exists(), "not before every part"
        assert call([parts[0], parts[2]]) == 0
        assert call([parts[1], parts[3]]) == 0
        for f in files:
            got = there / STAGE_DIR / "files" / f.name
            assert got.read_bytes() == f.read_bytes(), f.name
    print("gpu_carry self-test passed")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("plan", "split"):
        s = sub.add_parser(name)
        s.add_argument("files", nargs="+")
        s.add_argument("--budget-mib", type=float, help="room a call leaves for parts (default: measured)")
        s.add_argument("--part-mib", type=int, default=64, help="largest part (MiB)")
        if name == "split":
            s.add_argument("--out", default=str(REPO / CARRY_DIR))
    t = sub.add_parser("take")
    t.add_argument("--carried", default=CARRY_DIR)
    t.add_argument("--stage", default=STAGE_DIR)
    sub.add_parser("self-test")
    args = ap.parse_args()
    if args.cmd == "plan":
        cmd_plan(args)
        return 0
    if args.cmd == "split":
        cmd_split(args)
        return 0
    if args.cmd == "take":
        return cmd_take(args)
    return cmd_self_test(args)


if __name__ == "__main__":
    sys.exit(main())
