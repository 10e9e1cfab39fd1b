"""Writes the .ipynb notebooks from the cell sources below (outputs stripped).

    python notebooks/make_notebooks.py

Each notebook reads RLX_JAX_QUICK=1 (set by the tests) to run a short version; its key
cells assert results, so executing it is a test.
"""

from __future__ import annotations

import pathlib

import nbformat

HERE = pathlib.Path(__file__).parent

SETUP = """import os
QUICK = os.environ.get("RLX_JAX_QUICK") == "1"   # the tests run a short version
import jax, jax.numpy as jnp, numpy as np
import rlx_jax
print(rlx_jax.__version__, jax.__version__, jax.devices())"""

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        ("md", "# rlx_jax quickstart\n\nBuild an RLX graph, run it through JAX, and get its gradient two ways: "
               "RLX-style graph autodiff (`grad_with_loss`) and `jax.grad` of the lowered function."),
        ("code", SETUP),
        ("md", "## A graph: a two-layer MLP with an RMSNorm and a cross-entropy loss"),
        ("code", """g = rlx_jax.Graph("mlp")
x = g.input("x", [8, 16], "f32")
labels = g.input("labels", [8], "f32")          # RLX takes class ids as f32
w1 = g.param("w1", [16, 32], "f32"); w2 = g.param("w2", [32, 4], "f32")
gamma = g.param("gamma", [32], "f32"); beta = g.param("beta", [32], "f32")
h = g.rms_norm(g.relu(g.matmul(x, w1)), gamma, beta)
logits = g.matmul(h, w2)
loss = g.mean(g.softmax_cross_entropy_with_logits(logits, labels), [0])
g.set_outputs([loss])
g.verify()
print(g)"""),
        ("code", """key = jax.random.PRNGKey(0)
k1, k2, k3 = jax.random.split(key, 3)
params = {"w1": 0.3 * jax.random.normal(k1, (16, 32)), "w2": 0.3 * jax.random.normal(k2, (32, 4)),
          "gamma": jnp.ones(32), "beta": jnp.zeros(32)}
inputs = {"x": jax.random.normal(k3, (8, 16)), "labels": jnp.arange(8, dtype=jnp.float32) % 4}
fn = rlx_jax.to_jax(g)
print("loss", fn(params, inputs)[0])"""),
        ("md", "## Gradients, two doors\n\n`jax.grad` of the lowered function, and `grad_with_loss`, which returns an "
               "ordinary RLX graph of backward ops (printable, serialisable, runnable)."),
        ("code", """jax_grads = jax.grad(lambda p: fn(p, inputs)[0])(params)

gg = rlx_jax.grad_with_loss(g, ["w1", "w2", "gamma", "beta"])
outs = rlx_jax.to_jax(gg)(params, {**inputs, "d_output": jnp.ones(())})
rlx_grads = dict(zip(["w1", "w2", "gamma", "beta"], outs[1:]))
for name in rlx_grads:
    err = float(jnp.max(jnp.abs(rlx_grads[name] - jax_grads[name])))
    print(f"{name}: max |grad_with_loss - jax.grad| = {err:.2e}")
    assert err < 1e-5
print(sum(type(n.op).__name__.endswith("Backward") or "Backward" in type(n.op).__name__ for n in gg.nodes),
      "backward nodes in the gradient graph")"""),
        ("md", "## Fused ops in plain JAX code, checked in every autodiff mode"),
        ("code", """from jax.test_util import check_grads
from rlx_jax.ops import rms_norm
jax.config.update("jax_enable_x64", True)   # check_grads wants float64
try:
    xs = jax.random.normal(key, (4, 6), jnp.float64)
    check_grads(lambda x, g: rms_norm(x, g), (xs, jnp.linspace(0.5, 1.5, 6)), order=2, modes=("fwd", "rev"))
finally:
    jax.config.update("jax_enable_x64", False)
print("check_grads passed (fwd + rev, second order)")
print("compiled kernels:", rlx_jax.kernel_info()["cpu"]["targets"])"""),
    ],
    "02_train_transformer.ipynb": [
        ("md", "# Training a transformer LM from an RLX graph\n\nThe model is an RLX graph (embedding gather, "
               "RMSNorm, RoPE, causal attention, SwiGLU, softmax cross-entropy); gradients come from `jax.grad` "
               "of `to_jax(graph)`, which runs the fused backward kernels. We train it on Python's own standard "
               "library, character by character, fused and with plain XLA autodiff, and compare."),
        ("code", SETUP),
        ("code", """import pathlib, tempfile
from rlx_jax.models import TransformerConfig
from rlx_jax.train import data
from rlx_jax.train.loop import TrainConfig
from rlx_jax.train.tasks import train_lm
corpus = data.stdlib_corpus(max_chars=300_000 if QUICK else 3_000_000)
model_cfg = TransformerConfig(seq_len=32, layers=1, width=64, heads=2) if QUICK else TransformerConfig()
steps = 40 if QUICK else 400
out = tempfile.mkdtemp()
runs = {}
for fused in (True, False):
    cfg = TrainConfig(steps=steps, batch_size=16, fused=fused, eval_every=steps, progress=False, out_dir=out)
    runs[fused] = train_lm(cfg, model_cfg, corpus)
    print("fused" if fused else "plain XLA", f"{runs[fused]['tokens_per_s']:,.0f} tokens/s",
          "held-out loss", round(runs[fused]["evals"][-1]["heldout_loss"], 3))"""),
        ("code", """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3.5))
for fused, rec in runs.items():
    ax.plot([h["loss"] for h in rec["history"]], label="fused kernels" if fused else "plain XLA autodiff")
ax.axhline(corpus.unigram_entropy(), ls="--", c="gray", label="unigram baseline")
ax.set_xlabel("step"); ax.set_ylabel("loss (nats/char)"); ax.legend(); plt.show()
first, last = runs[True]["history"][0]["loss"], runs[True]["history"][-1]["loss"]
assert last < first - 0.5, (first, last)
# both gradient paths train the same model: the curves agree to rounding
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs[True]["history"], runs[False]["history"]))
print("max loss difference fused vs plain:", diff)
assert diff < 0.05"""),
        ("code", """print("prompt:", repr(runs[True]["sample_prompt"][-40:]))
print("sample:", runs[True]["sample"])
if not QUICK:
    assert runs[True]["evals"][-1]["heldout_loss"] < corpus.unigram_entropy()"""),
    ],
    "03_kernels.ipynb": [
        ("md", "# The fused kernels: speed ratios\n\nEach benchmark case times our op, XLA's autodiff of the "
               "pure-JAX reference, and a copy of the same bytes, in one run, and checks they agree first. "
               "Quick mode uses small shapes, so its ratios say little; run `python -m benchmarks.run` for the "
               "real figures."),
        ("code", SETUP),
        ("code", """import sys, pathlib
sys.path.insert(0, str(pathlib.Path.cwd().parent))   # the repository root holds benchmarks/
from benchmarks import cases_rms_norm
from benchmarks.harness import run_case
device = jax.devices()[0]
cases = [cases_rms_norm._case(512, 256, jnp.float32)] if QUICK else cases_rms_norm.cases("cpu")
rows = [run_case(c, device, reps=3 if QUICK else 20) for c in cases]
for r in rows:
    print(f"{r['case']:40s} XLA/ours {r['xla_over_ours']:.2f}  ours/copy {r['ours_over_floor']:.2f}")
assert all(r["ours_ms"] > 0 for r in rows)"""),
        ("code", """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3))
names = [r["case"] for r in rows]
ax.barh(names, [r["xla_over_ours"] for r in rows], label="XLA time / ours")
ax.barh(names, [1 / r["ours_over_floor"] for r in rows], alpha=0.5, label="copy time / ours")
ax.axvline(1, c="k", lw=0.5); ax.legend(); plt.show()"""),
    ],
    "04_from_pyrlx.ipynb": [
        ("md", "# Moving from pyrlx\n\nCode written against RLX's Python binding runs after `import rlx_jax as rlx`: "
               "same builder names, argument order and defaults, a `Session` with `compile`/`set_param`/`run`."),
        ("code", SETUP),
        ("code", """import rlx_jax as rlx
g = rlx.Graph("pyrlx_style")
x = g.input("x", [2, 3], "f32")
w = g.param("w", [3, 4], "f32")
y = g.gelu(g.matmul(x, w))
out = g.sum(y, [1], False)
g.set_outputs([out])
print(g.shape_of(out))
assert g.shape_of(out) == ([2], "f32")"""),
        ("code", """sess = rlx.Session(device="cpu", precision="f32")
c = sess.compile(g)
c.set_param("w", np.full((3, 4), 0.5, np.float32))
(res,) = c.run({"x": np.ones((2, 3), np.float32)})
expected = np.sum(np.asarray(jax.nn.gelu(np.ones((2, 3)) @ np.full((3, 4), 0.5), approximate=False)), axis=1)
print(res, expected)
np.testing.assert_allclose(res, expected, rtol=1e-5)"""),
        ("code", """gg = rlx.grad(g, ["w"])                 # pyrlx semantics: outputs [loss, grads...]
print(len(gg), "nodes;", [gg.shape_of(o) for o in gg.outputs])
text = gg.to_json()
again = rlx.Graph.from_json(text)       # the RLX serde format: loads in Rust RLX too
assert again.to_json() == text
print(str(again).splitlines()[0])"""),
        ("md", "pyrlx's session rules hold too (docs/FROM_PYRLX.md lists them and the few deliberate "
               "differences): `compile` consumes the graph, `run` returns float32 with rank-0 outputs "
               "shaped `(1,)`, device aliases and precision spellings are pyrlx's, and a backend "
               "rlx_jax lacks is reported, not guessed."),
        ("code", """print({d: rlx.is_available(d) for d in ("cpu", "cuda", "mlx", "mtl", "vk")})
try:
    sess.compile(g)                     # g was consumed by the first compile
except RuntimeError as e:
    print("RuntimeError:", e)
h = rlx.Graph("scalar")
v = h.input("v", [3], "i32")
h.set_outputs([h.sum(h.cast(v, "f32"), [0], False)])
(total,) = rlx.Session("cpu", precision="half").compile(h).run({"v": np.arange(3, dtype=np.int32)})
print(total, total.shape, total.dtype)
assert total.shape == (1,) and total.dtype == np.float32 and total[0] == 3.0"""),
    ],
    "05_gaussian_splatting.ipynb": [
        ("md", "# Differentiable 3-D Gaussian splatting\n\nFit a few thousand Gaussians to a procedurally generated "
               "target image with optax: `rlx_jax.ops.gaussian_splat_render` renders (fused C++/CUDA kernels: "
               "projection, SH colour, tile binning, per-tile depth sort, front-to-back compositing) and its "
               "fused backward gives the gradients of all six scene inputs. The code is `examples/fit_gaussians.py`; "
               "quick mode fits 900 Gaussians for 60 steps and must pass 28 dB PSNR (full mode: 2500 Gaussians, "
               "300 steps, 35 dB)."),
        ("code", SETUP),
        ("code", """import sys, pathlib
sys.path.insert(0, str(pathlib.Path.cwd().parent / "examples"))
import fit_gaussians as fg
print(rlx_jax.kernel_info()["cpu"]["loaded"], fg.GRID ** 2, "Gaussians,", fg.SIZE, "px,", fg.STEPS, "steps")
scene, losses, final_psnr, target = fg.fit()
print(f"PSNR {float(fg.psnr(losses[0])):.2f} dB -> {final_psnr:.2f} dB (threshold {fg.PSNR_TARGET} dB)")
assert final_psnr > fg.PSNR_TARGET"""),
        ("code", """import matplotlib.pyplot as plt
img = np.asarray(fg.render(scene))
fig, ax = plt.subplots(1, 3, figsize=(11, 3.4))
ax[0].imshow(target, origin="lower"); ax[0].set_title("target")
ax[1].imshow(np.clip(img[..., :3], 0, 1), origin="lower"); ax[1].set_title(f"render, {final_psnr:.1f} dB")
ax[2].semilogy(losses); ax[2].set_xlabel("step"); ax[2].set_ylabel("RGB MSE"); ax[2].set_title("loss")
plt.tight_layout(); plt.show()"""),
    ],
}


def build() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                    for kind, src in cells]
        nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    build()
