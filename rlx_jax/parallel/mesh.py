"""Device meshes from a command-line spec, and the parameter sharding of the model graphs.

``parse_mesh("data=2,model=2")`` builds a 2 x 2 ``jax.sharding.Mesh`` named
("data", "model"). ``param_specs`` gives each parameter of an RLX-graph model its
``PartitionSpec`` on such a mesh: the batch goes over "data"; over "model" the
transformer splits (Megatron-style tensor parallelism)

- q / k / v projections [D, H*hd] and the MLP's gate / up [D, F] by columns (heads, FFN
  units): each device computes whole heads / units;
- the attention output [H*hd, D] and the MLP's down projection [F, D] by rows (their
  input axis), so the partial products are summed by one all-reduce;
- the embedding table [V, D] and the unembedding [D, V] over the vocabulary;

each only where the axis divides evenly (heads, F, V a multiple of the "model" size);
every other parameter (norm gains, and everything of the CNN / MLP classifiers) is
replicated. Optimiser state entries mirror the parameter they belong to.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["parse_mesh", "mesh_size", "param_specs", "param_shardings", "state_shardings", "batch_spec"]

_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# ASCII digits only: str.isdigit also accepts superscripts ("²"), which int() rejects, and
# int() reads other scripts' digits ("٢"), which a mesh spec has no reason to hold
_SIZE = re.compile(r"[0-9]+")


def _parse(spec: str, allowed=None) -> tuple[list[str], list[int]]:
    """(axis names, sizes) of a ``"name=size,..."`` spec."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh spec must be a non-empty string like 'data=2,model=2', got {spec!r}")
    names, sizes = [], []
    for part in spec.split(","):
        name, eq, size = part.strip().partition("=")
        name = name.strip()
        size = size.strip()
        if not eq or not _AXIS.fullmatch(name) or not _SIZE.fullmatch(size):
            raise ValueError(f"mesh spec {spec!r}: each entry must be name=size (e.g. data=2), got {part.strip()!r}")
        if name in names:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if allowed is not None and name not in allowed:
            raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r} (expected one of {', '.join(allowed)})")
        if int(size) < 1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} must have size >= 1, got {size}")
        names.append(name)
        sizes.append(int(size))
    return names, sizes


def mesh_size(spec: str) -> int:
    """How many devices the mesh spec ``"name=size,..."`` needs."""
    return int(np.prod(_parse(spec)[1]))


def parse_mesh(spec: str, devices=None, *, allowed=None) -> Mesh:
    """``"name=size,name=size,..."`` -> a Mesh over the first prod(sizes) of ``devices``
    (default ``jax.devices()``), axes in the order written. ``allowed``: the axis names a
    caller accepts (others are an error)."""
    names, sizes = _parse(spec, allowed)
    devices = list(jax.devices() if devices is None else devices)
    need = int(np.prod(sizes))
    if need > len(devices):
        platform = devices[0].platform if devices else "?"
        raise ValueError(f"mesh {spec!r} needs {need} devices, but only {len(devices)} {platform} device(s) "
                         f"are visible")
    return Mesh(np.array(devices[:need]).reshape(sizes), tuple(names))


def batch_spec(mesh: Mesh) -> P:
    """Inputs split along their batch (first) axis over "data", replicated without one."""
    return P("data") if "data" in mesh.axis_names else P()


# parameter-name suffix -> which axis of the 2-D weight goes over "model", and what must
# divide by the model size for the split to fall on whole heads / units / tokens
_COLUMN = (".q.w", ".k.w", ".v.w")
_ROW = (".o.w",)
_FFN_COLUMN = (".gate.w", ".up.w")
_FFN_ROW = (".down.w",)


def param_specs(shapes: dict, mesh: Mesh, config=None) -> dict:
    """{param name: PartitionSpec} for parameters ``shapes`` ({name: shape}) of an RLX-graph
    model on ``mesh``. ``config``: the model's config (a TransformerConfig gives the head
    count that the attention splits must respect); without a "model" axis, or for names
    the rules do not know, parameters are replicated."""
    m = int(mesh.shape["model"]) if "model" in mesh.axis_names else 1
    heads = getattr(config, "heads", None)
    specs = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        spec = P()
        if m > 1 and len(shape) == 2:
            d_in, d_out = shape
            heads_ok = heads is not None and heads % m == 0
            if name.endswith(_COLUMN) and heads_ok:
                spec = P(None, "model")
            elif name.endswith(_ROW) and heads_ok:
                spec = P("model", None)
            elif name.endswith(_FFN_COLUMN) and d_out % m == 0:
                spec = P(None, "model")
            elif name.endswith(_FFN_ROW) and d_in % m == 0:
                spec = P("model", None)
            elif name == "head.w" and d_out % m == 0:
                spec = P(None, "model")
            elif name == "embed" and d_in % m == 0:
                spec = P("model", None)
        specs[name] = spec
    return specs


def param_shardings(params: dict, mesh: Mesh, config=None) -> dict:
    """{name: NamedSharding} for a dict of parameters (arrays or ShapeDtypeStructs)."""
    specs = param_specs({k: np.shape(v) for k, v in params.items()}, mesh, config)
    return {k: NamedSharding(mesh, s) for k, s in specs.items()}


def state_shardings(state, params: dict, shardings: dict, mesh: Mesh):
    """Shardings for an optimiser state pytree: a leaf found under a parameter's name with
    that parameter's shape (Adam's moments) takes the parameter's sharding, any other leaf
    (step counts) is replicated."""
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        for key in reversed(path):
            name = getattr(key, "key", None)
            if name in shardings and np.shape(leaf) == np.shape(params[name]):
                return shardings[name]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, state)
