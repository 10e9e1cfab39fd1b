"""Packed documents (segment ids) and attention sinks: values and gradients against an
independent dense oracle (a dense visibility matrix and an explicit sink column in the
softmax), f64 finite-difference gradients (first and second order), forward mode, vmap,
rows with no visible key, input errors, an RLX graph round trip and SPMD sharding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rlx_jax.ops import attention

from attention_reference import dense_attention


def close(got, want, rtol, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


def packed_ids(b, s, lengths_seed, *, max_len=4):
    """[B, S] int32 segment ids of documents with random lengths 1..max_len (non-decreasing)."""
    rng = np.random.default_rng(lengths_seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            ids += [doc] * int(rng.integers(1, max_len + 1))
            doc += 1
        rows.append(ids[:s])
    return jnp.asarray(np.array(rows, np.int32))


def inputs(b, sq, sk, h, hkv, d, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, std=1.0):
        return jnp.asarray((std * rng.standard_normal(shape)).astype(np.float64)).astype(dtype)

    return dict(q=normal(b, sq, h, d), k=normal(b, sk, hkv, d), v=normal(b, sk, hkv, d),
                mask=jnp.asarray((rng.uniform(size=(b, sk)) > 0.3).astype(np.float32)),
                bias=normal(b, h, sq, sk, std=0.5), sinks=normal(h), dy=normal(b, sq, h, d))


# (B, Sq, Sk, H, Hkv, D): odd lengths, GQA, Sq != Sk
SHAPES = [(2, 7, 7, 4, 2, 3), (1, 9, 11, 2, 1, 5)]
OPTIONS = [
    dict(),
    dict(mask_kind="causal"),
    dict(mask_kind="sliding", window=2),
    dict(mask_kind="causal", softcap=1.5, scale=0.4),
    dict(use_mask=True, use_bias=True),
]


def _case(shape, opts, *, segments, sinks, dtype=jnp.float32, seed=0):
    b, sq, sk = shape[:3]
    x = inputs(*shape, dtype=dtype, seed=seed)
    kw = {k: v for k, v in opts.items() if not k.startswith("use_")}
    if opts.get("use_mask"):
        kw["mask"] = x["mask"]
    if opts.get("use_bias"):
        kw["bias"] = x["bias"]
    if segments:
        qs = packed_ids(b, sq, seed + 1)
        # keys right-aligned with queries (bottom-right, as the mask kinds) when Sk > Sq
        ks = jnp.concatenate([jnp.full((b, sk - sq), -1, jnp.int32), qs], 1) if sk > sq else qs
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
    if sinks:
        kw["sinks"] = x["sinks"]
    return x, kw


def _both_grads(x, kw, dy):
    """(value, grads) of ``attention`` and of the oracle, in one compile."""
    diff = {"q": x["q"], "k": x["k"], "v": x["v"]}
    for name in ("bias", "sinks"):
        if name in kw:
            diff[name] = kw[name]
    rest = {k: v for k, v in kw.items() if k not in diff}

    @jax.jit
    def run(diff, dy):
        outs = []
        for fn in (attention, dense_attention):
            f = lambda d, fn=fn: fn(d["q"], d["k"], d["v"], **{kk: vv for kk, vv in d.items()
                                                              if kk not in "qkv"}, **rest)
            y, vjp = jax.vjp(f, diff)
            outs.append((y, vjp(dy)[0]))
        return outs

    return run(diff, dy)


_KINDS = {"segments": (True, False), "sinks": (False, True), "both": (True, True)}
# the default run: every option with both features, each feature alone on the other shape
DEFAULT_CASES = ([(SHAPES[0], o, "both") for o in OPTIONS]
                 + [(SHAPES[1], OPTIONS[1], "sinks"), (SHAPES[1], OPTIONS[2], "segments"),
                    (SHAPES[1], OPTIONS[4], "both")])
FULL_CASES = [(sh, o, kind) for sh in SHAPES for o in OPTIONS for kind in _KINDS]


def _cid(case):
    shape, o, kind = case
    return f"{kind}-{shape}-" + ("-".join(f"{k}={v}" for k, v in o.items()) or "plain")


def _check_case(shape, opts, kind):
    segments, sinks = _KINDS[kind]
    x, kw = _case(shape, opts, segments=segments, sinks=sinks)
    (y, g), (y_ref, g_ref) = _both_grads(x, kw, x["dy"])
    close(y, y_ref, rtol=2e-5, atol=2e-5)
    assert set(g) == set(g_ref)
    for name in g:
        close(g[name], g_ref[name], rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_cid)
def test_values_and_gradients_match_dense_oracle(case):
    _check_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL_CASES, ids=_cid)
def test_values_and_gradients_match_dense_oracle_full_product(case):
    _check_case(*case)


def test_segments_really_separate_documents():
    """Each document's output equals attention over that document alone (causal)."""
    x = inputs(1, 10, 10, 2, 2, 4)
    ids = jnp.asarray([[0, 0, 0, 1, 2, 2, 2, 2, 3, 3]], jnp.int32)
    y = attention(x["q"], x["k"], x["v"], mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids)
    for lo, hi in ((0, 3), (3, 4), (4, 8), (8, 10)):
        alone = attention(x["q"][:, lo:hi], x["k"][:, lo:hi], x["v"][:, lo:hi], mask_kind="causal")
        close(y[:, lo:hi], alone, rtol=1e-6, atol=1e-6)
    # a document of length 1 attends to itself only: out = v of that token
    close(y[0, 3], x["v"][0, 3], rtol=1e-6, atol=1e-6)


def test_wide_segment_ids_keep_equality(x64):
    """int64 / uint32 ids that share their low 32 bits (0 and 2**32) or wrap in int32
    (uint32 2**31) are different documents: the same output as small ids with the same
    equality pattern (ids become their rank among the row's ids)."""
    x = inputs(2, 6, 6, 2, 2, 4)
    small = jnp.asarray([[0, 0, 1, 1, 2, 2], [5, 5, 5, 7, 7, 9]], jnp.int32)
    want = attention(x["q"], x["k"], x["v"], mask_kind="causal", q_segment_ids=small, kv_segment_ids=small)
    for ids in (jnp.asarray([[0, 0, 2**32, 2**32, 2**33, 2**33], [-(2**40), -(2**40), -(2**40), 3, 3, 2**40]],
                            jnp.int64),
                jnp.asarray([[0, 0, 2**31, 2**31, 2**32 - 1, 2**32 - 1], [1, 1, 1, 2**31 + 1, 2**31 + 1, 7]],
                            jnp.uint32)):
        y = attention(x["q"], x["k"], x["v"], mask_kind="causal", q_segment_ids=ids, kv_segment_ids=ids)
        close(y, want, rtol=1e-6, atol=1e-6)


def test_rows_with_no_visible_key_are_zero_with_zero_gradients():
    """Query ids absent from the keys (and a key mask hiding a whole document): output 0,
    finite zero gradients, as rows with no visible key without segment ids."""
    x = inputs(1, 6, 6, 2, 1, 3)
    qs = jnp.asarray([[0, 0, 5, 1, 1, 2]], jnp.int32)
    ks = jnp.asarray([[0, 0, 1, 1, 1, 2]], jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 1, 1, 0]], jnp.float32)
    kw = dict(q_segment_ids=qs, kv_segment_ids=ks, mask=mask)

    @jax.jit
    def run(q, k, v, sinks):
        outs = []
        for s in (None, sinks):
            f = lambda q: attention(q, k, v, sinks=s, **kw)
            outs += [f(q), jax.grad(lambda q: jnp.sum(f(q) ** 2))(q),
                     dense_attention(q, k, v, sinks=s, **kw)]
        return outs

    res = run(x["q"], x["k"], x["v"], x["sinks"])
    for y, gq, want in (res[:3], res[3:]):
        assert np.all(np.asarray(y[0, 2]) == 0) and np.all(np.asarray(y[0, 5]) == 0)
        assert np.all(np.isfinite(np.asarray(gq)))
        assert np.all(np.asarray(gq[0, 2]) == 0) and np.all(np.asarray(gq[0, 5]) == 0)
        close(y, want, rtol=1e-5, atol=1e-6)


def test_sinks_match_closed_form_and_d_sinks():
    """out = out0 * sigma(lse - sink) and d sink_h = -sum_i p_sink,i (dout_i . out_i)."""
    x = inputs(2, 5, 5, 3, 3, 4, dtype=jnp.float64) if jax.config.jax_enable_x64 else inputs(2, 5, 5, 3, 3, 4)
    q, k, v, s, dy = x["q"], x["k"], x["v"], x["sinks"], x["dy"]
    y, vjp = jax.vjp(lambda s: attention(q, k, v, mask_kind="causal", sinks=s), s)
    (ds,) = vjp(dy)
    sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    sc = jnp.where(np.tril(np.ones((5, 5), bool)), sc, -jnp.inf)
    lse = jax.scipy.special.logsumexp(sc, axis=-1)                     # [B, H, Sq]
    p_sink = jnp.exp(s[None, :, None] - jnp.logaddexp(lse, s[None, :, None]))
    want = -jnp.sum(p_sink * jnp.einsum("bqhd,bqhd->bhq", dy, y), axis=(0, 2))
    close(ds, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_extreme_sinks_match_oracle(monkeypatch, kernel):
    """Sinks far above the scores (the sink takes almost every row's mass: out ~ 0, no
    overflow), far below them and -inf (no effect), and a row that sees no key (output 0,
    d sink 0 there), on the reference and on the CPU kernel (where XLA applies the sinks to
    the kernel's (out, lse)): values and gradients against the dense oracle."""
    from rlx_jax.vjp_rules import attention as rules

    monkeypatch.setattr(rules, "CPU_KERNEL_MIN_SCORE_BYTES", 0 if kernel else 1 << 62)
    x = inputs(1, 6, 6, 4, 2, 3)
    sinks = jnp.asarray([80.0, -80.0, -jnp.inf, 0.3], jnp.float32)
    mask = jnp.asarray([[0, 1, 1, 1, 1, 1]], jnp.float32)  # query 0 (causal) sees no key
    kw = dict(mask_kind="causal", mask=mask)

    @jax.jit
    def run(q, k, v, s, dy):
        return [jax.vjp(lambda *a: fn(*a, **kw), q, k, v, s)[1](dy) + (fn(q, k, v, s, **kw),)
                for fn in (lambda q, k, v, s, **kw: attention(q, k, v, sinks=s, **kw),
                           lambda q, k, v, s, **kw: dense_attention(q, k, v, sinks=s, **kw))]

    got, want = run(x["q"], x["k"], x["v"], sinks, x["dy"])
    for g, w in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        close(g, w, rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(got[-1][0, 0]) == 0)          # the row that sees no key
    assert np.max(np.abs(np.asarray(got[-1][..., 0, :]))) < 1e-20  # the head whose sink dominates
    hlo = jax.jit(lambda q: attention(q, x["k"], x["v"], sinks=sinks, **kw)).lower(x["q"]).as_text()
    assert ("custom_call @rlx_attention_fwd" in hlo) == kernel


@pytest.mark.parametrize("opts,segments,sinks,order,modes", [
    (dict(mask_kind="causal", softcap=1.3), True, True, 2, ("rev",)),
    (dict(mask_kind="sliding", window=1, use_mask=True, use_bias=True), True, False, 1, ("fwd", "rev")),
    (dict(mask_kind="causal"), False, True, 2, ("fwd", "rev")),
    (dict(mask_kind="sliding", window=2), True, True, 2, ("fwd", "rev")),
], ids=["causal-softcap-both", "sliding-mask-bias-segments", "causal-sinks-kernel", "sliding-both-cpu-kernel"])
def test_f64_check_grads(x64, opts, segments, sinks, order, modes, monkeypatch):
    if segments and sinks and opts.get("mask_kind") == "sliding":  # the CPU kernel, XLA's sinks over it
        from rlx_jax.vjp_rules import attention as rules

        monkeypatch.setattr(rules, "CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES", 0)
    x, kw = _case((1, 4, 4, 2, 1, 2), opts, segments=segments, sinks=sinks, dtype=jnp.float64)
    names = ["q", "k", "v"] + [n for n in ("bias", "sinks") if n in kw]
    rest = {k: v for k, v in kw.items() if k not in names}

    @jax.jit
    def f(*args):
        named = dict(zip(names, args))
        return attention(named.pop("q"), named.pop("k"), named.pop("v"), **named, **rest)

    args = [x[n] if n in "qkv" else kw[n] for n in names]
    check_grads(f, args, order=order, modes=modes, atol=1e-6, rtol=1e-6)


def test_jvp_and_vmap():
    x, kw = _case((2, 6, 6, 2, 2, 3), dict(mask_kind="causal"), segments=True, sinks=True)
    q, k, v = x["q"], x["k"], x["v"]
    f = lambda q, k, v, s: attention(q, k, v, mask_kind="causal", q_segment_ids=kw["q_segment_ids"],
                                     kv_segment_ids=kw["kv_segment_ids"], sinks=s)
    fo = lambda q, k, v, s: dense_attention(q, k, v, mask_kind="causal", q_segment_ids=kw["q_segment_ids"],
                                         kv_segment_ids=kw["kv_segment_ids"], sinks=s)
    t = [x["dy"], 0.5 * k, -v, jnp.arange(2.0)]
    jvp = jax.jit(lambda fn, p, t: jax.jvp(fn, p, t)[1], static_argnums=0)
    tout = jvp(f, (q, k, v, x["sinks"]), tuple(t))
    tref = jvp(fo, (q, k, v, x["sinks"]), tuple(t))
    close(tout, tref, rtol=5e-5, atol=5e-5)
    # vmap over a leading axis of every operand, segment ids and sinks included
    qs = jnp.stack([kw["q_segment_ids"], packed_ids(2, 6, 9)])
    sk = jnp.stack([x["sinks"], -x["sinks"]])
    g = lambda q, k, v, ids, s: attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, sinks=s)
    go = lambda q, k, v, ids, s: dense_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, sinks=s)
    qq, kk, vv = (jnp.stack([a, 2 * a]) for a in (q, k, v))
    close(jax.jit(jax.vmap(g))(qq, kk, vv, qs, sk), jax.jit(jax.vmap(go))(qq, kk, vv, qs, sk),
          rtol=2e-5, atol=2e-5)
    # vmap of the sinks alone (kernel path, lse batched through the primitive)
    ys = jax.jit(jax.vmap(lambda s: attention(q, k, v, sinks=s)))(sk)
    for i in range(2):
        close(ys[i], dense_attention(q, k, v, sinks=sk[i]), rtol=2e-5, atol=2e-5)


def test_bf16_sinks_and_segments_run_and_agree():
    x, kw = _case((1, 9, 9, 4, 2, 8), dict(mask_kind="causal"), segments=True, sinks=True, dtype=jnp.bfloat16)
    y = attention(x["q"], x["k"], x["v"], **kw)
    assert y.dtype == jnp.bfloat16
    want = dense_attention(x["q"], x["k"], x["v"], **kw)
    close(y.astype(jnp.float32), want, rtol=0, atol=3e-2 * float(jnp.max(jnp.abs(want))))


def test_small_segment_ids_run_the_reference_and_sinks_keep_the_kernel():
    """Below the CPU segment-kernel threshold, segment ids compute in plain XLA ops (the
    reference); sinks alone keep the fused kernel call."""
    x, kw = _case((1, 5, 5, 2, 2, 4), dict(mask_kind="causal"), segments=True, sinks=True)
    seg = jax.jit(lambda q, k, v: attention(q, k, v, **kw)).lower(x["q"], x["k"], x["v"]).as_text()
    assert "rlx_attention" not in seg
    snk = jax.jit(lambda q, k, v: attention(q, k, v, sinks=kw["sinks"])).lower(x["q"], x["k"], x["v"]).as_text()
    assert "rlx_attention_fwd" in snk


def test_errors_name_the_argument():
    x = inputs(2, 4, 5, 2, 2, 3)
    q, k, v = x["q"], x["k"], x["v"]
    ids_q, ids_k = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        attention(q, k, v, q_segment_ids=ids_q)
    with pytest.raises(ValueError, match="q_segment_ids"):
        attention(q, k, v, kv_segment_ids=ids_k)
    with pytest.raises(TypeError, match="q_segment_ids must be an integer"):
        attention(q, k, v, q_segment_ids=ids_q.astype(jnp.float32), kv_segment_ids=ids_k)
    with pytest.raises(ValueError, match=r"kv_segment_ids must have shape \(2, 5\)"):
        attention(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_q)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\)"):
        attention(q, k, v, sinks=jnp.zeros((3,)))
    with pytest.raises(TypeError, match="sinks must be floating"):
        attention(q, k, v, sinks=jnp.zeros((2,), jnp.int32))


_SHARD_CHILD = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rlx_jax.ops import attention
mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "s"))
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.standard_normal((4, 16, 2, 8)), jnp.float32) for _ in range(3))
ids = jnp.asarray(np.repeat(np.arange(8), 2)[None].repeat(4, 0), jnp.int32)
sinks = jnp.asarray(r.standard_normal(2), jnp.float32)
f = lambda q, k, v, ids, s: jnp.sum(attention(q, k, v, mask_kind="causal", q_segment_ids=ids,
                                              kv_segment_ids=ids, sinks=s) ** 2)
g = jax.jit(jax.value_and_grad(f, (0, 1, 2, 4)))
want = g(q, k, v, ids, sinks)
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
got = g(put(q, P("b", "s")), put(k, P("b", "s")), put(v, P("b", "s")), put(ids, P("b", "s")), put(sinks, P()))
for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
# heads split over kv-head groups (8 query / 4 kv heads on 4 devices), the sinks with them
mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "h"))
q = jnp.asarray(r.standard_normal((4, 16, 8, 8)), jnp.float32)
k, v = (jnp.asarray(r.standard_normal((4, 16, 4, 8)), jnp.float32) for _ in range(2))
sinks = jnp.asarray(3 * r.standard_normal(8), jnp.float32)
want = g(q, k, v, ids, sinks)
heads = P("b", None, "h")
got_h = g(put(q, heads), put(k, heads), put(v, heads), put(ids, P("b")), put(sinks, P("h")))
for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got_h)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
print("OK", got[1][0].sharding)
"""


def test_sharded_batch_and_sequence_match_unsharded():
    """On 8 host devices: segment ids sharded with q over (batch, sequence) give the
    unsharded values and gradients (sinks replicated); and with the heads split over kv-head
    groups, the sinks split with them."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SHARD_CHILD], env=env, capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ---- RLX graphs ----------------------------------------------------------------------------


def _graph(segments, sinks, mask_kind="causal"):
    from rlx_jax.ir import Graph

    g = Graph("packed")
    q, k, v = (g.param(n, [2, 5, 4 * 3]) if n == "q" else g.param(n, [2, 5, 2 * 3]) for n in "qkv")
    kw = {}
    if segments:
        kw.update(q_segment_ids=g.input("qs", [2, 5], "i32"), kv_segment_ids=g.input("ks", [2, 5], "i32"))
    if sinks:
        kw["sinks"] = g.param("sinks", [4])
    y = g.attention_opts(q, k, v, 4, 3, mask_kind, softcap=2.0 if not (segments or sinks) else None, **kw)
    w = np.random.RandomState(3).randn(2, 5, 12).astype(np.float32)
    g.set_outputs([g.sum(g.mul(y, g.constant(w)), [0, 1, 2])])
    return g, w


@pytest.mark.parametrize("segments,sinks", [(True, True), pytest.param(True, False, marks=pytest.mark.slow),
                                             pytest.param(False, True, marks=pytest.mark.slow)],
                         ids=["both", "segments", "sinks"])
def test_graph_round_trip_lowering_and_graph_gradients(segments, sinks):
    import rlx_jax
    from rlx_jax.ir import Graph

    g, w = _graph(segments, sinks)
    text = g.to_json()
    back = Graph.from_json(text)
    assert back.to_json() == text
    node = json.loads(text)
    attn = [n for n in json.dumps(node).split('"Attention"')[1:]]
    assert attn and (('"segment_ids": true' in attn[0]) == segments) and (('"sinks": true' in attn[0]) == sinks)
    x = inputs(2, 5, 5, 4, 2, 3, seed=4)
    ids = packed_ids(2, 5, 7, max_len=3)
    params = {"q": x["q"].reshape(2, 5, 12), "k": x["k"].reshape(2, 5, 6), "v": x["v"].reshape(2, 5, 6)}
    feeds = {}
    if segments:
        feeds = {"qs": ids, "ks": ids}
    if sinks:
        params["sinks"] = x["sinks"]
    wrt = list(params)
    gg = rlx_jax.grad_with_loss(back, wrt)
    outs = rlx_jax.to_jax(gg)(params, dict(feeds, d_output=np.float32(1)))

    def loss(p):
        kw = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}
        if sinks:
            kw["sinks"] = p["sinks"]
        y = dense_attention(p["q"].reshape(2, 5, 4, 3), p["k"].reshape(2, 5, 2, 3), p["v"].reshape(2, 5, 2, 3),
                         mask_kind="causal", **kw)
        return jnp.sum(y.reshape(2, 5, 12) * w)

    want, gwant = jax.value_and_grad(loss)(params)
    close(outs[0], want, rtol=1e-5, atol=1e-5)
    for name, got in zip(wrt, outs[1:]):
        close(got, gwant[name], rtol=1e-4, atol=1e-5)


def test_graph_without_the_new_inputs_keeps_rlx_json():
    g, _ = _graph(False, False)
    assert "segment_ids" not in g.to_json() and "sinks" not in g.to_json()


def test_graph_rejects_bad_segment_ids_and_sinks():
    from rlx_jax.ir import Graph

    g = Graph("bad")
    q, k, v = g.param("q", [1, 4, 6]), g.param("k", [1, 4, 6]), g.param("v", [1, 4, 6])
    with pytest.raises(Exception, match="q_segment_ids must have an integer dtype"):
        g.attention_opts(q, k, v, 2, 3, q_segment_ids=g.input("a", [1, 4]), kv_segment_ids=g.input("b", [1, 4], "i32"))
    with pytest.raises(Exception, match="kv_segment_ids must be"):
        g.attention_opts(q, k, v, 2, 3, q_segment_ids=g.input("c", [1, 4], "i32"),
                         kv_segment_ids=g.input("d", [1, 3], "i32"))
    with pytest.raises(Exception, match="sinks must be"):
        g.attention_opts(q, k, v, 2, 3, sinks=g.param("s", [3]))
    with pytest.raises(Exception, match="go together"):
        g.attention_opts(q, k, v, 2, 3, q_segment_ids=g.input("e", [1, 4], "i32"))


@pytest.mark.parametrize("sq,sk", [(0, 3), (3, 0), (0, 0)])
def test_zero_sized_lengths(sq, sk):
    """Empty query or key sequences: empty outputs, or rows with no key (0, zero grads)."""
    r = np.random.default_rng(1)
    q, k = jnp.asarray(r.standard_normal((2, sq, 2, 4)), jnp.float32), jnp.asarray(r.standard_normal((2, sk, 1, 4)), jnp.float32)
    kw = dict(q_segment_ids=jnp.zeros((2, sq), jnp.int32), kv_segment_ids=jnp.zeros((2, sk), jnp.int32))
    sinks = jnp.asarray([0.5, -1.0], jnp.float32)
    f = jax.jit(jax.value_and_grad(lambda q, k, s: jnp.sum(attention(q, k, k, sinks=s, **kw) ** 2), (0, 1, 2)))
    val, grads = f(q, k, sinks)
    assert float(val) == 0.0
    assert [g.shape for g in grads] == [q.shape, k.shape, (2,)]
    assert all(np.all(np.asarray(g) == 0) for g in grads)
    assert np.all(np.asarray(attention(q, k, k, sinks=sinks)) == 0)


def test_graph_gradients_with_bias_softcap_scale_segments_and_sinks():
    """Mask kind Bias (its input precedes the segment ids) with a softcap and a score scale:
    graph gradients of q, k, v, bias and sinks against the oracle."""
    import rlx_jax
    from rlx_jax.ir import Graph

    x = inputs(2, 5, 5, 4, 2, 3, seed=4)
    ids = packed_ids(2, 5, 7, max_len=3)
    g = Graph("packed_bias")
    q, k, v = g.param("q", [2, 5, 12]), g.param("k", [2, 5, 6]), g.param("v", [2, 5, 6])
    y = g.attention_opts(q, k, v, 4, 3, "bias", g.param("bias", [2, 4, 5, 5]), softcap=1.7, score_scale=0.3,
                         q_segment_ids=g.input("qs", [2, 5], "i32"), kv_segment_ids=g.input("ks", [2, 5], "i32"),
                         sinks=g.param("sinks", [4]))
    w = np.random.RandomState(3).randn(2, 5, 12).astype(np.float32)
    g.set_outputs([g.sum(g.mul(y, g.constant(w)), [0, 1, 2])])
    params = {"q": x["q"].reshape(2, 5, 12), "k": x["k"].reshape(2, 5, 6), "v": x["v"].reshape(2, 5, 6),
              "bias": x["bias"], "sinks": x["sinks"]}
    outs = rlx_jax.to_jax(rlx_jax.grad_with_loss(g, list(params)))(params, {"qs": ids, "ks": ids,
                                                                          "d_output": np.float32(1)})

    def loss(p):
        y = dense_attention(p["q"].reshape(2, 5, 4, 3), p["k"].reshape(2, 5, 2, 3), p["v"].reshape(2, 5, 2, 3),
                         bias=p["bias"], softcap=1.7, scale=0.3, q_segment_ids=ids, kv_segment_ids=ids,
                         sinks=p["sinks"])
        return jnp.sum(y.reshape(2, 5, 12) * w)

    want, gwant = jax.value_and_grad(loss)(params)
    close(outs[0], want, rtol=1e-5, atol=1e-5)
    for name, got in zip(params, outs[1:]):
        close(got, gwant[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sq,sk,granule", [(0, 5, 4), (5, 0, 4), (1, 1, 4), (37, 53, 8), (64, 64, 64), (130, 70, 64)])
@pytest.mark.parametrize("layout", ["packed", "random"])
def test_segment_tile_info_matches_brute_force(sq, sk, granule, layout):
    """The CUDA kernels' granule tables: each granule's id range, and the range of the other
    side's granules whose id ranges meet it, against a loop over granule pairs; a granule
    pair outside the hull never holds a matching (query, key) pair."""
    from rlx_jax.vjp_rules.attention_segments import segment_tile_info

    rng = np.random.default_rng(sq * 131 + sk)
    if layout == "packed":
        qid, kid = packed_ids(2, max(sq, 1), 3, max_len=9)[:, :sq], packed_ids(2, max(sk, 1), 4, max_len=9)[:, :sk]
    else:
        qid = jnp.asarray(rng.integers(0, 6, size=(2, sq)), jnp.int32)
        kid = jnp.asarray(rng.integers(0, 6, size=(2, sk)), jnp.int32)
    qinfo, kinfo = (np.asarray(x) for x in segment_tile_info(qid, kid, granule))
    nq, nk = -(-sq // granule), -(-sk // granule)
    assert qinfo.shape == (2, nq, 4) and kinfo.shape == (2, nk, 4)
    assert qinfo.dtype == np.int32 and kinfo.dtype == np.int32
    q_np, k_np = np.asarray(qid), np.asarray(kid)
    for b in range(2):
        qg = [q_np[b, i * granule:(i + 1) * granule] for i in range(nq)]
        kg = [k_np[b, j * granule:(j + 1) * granule] for j in range(nk)]
        for own, other, info in ((qg, kg, qinfo[b]), (kg, qg, kinfo[b])):
            for i, ids in enumerate(own):
                meets = [j for j, o in enumerate(other) if ids.min() <= o.max() and o.min() <= ids.max()]
                assert (info[i, 0], info[i, 1]) == (ids.min(), ids.max())
                if meets:
                    assert (info[i, 2], info[i, 3]) == (meets[0], meets[-1] + 1)
                else:
                    assert info[i, 2] >= info[i, 3]
                # no matching pair outside the hull
                for j, o in enumerate(other):
                    if not info[i, 2] <= j < info[i, 3]:
                        assert not np.isin(ids, o).any()


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (1, 1), (130, 70), (300, 300), (200, 260), (513, 513)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["packed", "random"])
def test_segment_tile_order_is_the_work_sorted_permutation(sq, sk, causal, layout):
    """The CUDA forward's tile order: every (batch, query tile of 128 rows) pair exactly once,
    sorted by descending work (ties in index order), the work of a tile counted by brute force
    as the key tiles of 128 from the tile edge below the first key whose granule's id range
    meets one of the tile's granules' ranges, to the end of the last such granule, cut at the
    causal end of the tile's last row, plus one."""
    from rlx_jax.vjp_rules.attention_segments import segment_tile_info, segment_tile_order

    rng = np.random.default_rng(sq * 7 + sk)
    b, g, t = 3, 64, 128
    if layout == "packed":
        qid, kid = packed_ids(b, max(sq, 1), 5, max_len=150)[:, :sq], packed_ids(b, max(sk, 1), 5, max_len=150)[:, :sk]
    else:
        qid = jnp.asarray(rng.integers(0, 4, size=(b, sq)), jnp.int32)
        kid = jnp.asarray(rng.integers(0, 4, size=(b, sk)), jnp.int32)
    qinfo, _ = segment_tile_info(qid, kid)
    order = np.asarray(segment_tile_order(qinfo, sq, sk, causal))
    nqt = -(-sq // t)
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(b * nqt))
    q_np, k_np = np.asarray(qid), np.asarray(kid)
    work = []
    for bb in range(b):
        kg = [k_np[bb, j * g:(j + 1) * g] for j in range(-(-sk // g))]
        for qt in range(nqt):
            meets = []
            for i in range(qt * t // g, min(-(-sq // g), (qt + 1) * t // g)):
                ids = q_np[bb, i * g:(i + 1) * g]
                meets += [j for j, o in enumerate(kg) if ids.min() <= o.max() and o.min() <= ids.max()]
            tiles = 0
            if meets:
                kbeg, kend = min(meets) * g // t * t, min(sk, (max(meets) + 1) * g)
                if causal:
                    kend = min(kend, min(sq - 1, qt * t + t - 1) + max(sk - sq, 0) + 1)
                tiles = max(0, -(-(kend - kbeg) // t))
            work.append(tiles + 1)
    want = sorted(range(b * nqt), key=lambda p: (-work[p], p))
    assert order.tolist() == want
