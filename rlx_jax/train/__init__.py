"""Training RLX graphs: data, the training loop, checkpoints (used by ``rlx-jax train``)."""
