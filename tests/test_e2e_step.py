"""benchmarks/e2e_step.py in quick mode (tiny shapes; agreement and determinism, never time)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testutil import load_script

_e2e = load_script(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_step.py",
                   "rlx_benchmarks_e2e_step")


def test_quick_mode_rlx_step_and_train_rows_agree_with_plain_jax(tmp_path):
    out = tmp_path / "e2e.json"
    rc = _e2e.main(["--preset", "tiny", "--quick", "--variants", "rlx,plain-xla+embed", "--train", "tiny",
                    "--json", str(out)])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain-xla", "rlx", "plain-xla+embed", "train-fused", "train-nofused"}
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["deterministic"], name
        assert row["loss_rel_diff"] < 1e-5 and row["grad_rel_err"] < 1e-4, row
        assert row["temp_bytes"] is None or row["temp_bytes"] >= 0
    # a uniform-ish initial model: the loss is near log(vocab), not a constant
    assert abs(rows["rlx"]["loss"] - np.log(512)) < 0.5
    assert rows["rlx"]["grad_norm"] > 0


def test_agreement_reports_a_wrong_gradient():
    g = {"a": np.ones(4, np.float32), "b": np.full((2, 2), 2.0, np.float32)}
    same = _e2e.agreement((1.0, g), (1.0, g))
    assert same["loss_rel_diff"] == 0 and same["grad_rel_err"] == 0
    wrong = dict(g, a=g["a"] * 1.1)
    rep = _e2e.agreement((1.01, wrong), (1.0, g))
    assert rep["loss_rel_diff"] == pytest.approx(0.01)
    assert rep["grad_rel_err"] == pytest.approx(0.2 / np.sqrt(20.0), rel=1e-6)
    assert not _e2e._agrees({"compute_dtype": "float32", **rep})
    assert _e2e._agrees({"compute_dtype": "float32", **same})
    assert _e2e._agrees({"compute_dtype": "bfloat16", **rep})  # within bf16 tolerance


def test_rlx_rope_and_loss_wrappers_match_the_plain_forms():
    kx, kh, kw = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(kx, (2, 7, 3, 10))
    from rlx_jax.models.transformer import rope_tables

    cos, sin = (jnp.asarray(t) for t in rope_tables(7, 10, 10000.0))
    np.testing.assert_allclose(_e2e._rlx_rope(x, cos, sin), _e2e._jax_rope(x, cos, sin), rtol=1e-5, atol=1e-6)
    h, w = jax.random.normal(kh, (9, 6)), jax.random.normal(kw, (6, 13))
    labels = jnp.arange(9, dtype=jnp.int32) % 13
    np.testing.assert_allclose(_e2e._rlx_loss(h, w, labels), _e2e._jax_loss(h, w, labels), rtol=1e-5)
    got = jax.grad(_e2e._rlx_loss, (0, 1))(h, w, labels)
    want = jax.grad(_e2e._jax_loss, (0, 1))(h, w, labels)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # bf16: the rlx head's logits blocks in bf16 (as the plain head's h @ w), f32 with f32_logits
    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    for f32, want in ((False, "logits_dtype=bfloat16"), (True, "logits_dtype=None")):
        jaxpr = str(jax.make_jaxpr(lambda h, w: _e2e._rlx_loss(h, w, labels, f32_logits=f32))(hb, wb))
        assert want in jaxpr, jaxpr
    # --head-chunk: the head's row blocks as asked (4 rows: blocks of 4, 4 and 1), same loss
    jaxpr = str(jax.make_jaxpr(lambda h, w: _e2e._rlx_loss(h, w, labels, chunk=4))(h, w))
    assert "chunk_size=4" in jaxpr, jaxpr
    np.testing.assert_allclose(_e2e._rlx_loss(h, w, labels, chunk=4), _e2e._rlx_loss(h, w, labels), rtol=1e-6)


def test_model_flops_and_bad_shapes():
    s = _e2e.Shape(**_e2e.PRESETS["llama-v32k"])
    n = sum(int(np.prod(v)) for k, v in _e2e.param_shapes(s).items() if k != "embed")
    assert _e2e.model_flops(s) == 6.0 * n * s.tokens + 6.0 * 4 * 16 * 128 * 2048 * s.tokens
    with pytest.raises(ValueError, match="kv-heads"):
        _e2e.Shape(**dict(_e2e.PRESETS["tiny"], kv_heads=3))
    with pytest.raises(ValueError, match="head-dim"):
        _e2e.Shape(**dict(_e2e.PRESETS["tiny"], head_dim=15))
    with pytest.raises(ValueError, match="head-chunk"):
        _e2e.parse_args(["--preset", "tiny", "--head-chunk", "0"])
    assert _e2e.parse_args(["--preset", "tiny", "--head-chunk", "32"]).shape.head_chunk == 32
    assert _e2e.parse_args(["--preset", "tiny"]).shape.head_chunk is None


def test_round_speedups_and_their_range_in_the_table():
    assert _e2e.round_speedups([10.0, 12.0, 9.0], [5.0, 8.0, 9.0]) == [2.0, 1.5, 1.0]
    assert _e2e.round_speedups(None, [1.0]) is None
    row = {"variant": "rlx", "ms": 8.0, "ref_ms": 10.0, "speedup_rounds": [2.0, 1.5, 1.0], "sync_ms": 9.0,
           "ref_sync_ms": 9.9, "tokens_per_s": 1.0, "loss": 1.0, "loss_rel_diff": 0.0, "grad_norm_rel_diff": 0.0, "grad_rel_err": 0.0, "deterministic": True}
    line = _e2e.format_table([row], "h").splitlines()[-1]
    assert "| 1.250x | 1.00-2.00 | 9.00 | 1.100x |" in line, line
    row |= {"cpu_ms": 4.0, "ref_cpu_ms": 6.0, "cpu_speedup_rounds": [1.25, 1.75]}
    table = _e2e.format_table([row], "h", cpu_clock=True).splitlines()
    assert "| round range | sync ms | sync speedup | cpu ms | cpu speedup | cpu range |" in table[1]
    assert "| 1.250x | 1.00-2.00 | 9.00 | 1.100x | 4.00 | 1.500x | 1.25-1.75 |" in table[-1], table[-1]


def test_time_rounds_times_back_to_back_and_waited_steps():
    """Per round: reps launches before one wait, then reps waited steps; every row gets the
    medians and per-round times of both clocks."""
    import jax.numpy as jnp

    calls = {"a": 0, "b": 0}

    def launcher(name):
        def launch():
            calls[name] += 1
            return jnp.zeros(())
        return launch

    runners = [_e2e.Runner(n, launcher(n), None, 1, 1.0, None) for n in calls]
    _e2e.time_rounds(runners, rounds=3, reps=2)
    assert calls == {"a": 1 + 3 * 2 * 2, "b": 1 + 3 * 2 * 2}  # a warm step, then 2 x reps a round
    for r in runners:
        for key in ("ms", "sync_ms", "cpu_ms"):
            assert len(r.row[f"{key}_rounds"]) == 3 and r.row[key] >= 0


def test_processes_summarise_each_process_speedup():
    runs = [[{"variant": "plain-xla", "ms": 10.0, "ref_ms": 10.0},
             {"variant": "rlx", "ms": 8.0, "ref_ms": 10.0, "sync_ms": 9.0, "ref_sync_ms": 9.0, "temp_bytes": 2**30}],
            [{"variant": "plain-xla", "ms": 12.0, "ref_ms": 12.0},
             {"variant": "rlx", "ms": 10.0, "ref_ms": 12.0, "temp_bytes": 3 * 2**29}],
            [{"variant": "plain-xla", "ms": 11.0, "ref_ms": 11.0}, {"variant": "rlx", "error": "OOM"}]]
    summary = {r["variant"]: r for r in _e2e.process_summary(runs)}
    assert summary["rlx"]["speedups"] == [1.25, 1.2, None]
    assert summary["rlx"]["speedup_median"] == pytest.approx(1.225)
    assert summary["rlx"]["ms_median"] == 9.0
    assert summary["plain-xla"]["speedups"] == [1.0, 1.0, 1.0] and summary["plain-xla"]["ms_median"] == 11.0
    table = _e2e.format_process_summary(list(summary.values()), 3)
    assert summary["rlx"]["sync_speedup_median"] == 1.0 and summary["plain-xla"]["sync_speedup_median"] is None
    assert summary["rlx"]["temp_bytes"] == [2**30, 3 * 2**29, None]
    assert summary["rlx"]["joule_ratio_median"] is None
    assert "| rlx | 9.00 | 1.225x | 1.250x 1.200x n/a | 1.000x | n/a | 1.000 1.500 n/a |" in table
    argv = ["--preset", "tiny", "--processes", "3", "--json=x.json", "--rounds", "2"]
    assert _e2e._without_option(_e2e._without_option(argv, "--processes"), "--json") == ["--preset", "tiny",
                                                                                          "--rounds", "2"]
    for bad in (["--processes", "0"], ["--processes", "2", "--quick"], ["--processes", "2", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            _e2e.parse_args(["--preset", "tiny", *bad])


class _FakeSampler:
    """A PowerSampler stand-in: on exit, one sample per launch recorded in ``launched``, at
    400 W for runner "a"'s and 700 W (power cap active) for the others'."""

    def __init__(self, launched):
        self.launched, self.samples = launched, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.samples = [(t, 400.0 if name == "a" else 700.0, 1500.0, name == "b") for t, name in self.launched]
        return False


def test_power_rounds_give_watts_and_joules_per_step(monkeypatch):
    """Each runner's phases: mean power over its samples after the first second, its time per
    step over the phases, J/step = W x s/step; the table's J ratio is the reference's J/step
    over the row's, and a runner without samples gets no power fields."""
    import jax.numpy as jnp

    launched = []
    clock = {"t": 1000.0}
    monkeypatch.setattr(_e2e.time, "time", lambda: clock["t"])
    monkeypatch.setattr(_e2e.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))

    def launcher(name, step_s):
        def launch():
            clock["t"] += step_s  # the step's time passes
            launched.append((clock["t"], name))
            return jnp.zeros(())
        return launch

    runners = [_e2e.Runner("a", launcher("a", 0.02), None, 1, 1.0, None),
               _e2e.Runner("b", launcher("b", 0.01), None, 1, 1.0, None)]
    _e2e.power_rounds(runners, rounds=2, seconds=2.0, sampler=_FakeSampler(launched), idle=1.0)
    a, b = runners[0].row, runners[1].row
    assert a["watts"] == pytest.approx(400.0) and b["watts"] == pytest.approx(700.0)
    assert a["cap_share"] == 0 and b["cap_share"] == 1 and a["mhz"] == 1500.0
    assert a["power_ms"] == pytest.approx(20.0) and b["power_ms"] == pytest.approx(10.0)
    assert a["joules"] == pytest.approx(8.0) and b["joules"] == pytest.approx(7.0)
    row = {"variant": "b", "ms": 10.0, "ref_ms": 20.0, "sync_ms": 10.0, "ref_sync_ms": 20.0, "tokens_per_s": 1.0,
           "loss": 1.0, "loss_rel_diff": 0.0, "grad_norm_rel_diff": 0.0, "grad_rel_err": 0.0,
           "deterministic": True, **b, "ref_joules": a["joules"]}
    table = _e2e.format_table([row, dict(row, variant="c", watts=None, joules=None)], "h", power=True).splitlines()
    assert "| sync speedup | W | SM MHz | cap | J/step | J ratio | tokens/s |" in table[1]
    assert "| 700 | 1500 | 100% | 7.00 | 1.143x |" in table[3], table[3]
    assert "| n/a | 1500 | 100% | n/a | n/a |" in table[4], table[4]
    # no sample inside a runner's phases: no power fields
    lone = _e2e.Runner("c", launcher("c", 0.01), None, 1, 1.0, None)
    _e2e.power_rounds([lone], rounds=1, seconds=2.0, sampler=_FakeSampler([]), idle=0.0)
    assert "watts" not in lone.row and "joules" not in lone.row
    for bad in (["--power-seconds", "-1"], ["--power-seconds", "1"], ["--power-rounds", "0"]):
        with pytest.raises(SystemExit):
            _e2e.parse_args(["--preset", "tiny", *bad])


def test_processes_run_the_measurement_in_fresh_processes(tmp_path, capsys):
    out = tmp_path / "runs.json"
    rc = _e2e.main(["--preset", "tiny", "--rounds", "1", "--reps", "1", "--variants", "rlx", "--train", "none",
                    "--processes", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["processes"]) == 2
    for run in data["processes"]:
        assert {r["variant"] for r in run["rows"]} == {"plain-xla", "rlx"}
    rlx = next(r for r in data["summary"] if r["variant"] == "rlx")
    assert len(rlx["speedups"]) == 2 and all(x > 0 for x in rlx["speedups"])
    assert "across 2 processes" in capsys.readouterr().out


def test_own_attention_forward_variant_compiles_with_the_cudnn_route_off(monkeypatch):
    """rlx-own-attn-fwd lowers its step with ``CUDNN_FORWARD`` off (our forward kernel where
    the op would run cuDNN's), the other variants with it as it was, which it stays after."""
    from rlx_jax.vjp_rules import attention as attention_rules

    seen = {}
    make_loss = _e2e.make_loss

    def recording(s, v):
        loss = make_loss(s, v)

        def traced(*args):
            seen[v.name] = attention_rules.CUDNN_FORWARD
            return loss(*args)

        return traced

    monkeypatch.setattr(_e2e, "make_loss", recording)
    monkeypatch.setattr(attention_rules, "CUDNN_FORWARD", True)
    s = _e2e.Shape(**_e2e.PRESETS["tiny"])
    params = _e2e.init_params(s, jax.random.PRNGKey(0))
    tokens = jnp.zeros((s.batch, s.seq), jnp.int32)
    labels = jnp.zeros((s.tokens,), jnp.int32)
    by_name = {v.name: v for v in _e2e.variants("cpu")}
    losses = {}
    for name in ("rlx", "rlx-own-attn-fwd", "rlx-lean-own-attn-fwd"):
        losses[name] = _e2e.step_runner(s, by_name[name], params, tokens, labels).grads()[0]
        assert attention_rules.CUDNN_FORWARD is True
    assert seen == {"rlx": True, "rlx-own-attn-fwd": False, "rlx-lean-own-attn-fwd": False}
    assert losses["rlx-own-attn-fwd"] == pytest.approx(losses["rlx"], rel=1e-6)
