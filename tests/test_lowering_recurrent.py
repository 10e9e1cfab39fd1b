"""SelectiveScan and GatedDeltaNet vs NumPy recurrences; long sequences compile fast
(one lax.scan, not unrolled)."""

import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx

RNG = np.random.default_rng(7)


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def np_selective_scan(x, delta, a, b, c):
    bsz, s, h = x.shape
    n = a.shape[1]
    hs = np.zeros((bsz, h, n))
    y = np.zeros((bsz, s, h))
    for t in range(s):
        hs = np.exp(delta[:, t, :, None] * a) * hs + (delta[:, t] * x[:, t])[..., None] * b[:, t, None, :]
        y[:, t] = np.einsum("bhn,bn->bh", hs, c[:, t])
    return y


def ss_graph(bsz, s, h, n):
    g = rlx.Graph("ss")
    ids = [g.input(k, shp, "f32") for k, shp in
           (("x", [bsz, s, h]), ("d", [bsz, s, h]), ("a", [h, n]), ("b", [bsz, s, n]), ("c", [bsz, s, n]))]
    g.set_outputs([g.selective_scan(*ids)])
    return rlx.to_jax(g)


def ss_inputs(bsz, s, h, n):
    return dict(x=f32(bsz, s, h), d=np.abs(f32(bsz, s, h)) * 0.3, a=-np.abs(f32(h, n)),
                b=f32(bsz, s, n), c=f32(bsz, s, n))


def test_selective_scan_matches_numpy():
    inp = ss_inputs(2, 7, 3, 5)
    (y,) = ss_graph(2, 7, 3, 5)({}, inp)
    np.testing.assert_allclose(y, np_selective_scan(inp["x"], inp["d"], inp["a"], inp["b"], inp["c"]),
                               rtol=1e-4, atol=1e-5)


def test_selective_scan_gradient_matches_unrolled_reference():
    inp = ss_inputs(1, 5, 2, 3)
    f = ss_graph(1, 5, 2, 3)

    def loss(a, x):
        return jnp.sum(f({}, dict(inp, a=a, x=x))[0] ** 2)

    def ref(a, x):
        hs = jnp.zeros((1, 2, 3))
        out = []
        for t in range(5):
            d = inp["d"][:, t]
            hs = jnp.exp(d[..., None] * a) * hs + (d * x[:, t])[..., None] * inp["b"][:, t, None, :]
            out.append(jnp.einsum("bhn,bn->bh", hs, inp["c"][:, t]))
        return jnp.sum(jnp.stack(out, 1) ** 2)

    for got, want in zip(jax.grad(loss, (0, 1))(inp["a"], inp["x"]), jax.grad(ref, (0, 1))(inp["a"], inp["x"])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_selective_scan_2048_steps_compiles_fast():
    bsz, s, h, n = 1, 2048, 16, 8
    f = ss_graph(bsz, s, h, n)
    inp = {k: jnp.asarray(v) for k, v in ss_inputs(bsz, s, h, n).items()}
    t0 = time.perf_counter()
    jax.jit(f).lower({}, inp).compile()
    dt = time.perf_counter() - t0
    assert dt < 10.0, f"2048-step SelectiveScan took {dt:.1f} s to compile"
    # and its gradient too (the scan is reversed, not unrolled)
    t0 = time.perf_counter()
    jax.jit(jax.grad(lambda x: jnp.sum(f({}, dict(inp, x=x))[0]))).lower(inp["x"]).compile()
    dt = time.perf_counter() - t0
    assert dt < 10.0, f"2048-step SelectiveScan gradient took {dt:.1f} s to compile"


def np_gdn(q, k, v, g, beta, state=None):
    bsz, s, h, n = q.shape
    S = np.zeros((bsz, h, n, n)) if state is None else state.astype(np.float64).copy()
    out = np.zeros((bsz, s, h, n))
    for t in range(s):
        S = S * np.exp(g[:, t])[..., None, None]
        sk = np.einsum("bhij,bhi->bhj", S, k[:, t])
        d = (v[:, t] - sk) * beta[:, t][..., None]
        S = S + k[:, t][..., :, None] * d[..., None, :]
        out[:, t] = np.einsum("bhij,bhi->bhj", S, q[:, t]) / np.sqrt(n)
    return out


@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_net_matches_numpy(with_state):
    bsz, s, h, n = 2, 6, 3, 4
    q, k, v = f32(bsz, s, h, n), f32(bsz, s, h, n) * 0.5, f32(bsz, s, h, n)
    gg = -np.abs(f32(bsz, s, h)) * 0.2
    beta = np.abs(f32(bsz, s, h)) * 0.5
    state = f32(bsz, h, n, n) * 0.1
    G = rlx.Graph("gdn")
    ids = [G.input(nm, list(a.shape), "f32") for nm, a in
           (("q", q), ("k", k), ("v", v), ("g", gg), ("beta", beta))]
    st = G.input("state", list(state.shape), "f32") if with_state else None
    G.set_outputs([G.gated_delta_net(*ids, state=st)])
    inp = dict(q=q, k=k, v=v, g=gg, beta=beta)
    if with_state:
        inp["state"] = state
    (y,) = rlx.to_jax(G)({}, inp)
    np.testing.assert_allclose(y, np_gdn(q, k, v, gg, beta, state if with_state else None),
                               rtol=1e-4, atol=1e-5)
