"""A small CNN classifier on NCHW images:
[conv3x3 -> GroupNorm -> ReLU -> MaxPool2x2] x len(channels) -> dense -> logits."""

from __future__ import annotations

import dataclasses

from rlx_jax.ir import Graph
from rlx_jax.models.base import Model, ParamRecorder, dense, fan_in_std, mean_cross_entropy


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 1
    image_size: int = 8
    channels: tuple = (16, 32)
    groups: int = 4
    num_classes: int = 10


def cnn(config: CNNConfig = CNNConfig()) -> Model:
    shapes: dict = {}

    def build(batch: int) -> Graph:
        g = Graph("cnn")
        p = ParamRecorder(g, shapes)
        size, c_in = config.image_size, config.in_channels
        h = g.input("x", [batch, c_in, size, size], "f32")
        labels = g.input("labels", [batch], "f32")
        for i, c_out in enumerate(config.channels):
            w = p(f"conv{i}.w", (c_out, c_in, 3, 3), fan_in_std(c_in * 9))
            h = g.conv2d(h, w, (3, 3), (1, 1), (1, 1))
            h = g.group_norm(h, p(f"norm{i}.gamma", (c_out,), "ones"), p(f"norm{i}.beta", (c_out,), "zeros"),
                             config.groups)
            h = g.max_pool2d(g.relu(h), (2, 2), (2, 2))
            size, c_in = size // 2, c_out
        flat = c_in * size * size
        h = g.reshape(h, [batch, flat])
        logits = dense(g, p, h, "head", flat, config.num_classes)
        g.set_outputs([mean_cross_entropy(g, logits, labels), logits])
        return g

    build(1)
    return Model("cnn", config, build, shapes)
