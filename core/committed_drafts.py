"""Committed demo drafts, stored xz-compressed in the repository and unpacked on first use.

A plugin's ``demo_draft/`` keeps ``config.json`` (and small files) as they are and its large
files as ``<name>.xz`` (bf16 weights shrink ~29%, a tokenizer ~87%): the tracked tree stays
under the 64 MiB a GPU lease carries (the four drafts were 72 MB as they were).
``committed_draft(dir)`` returns a directory with every file unpacked: ``dir`` itself when
nothing in it is compressed, else ``<cache>/drafts/<dir name's parent>-<hash of the .xz files>``
(``$SPECFW_CACHE_DIR``, default ``~/.cache/specfw``), written once (a temporary directory
renamed into place, so concurrent first uses do not see a half-written draft).
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from pathlib import Path


def committed_draft(path: str | os.PathLike) -> Path:
    path = Path(path)
    packed = sorted(path.glob("*.xz"))
    if not packed:
        return path
    from .demo_model import cache_dir

    digest = hashlib.sha256()
    for f in packed:
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(1 << 20))  # the head of each file: enough to tell commits apart
    out = cache_dir() / "drafts" / f"{path.parent.name}-{digest.hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for f in path.iterdir():
            if f.is_file() and f.suffix == ".xz":
                with lzma.open(f) as src, open(tmp / f.stem, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
            elif f.is_file():
                shutil.copy2(f, tmp / f.name)
        try:
            os.rename(tmp, out)
        except OSError:  # another process unpacked it first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def demo_draft_for(ctx, path: str | os.PathLike) -> Path | None:
    """A plugin's committed demo draft ``path``, unpacked, when the engine serves the demo target
    and the plugin ships one (its ``config.json``); else None (the plugin then needs
    ``speculative.draft_model_path`` or has its own fallback)."""
    if (Path(path) / "config.json").exists() and ctx.engine_config.model.path in (None, "", "demo"):
        return committed_draft(path)
    return None


def pack_draft(path: str | os.PathLike, min_bytes: int = 1 << 20) -> list[Path]:
    """xz-compress every file of ``path`` of at least ``min_bytes`` in place (``name`` -> ``name.xz``):
    what to run on a newly trained draft before committing it (docs/drafts.md)."""
    done = []
    for f in sorted(Path(path).iterdir()):
        if f.is_file() and f.suffix != ".xz" and f.stat().st_size >= min_bytes:
            with open(f, "rb") as src, lzma.open(f.with_name(f.name + ".xz"), "wb", preset=9) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            f.unlink()
            done.append(f.with_name(f.name + ".xz"))
    return done
