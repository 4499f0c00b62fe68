"""Real text that needs no download: the Python standard library's own `.py` files, tokenised once into
memory-mapped uint16 shards (`<bos> file bytes <eos>` per file, files in sorted path order).

About 2% of the files (chosen by a hash of their relative path) form the held-out split. The corpus is whatever
the running interpreter ships, so its contents differ between Python versions; the shard directory is named after
the version and a hash of the file list.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig
import zlib

import numpy as np

from k3jax.data import tokenizer as tok

SPLITS = ("train", "heldout")
HELDOUT_EVERY = 50  # crc32(path) % 50 == 0 -> held out


def stdlib_files() -> list[pathlib.Path]:
  """Relative paths of the stdlib's `.py` files (installed packages excluded), sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return sorted(p.relative_to(root) for p in root.rglob("*.py") if "site-packages" not in p.parts)


def split_of(relpath: pathlib.Path) -> str:
  return "heldout" if zlib.crc32(str(relpath).encode()) % HELDOUT_EVERY == 0 else "train"


def default_cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("K3JAX_CACHE", pathlib.Path.home() / ".cache" / "k3jax"))


def stdlib_shards(cache_dir: str | os.PathLike | None = None) -> dict[str, pathlib.Path]:
  """Paths of the `train` and `heldout` shards, tokenising the stdlib the first time (a few seconds)."""
  files = stdlib_files()
  if not files:
    raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}")
  digest = hashlib.sha1("\n".join(map(str, files)).encode()).hexdigest()[:10]
  version = f"py{sys.version_info.major}.{sys.version_info.minor}"
  out = pathlib.Path(cache_dir or default_cache_dir()) / f"stdlib-{version}-{digest}"
  paths = {s: out / f"{s}.bin" for s in SPLITS}
  if all(p.exists() for p in paths.values()):
    return paths
  out.mkdir(parents=True, exist_ok=True)
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  for split, path in paths.items():
    docs = [root / f for f in files if split_of(f) == split]
    chunks = []
    for f in docs:
      chunks += [np.array([tok.BOS], np.uint16), np.frombuffer(f.read_bytes(), np.uint8).astype(np.uint16),
                 np.array([tok.EOS], np.uint16)]
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # written whole, then renamed: readers never see a partial shard
    np.concatenate(chunks).tofile(tmp)
    os.replace(tmp, path)
  return paths
