"""Data that every machine already has.

- Characters: the source files of Python's own standard library, a corpus present
  wherever Python is, encoded over a fixed 96-symbol vocabulary (newline + printable
  ASCII; tabs become spaces, anything else becomes '?').
- Digits: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig

import numpy as np

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_LOOKUP = np.full(256, VOCAB.index("?"), dtype=np.int32)
for _i, _ch in enumerate(VOCAB):
    _LOOKUP[ord(_ch)] = _i
_LOOKUP[ord("\t")] = VOCAB.index(" ")


def encode(text: str) -> np.ndarray:
    raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return _LOOKUP[raw]


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


@dataclasses.dataclass
class CharCorpus:
    train: np.ndarray  # int32 ids
    heldout: np.ndarray
    source: str

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int, split: str = "train"):
        """tokens [batch, seq_len] and next-token labels [batch * seq_len] (f32 ids)."""
        data = self.train if split == "train" else self.heldout
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} split ({len(data)} chars) is shorter than seq_len + 1")
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        windows = np.stack([data[s : s + seq_len + 1] for s in starts])
        return windows[:, :-1].astype(np.int32), windows[:, 1:].reshape(-1).astype(np.float32)

    def unigram_entropy(self) -> float:
        """Cross-entropy (nats/char) of the held-out text under the training unigram
        distribution (add-one smoothed): the loss a model that ignores context gets."""
        counts = np.bincount(self.train, minlength=len(VOCAB)).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.heldout].mean())


def stdlib_corpus(max_chars: int = 3_000_000, heldout_fraction: float = 0.1) -> CharCorpus:
    """The standard library's top-level .py files in sorted order, up to max_chars."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} characters of Python source under {root}")
    ids = encode("".join(parts)[:max_chars])
    cut = int(len(ids) * (1.0 - heldout_fraction))
    return CharCorpus(train=ids[:cut], heldout=ids[cut:], source=str(root))


def digits(test_fraction: float = 0.2, seed: int = 0):
    """(x_train [N,1,8,8], y_train [N], x_test, y_test) with pixels scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # scikit-learn comes with the [train] extra
        raise RuntimeError("the digits data needs scikit-learn: pip install 'rlx_jax[train]'") from exc
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None, :, :]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]
