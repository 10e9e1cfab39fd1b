"""The training path: model graphs, checkpoints (resume continues the exact curve),
the CLI's error handling. Small configurations keep it fast."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from rlx_jax.models import MLPConfig, TransformerConfig, cnn, mlp, transformer_lm
from rlx_jax.train import checkpoint, data
from rlx_jax.train.loop import TrainConfig
from rlx_jax.train.tasks import train_classifier, train_lm

TINY_LM = TransformerConfig(seq_len=16, layers=1, width=32, heads=2)


def _tiny_corpus():
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))
    ids = data.encode(text)
    cut = int(len(ids) * 0.9)
    return data.CharCorpus(train=ids[:cut], heldout=ids[cut:], source="synthetic")


def test_vocab_round_trip():
    # tabs become one space, characters outside the vocabulary become '?'
    assert data.decode(data.encode("def f(x):\n\treturn x  # é")) == "def f(x):\n return x  # ?"
    assert len(data.VOCAB) == 96 and data.encode("A")[0] == data.VOCAB.index("A")


def test_model_graphs_verify_and_declare_params():
    for model in (mlp(), cnn(), transformer_lm(TINY_LM)):
        g = model.build(3)
        g.verify()
        declared = {n.op.name for n in g.nodes if type(n.op).__name__ == "Param"}
        assert declared == set(model.param_shapes)
        params = model.init(jax.random.PRNGKey(0))
        assert all(params[k].shape == model.param_shapes[k][0] for k in params)


def test_checkpoint_round_trip_and_mismatch(tmp_path):
    state = {"a": np.arange(6.0, dtype=np.float32).reshape(2, 3), "b": [np.int32(3), np.ones(2)]}
    checkpoint.save(tmp_path / "ck", state, {"step": 5})
    restored, meta = checkpoint.load(tmp_path / "ck", state)
    assert meta["step"] == 5
    np.testing.assert_array_equal(restored["a"], state["a"])
    with pytest.raises(ValueError, match="expected"):
        checkpoint.load(tmp_path / "ck", {"a": np.zeros((3, 2), np.float32), "b": [np.int32(0), np.ones(2)]})
    # never a pickle: the arrays file loads with allow_pickle=False
    with np.load(tmp_path / "ck" / "arrays.npz", allow_pickle=False) as f:
        assert len(f.files) == 3


def test_lm_learns_and_resume_continues_the_same_curve(tmp_path):
    corpus = _tiny_corpus()
    base = dict(batch_size=8, lr=1e-2, warmup=2, eval_every=1000, eval_batches=2, progress=False,
                out_dir=str(tmp_path))
    full = train_lm(TrainConfig(steps=12, **base), TINY_LM, corpus)
    losses = [h["loss"] for h in full["history"]]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert full["evals"][-1]["heldout_loss"] < corpus.unigram_entropy() + 1.0
    assert isinstance(full["sample"], str) and len(full["sample"]) == 240
    # Ctrl-C during step 6 (raised where the batch is drawn), then resumed to 12
    ck = str(tmp_path / "ck")
    interrupted = train_lm(TrainConfig(steps=12, checkpoint=ck, **base), TINY_LM, _InterruptingCorpus(corpus, 5))
    assert interrupted["interrupted"] and interrupted["steps_done"] == 5
    assert checkpoint.exists(ck)
    resumed = train_lm(TrainConfig(steps=12, checkpoint=ck, **base), TINY_LM, corpus)
    assert not resumed["interrupted"]
    np.testing.assert_allclose([h["loss"] for h in resumed["history"]], losses, rtol=1e-5)


class _InterruptingCorpus(data.CharCorpus):
    """Raises KeyboardInterrupt (as Ctrl-C would) when training batch number ``after``
    is drawn."""

    def __init__(self, corpus, after):
        super().__init__(corpus.train, corpus.heldout, corpus.source)
        self.after, self.drawn = after, 0

    def batch(self, rng, batch, seq_len, split="train"):
        if split == "train":
            if self.drawn == self.after:
                raise KeyboardInterrupt
            self.drawn += 1
        return super().batch(rng, batch, seq_len, split)


def _mlp_run(ckpt=None, evaluate_hook=None, step_hook=None):
    """30 steps of a small MLP through ``run_steps``, evaluated every 10 steps. ``evaluate_hook(n)``
    runs before the n-th evaluation and ``step_hook(n, loss)`` replaces the n-th step's loss (both
    counted from 1): they simulate a Ctrl-C landing there."""
    from rlx_jax.train import loop

    model = mlp(MLPConfig(in_features=8, hidden=(16,), num_classes=3))
    graph = model.build(4)
    calls = {"evaluate": 0, "step": 0}

    def batch_fn(rng):
        return {"x": rng.normal(size=(4, 8)).astype(np.float32), "labels": rng.integers(0, 3, 4).astype(np.float32)}

    def evaluate(params):
        calls["evaluate"] += 1
        if evaluate_hook:
            evaluate_hook(calls["evaluate"])
        return {"test_loss": float(sum(np.sum(np.square(v)) for v in jax.tree.leaves(params)))}

    real_make_step = loop.make_step

    def make_step(*args, **kwargs):
        step_fn = real_make_step(*args, **kwargs)

        def step(*inputs):
            calls["step"] += 1
            params, state, loss = step_fn(*inputs)
            return params, state, (step_hook(calls["step"], loss) if step_hook else loss)

        return step

    cfg = TrainConfig(steps=30, batch_size=4, eval_every=10, checkpoint_every=10, progress=False, checkpoint=ckpt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "make_step", make_step)
        return loop.run_steps(name="mlp", graph=graph, model=model, cfg=cfg, batch_fn=batch_fn, evaluate=evaluate,
                              tokens_per_step=4, meta_extra={"config": {}})


def _assert_same_run(resumed, full):
    assert not resumed["interrupted"] and resumed["steps_done"] == full["steps_done"] == 30
    assert [h["step"] for h in resumed["history"]] == list(range(30))
    np.testing.assert_allclose([h["loss"] for h in resumed["history"]], [h["loss"] for h in full["history"]],
                               rtol=1e-6)
    assert [e["step"] for e in resumed["evals"]] == [e["step"] for e in full["evals"]] == [10, 20, 30]
    np.testing.assert_allclose([e["test_loss"] for e in resumed["evals"]], [e["test_loss"] for e in full["evals"]],
                               rtol=1e-6)
    for name in full["params"]:
        np.testing.assert_allclose(resumed["params"][name], full["params"][name], rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def mlp_full_run():
    return _mlp_run()


@pytest.mark.parametrize("interrupted_eval", [2, 3])  # at step 20, and the final one at step 30
def test_resume_redoes_an_evaluation_interrupted_by_ctrl_c(tmp_path, mlp_full_run, interrupted_eval):
    """Ctrl-C during the evaluation after step n: the checkpoint holds n steps, and the resumed run
    evaluates step n before training on (never repeating step n), so its evals, held-out loss and
    parameters are an uninterrupted run's. An interrupt in the final evaluation used to leave a
    finished run with no final evaluation."""
    ck = str(tmp_path / "ck")

    def ctrl_c(n):
        if n == interrupted_eval:
            raise KeyboardInterrupt

    part = _mlp_run(ck, evaluate_hook=ctrl_c)
    assert part["interrupted"] and part["steps_done"] == 10 * interrupted_eval
    assert [e["step"] for e in part["evals"]] == [10 * n for n in range(1, interrupted_eval)]
    _assert_same_run(_mlp_run(ck), mlp_full_run)
    # the checkpoint of the finished run holds the evaluation too: nothing left to redo
    assert json.loads((tmp_path / "ck" / "state.json").read_text())["evals"][-1]["step"] == 30
    assert [e["step"] for e in _mlp_run(ck)["evals"]] == [10, 20, 30]


def test_resume_after_ctrl_c_while_a_step_runs_does_not_repeat_it(tmp_path, mlp_full_run):
    """The step runs asynchronously and reading its loss waits for it, where a Ctrl-C most often
    lands: the checkpoint must then hold the parameters from before that step, not the updated
    ones under the previous step count (the resumed run would apply the step twice)."""
    ck = str(tmp_path / "ck")

    class InterruptedLoss:
        def __float__(self):
            raise KeyboardInterrupt

    part = _mlp_run(ck, step_hook=lambda n, loss: InterruptedLoss() if n == 15 else loss)
    assert part["interrupted"] and part["steps_done"] == 14
    _assert_same_run(_mlp_run(ck), mlp_full_run)


def test_fused_and_unfused_training_agree(tmp_path):
    corpus = _tiny_corpus()
    base = dict(steps=4, batch_size=4, eval_every=1000, eval_batches=1, progress=False, out_dir=str(tmp_path))
    fused = train_lm(TrainConfig(fused=True, **base), TINY_LM, corpus)
    plain = train_lm(TrainConfig(fused=False, **base), TINY_LM, corpus)
    np.testing.assert_allclose([h["loss"] for h in fused["history"]], [h["loss"] for h in plain["history"]],
                               rtol=2e-3)


def test_cnn_on_digits_learns(tmp_path):
    rec = train_classifier(TrainConfig(steps=150, batch_size=64, lr=3e-3, eval_every=150, progress=False,
                                       out_dir=str(tmp_path)), "cnn")
    assert rec["evals"][-1]["test_accuracy"] > 0.85


@pytest.mark.slow
def test_cnn_reaches_95_percent(tmp_path):
    rec = train_classifier(TrainConfig(steps=600, batch_size=64, lr=2e-3, eval_every=600, progress=False,
                                       out_dir=str(tmp_path)), "cnn")
    assert rec["evals"][-1]["test_accuracy"] >= 0.95


def _cli(*args):
    # from tests/, so `python -m` imports the installed package, not the source tree's
    return subprocess.run([sys.executable, "-m", "rlx_jax", *args], capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent, timeout=300)


def test_cli_errors_are_one_line_without_traceback(tmp_path):
    r = _cli("grad", str(tmp_path / "missing.json"), "--wrt", "w")
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli("grad", str(bad), "--wrt", "w")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip()
    r = _cli("train", "--steps", "0")
    assert r.returncode == 2 and "--steps must be positive" in r.stderr


def test_checkpoint_never_replaces_a_folder_or_file_that_is_not_one(tmp_path):
    mine = tmp_path / "myproject"
    (mine / "src").mkdir(parents=True)
    (mine / "src" / "main.py").write_text("print('hi')")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    for path in (mine, notes, notes / "ck"):
        with pytest.raises(ValueError, match="not an rlx_jax checkpoint|is a file"):
            checkpoint.save(path, {"a": np.zeros(2)}, {"step": 1})
    assert (mine / "src" / "main.py").read_text() == "print('hi')" and notes.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myproject", "notes.txt"]
    # the CLI refuses before training, in one line
    r = _cli("train", "--steps", "2", "--checkpoint", str(mine), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not an rlx_jax checkpoint" in r.stderr and "Traceback" not in r.stderr
    assert (mine / "src" / "main.py").is_file() and not (tmp_path / "o").exists()


def test_resume_refuses_another_schedule_and_never_rewinds(tmp_path):
    corpus = _tiny_corpus()
    base = dict(batch_size=2, warmup=1, eval_every=1000, eval_batches=1, progress=False, out_dir=str(tmp_path),
                checkpoint=str(tmp_path / "ck"))
    tiny = TransformerConfig(seq_len=8, layers=1, width=16, heads=2)
    train_lm(TrainConfig(steps=3, lr=1e-2, **base), tiny, corpus)
    for other in (dict(steps=2, lr=1e-2), dict(steps=5, lr=1e-2), dict(steps=3, lr=2e-2)):
        with pytest.raises(ValueError, match="different run"):
            train_lm(TrainConfig(**other, **base), tiny, corpus)
    again = train_lm(TrainConfig(steps=3, lr=1e-2, **base), tiny, corpus)  # finished: nothing to do
    assert again["steps_done"] == 3 and json.loads((tmp_path / "ck" / "state.json").read_text())["step"] == 3


def test_cli_train_checks_its_numbers_and_paths_first(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    tiny = ("train", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--layers", "1", "--width", "16",
            "--heads", "2", "--no-progress")
    for args, message in ((("--lr", "0"), "--lr must be a positive"), (("--lr", "nan"), "--lr must be a positive"),
                          (("--seed", "-1"), "--seed must be >= 0"), (("--out", str(afile)), "is a file"),
                          (("--checkpoint", str(afile / "ck")), "is a file")):
        r = _cli(*tiny, *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    # the classifiers take --lr as given (it was read as `args.lr or 2e-3`)
    r = _cli("train", "--model", "mlp", "--steps", "2", "--lr", "1e-9", "--no-progress", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o" / "mlp.json").read_text())["lr"] == 1e-9


def test_cli_train_writes_log_and_plot(tmp_path):
    r = _cli("train", "--model", "mlp", "--steps", "20", "--no-progress", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "test accuracy" in r.stdout
    log = json.loads((tmp_path / "mlp.json").read_text())
    assert log["steps_done"] == 20 and len(log["history"]) == 20
    assert (tmp_path / "mlp_loss.png").stat().st_size > 1000


def test_bf16_step_keeps_f32_master_weights_and_tracks_the_f32_step():
    from rlx_jax.train.loop import make_optimizer, make_step

    model = transformer_lm(TINY_LM)
    graph = model.build(4)
    optimizer = make_optimizer(TrainConfig(steps=50, warmup=1))
    params = model.init(jax.random.PRNGKey(0))
    state = optimizer.init(params)
    tokens, labels = _tiny_corpus().batch(np.random.default_rng(0), 4, TINY_LM.seq_len)
    inputs = {"tokens": tokens, "labels": labels}
    out = {}
    for precision in ("f32", "bf16"):
        step = make_step(graph, optimizer, True, precision=precision)
        assert ("bf16[" in step.as_text()) == (precision == "bf16")
        out[precision] = step(params, state, inputs)
    new_params, new_state, loss = out["bf16"]
    assert loss.dtype == np.float32
    for leaf in jax.tree.leaves((new_params, new_state)):
        if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
            assert leaf.dtype == np.float32
    assert abs(float(loss) - float(out["f32"][2])) < 2e-2 * float(out["f32"][2])
    assert float(loss) != float(out["f32"][2])  # the step really ran in bf16
    # the loss is the f32 mean of the bf16 rows' losses, not that mean rounded to bf16
    assert float(loss) != float(jax.numpy.asarray(loss, jax.numpy.bfloat16))
    # the first moments are the (clipped) gradients' scale: bf16 and f32 agree to bf16 accuracy
    mu = lambda st: jax.tree.leaves(st[1][0].mu)
    for a, b in zip(mu(new_state), mu(out["f32"][1])):
        np.testing.assert_allclose(a, b, rtol=0.1, atol=0.05 * float(np.max(np.abs(b))) + 1e-12)
    with pytest.raises(ValueError, match="precision"):
        make_step(graph, optimizer, True, precision="fp8")
