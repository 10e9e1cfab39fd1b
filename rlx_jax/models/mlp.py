"""A multilayer perceptron classifier: x [B, D_in] -> ReLU layers -> logits [B, C]."""

from __future__ import annotations

import dataclasses

from rlx_jax.ir import Graph
from rlx_jax.models.base import Model, ParamRecorder, dense, mean_cross_entropy


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    in_features: int = 64
    hidden: tuple = (128, 128)
    num_classes: int = 10


def mlp(config: MLPConfig = MLPConfig()) -> Model:
    shapes: dict = {}

    def build(batch: int) -> Graph:
        g = Graph("mlp")
        p = ParamRecorder(g, shapes)
        x = g.input("x", [batch, config.in_features], "f32")
        labels = g.input("labels", [batch], "f32")
        h, d = x, config.in_features
        for i, width in enumerate(config.hidden):
            h = g.relu(dense(g, p, h, f"layer{i}", d, width))
            d = width
        logits = dense(g, p, h, "head", d, config.num_classes)
        g.set_outputs([mean_cross_entropy(g, logits, labels), logits])
        return g

    build(1)  # declares the parameters
    return Model("mlp", config, build, shapes)
