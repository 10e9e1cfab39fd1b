"""Checkpoints in a documented, code-free format (no pickle anywhere).

A checkpoint is a directory holding
- ``state.json``: the step, the run's configuration and its history (plain JSON);
- ``arrays.npz``: every array leaf of the training state (parameters and optimiser
  state), stored as ``leaf_00000``, ``leaf_00001``, ... in ``jax.tree_util`` flattening
  order of the state; loaded with ``allow_pickle=False``.
Restoring needs a template state of the same structure (a freshly initialised one): its
tree structure tells where each leaf goes, and shapes and dtypes are checked.
The directory is written to a temporary name and renamed, so an interruption never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import zipfile

import jax
import numpy as np


def blocking_file(path) -> pathlib.Path | None:
    """The file standing where directory ``path`` or one of its parents would be created
    (the first of them that exists, when it is not a directory), else None."""
    path = pathlib.Path(path)
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def check_target(directory) -> None:
    """Raise ValueError unless ``directory`` is free or already a checkpoint: a checkpoint
    replaces the directory it is saved to, which must never be someone's folder or file."""
    directory = pathlib.Path(directory)
    if directory.exists() and not exists(directory):
        kind = "folder" if directory.is_dir() else "file"
        raise ValueError(f"checkpoint path {directory} is an existing {kind} that is not an rlx_jax checkpoint "
                         "(no state.json): refusing to replace it; give a new or a checkpoint directory")
    blocked = blocking_file(directory.parent)
    if blocked is not None:
        raise ValueError(f"checkpoint path {directory}: {blocked} is a file, not a directory")


def save(directory, state, meta: dict) -> None:
    directory = pathlib.Path(directory)
    check_target(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_leaves(state)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    try:
        np.savez(tmp / "arrays.npz", **{f"leaf_{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        if directory.exists():
            old = directory.with_name(directory.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def exists(directory) -> bool:
    return (pathlib.Path(directory) / "state.json").is_file()


def load(directory, template):
    """(state shaped like ``template``, meta dict). Raises ValueError on any mismatch."""
    directory = pathlib.Path(directory)
    meta = json.loads((directory / "state.json").read_text())
    if not (directory / "arrays.npz").is_file():
        raise ValueError(f"checkpoint {directory} is incomplete: it has a state.json but no arrays.npz")
    leaves, treedef = jax.tree_util.tree_flatten(template)
    try:
        arrays = np.load(directory / "arrays.npz", allow_pickle=False)
    except (zipfile.BadZipFile, EOFError) as exc:  # truncated or not an npz at all
        raise ValueError(f"checkpoint {directory}: arrays.npz is not a readable npz file ({exc})") from None
    if not hasattr(arrays, "files"):
        raise ValueError(f"checkpoint {directory}: arrays.npz holds a single array, not an npz archive")
    with arrays:
        if len(arrays.files) != len(leaves):
            raise ValueError(f"checkpoint {directory} holds {len(arrays.files)} arrays, the model needs {len(leaves)}")
        restored = []
        for i, ref in enumerate(leaves):
            key = f"leaf_{i:05d}"
            if key not in arrays.files:
                raise ValueError(f"checkpoint {directory}: arrays.npz has no array {key!r}")
            try:
                a = arrays[key]
            except (zipfile.BadZipFile, EOFError) as exc:
                raise ValueError(f"checkpoint {directory}: array {key!r} is corrupt ({exc})") from None
            ref = np.asarray(ref)
            if a.shape != ref.shape or a.dtype != ref.dtype:
                raise ValueError(
                    f"checkpoint {directory}: array {i} is {a.dtype}{list(a.shape)}, expected {ref.dtype}{list(ref.shape)}"
                )
            restored.append(a)
    return jax.tree_util.tree_unflatten(treedef, restored), meta
