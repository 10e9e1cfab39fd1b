"""The Model record shared by the builders, and the parameter initialisers."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax.ir import Graph


@dataclasses.dataclass(frozen=True)
class Model:
    """``build(batch) -> Graph`` with outputs [loss, logits]; ``param_shapes`` maps each
    parameter name to (shape, init) where init is "normal:<std>", "ones" or "zeros"."""

    name: str
    config: object
    build: Callable[[int], Graph]
    param_shapes: dict

    def init(self, key) -> dict[str, jax.Array]:
        """Parameters in f32, drawn in sorted-name order (reproducible for a key)."""
        params = {}
        names = sorted(self.param_shapes)
        keys = jax.random.split(key, len(names))
        for k, name in zip(keys, names):
            shape, init = self.param_shapes[name]
            if init == "ones":
                params[name] = jnp.ones(shape, jnp.float32)
            elif init == "zeros":
                params[name] = jnp.zeros(shape, jnp.float32)
            elif init.startswith("normal:"):
                params[name] = float(init.split(":", 1)[1]) * jax.random.normal(k, shape, jnp.float32)
            else:
                raise ValueError(f"unknown initialiser {init!r} for parameter {name!r}")
        return params

    def num_params(self) -> int:
        return int(sum(np.prod(shape) for shape, _ in self.param_shapes.values()))


class ParamRecorder:
    """Declares parameters on a graph and records their initialisers."""

    def __init__(self, graph: Graph, shapes: dict):
        self.graph = graph
        self.shapes = shapes

    def __call__(self, name: str, shape, init: str) -> int:
        shape = tuple(int(d) for d in shape)
        previous = self.shapes.setdefault(name, (shape, init))
        if previous != (shape, init):
            raise ValueError(f"parameter {name!r} declared twice with different shapes/initialisers")
        return self.graph.param(name, list(shape), "f32")


def fan_in_std(fan_in: int) -> str:
    return f"normal:{1.0 / np.sqrt(fan_in):.6g}"


def dense(g: Graph, p: ParamRecorder, x: int, name: str, d_in: int, d_out: int, bias: bool = True) -> int:
    """x @ W (+ b): W [d_in, d_out] ~ N(0, 1/d_in), b zeros."""
    y = g.matmul(x, p(f"{name}.w", (d_in, d_out), fan_in_std(d_in)))
    if bias:
        y = g.add(y, p(f"{name}.b", (d_out,), "zeros"))
    return y


def mean_cross_entropy(g: Graph, logits: int, labels: int) -> int:
    """Mean over rows of softmax cross-entropy: logits [N, C], labels [N] (f32 ids)."""
    return g.mean(g.softmax_cross_entropy_with_logits(logits, labels), [0])
