"""Model builders that emit RLX graphs with named parameters and an initialiser.

Each builder returns a :class:`Model`: ``build(batch)`` gives the graph whose outputs are
``[loss, logits]`` (loss = mean softmax cross-entropy over the rows; labels are f32-encoded
class ids, as RLX's SoftmaxCrossEntropyWithLogits takes them), and ``init(key)`` the
parameters as ``{name: array}``.
"""

from rlx_jax.models.base import Model
from rlx_jax.models.cnn import CNNConfig, cnn
from rlx_jax.models.mlp import MLPConfig, mlp
from rlx_jax.models.transformer import TransformerConfig, transformer_lm

__all__ = ["Model", "MLPConfig", "mlp", "CNNConfig", "cnn", "TransformerConfig", "transformer_lm"]
