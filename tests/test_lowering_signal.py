"""Fft (real-block and c64 layouts, the three FftNorms) and the pyrlx FFT helpers built
on it, vs numpy.fft."""

import numpy as np
import pytest

import jax

import rlx_jax as rlx

RNG = np.random.default_rng(10)


def run_graph(build, **arrays):
    names = {np.float32: "f32", np.float64: "f64", np.complex64: "c64"}
    g = rlx.Graph("s")
    ids = {n: g.input(n, list(a.shape), names[a.dtype.type]) for n, a in arrays.items()}
    out = build(g, ids)
    g.set_outputs(list(out) if isinstance(out, (list, tuple)) else [out])
    return [np.asarray(o) for o in rlx.to_jax(g)({}, arrays)]


def scale(norm, n, inverse):
    return {"backward": 1.0, "forward": 1.0 / n if inverse else 1.0, "ortho": 1 / np.sqrt(n)}[norm]


def unnormalised(z, inverse):
    return np.fft.ifft(z, axis=-1) * z.shape[-1] if inverse else np.fft.fft(z, axis=-1)


@pytest.mark.parametrize("norm", ["backward", "forward", "ortho"])
@pytest.mark.parametrize("inverse", [False, True])
def test_fft_real_block_layout(norm, inverse):
    n = 6  # not a power of two
    x = RNG.standard_normal((3, 2 * n)).astype(np.float32)
    (y,) = run_graph(lambda G, i: G.fft_norm(i["x"], inverse, norm), x=x)
    z = x[:, :n] + 1j * x[:, n:]
    ref = unnormalised(z, inverse) * scale(norm, n, inverse)
    np.testing.assert_allclose(y[:, :n], ref.real, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(y[:, n:], ref.imag, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm", ["backward", "ortho"])
def test_fft_c64(norm):
    z = (RNG.standard_normal((2, 8)) + 1j * RNG.standard_normal((2, 8))).astype(np.complex64)
    (y,) = run_graph(lambda G, i: G.fft_norm(i["z"], False, norm), z=z)
    np.testing.assert_allclose(y, np.fft.fft(z) * scale(norm, 8, False), rtol=1e-4, atol=1e-4)


def test_fft_roundtrip_backward_norm_scales_by_n():
    x = RNG.standard_normal((16,)).astype(np.float32)
    (y,) = run_graph(lambda G, i: G.fft(G.fft(i["x"]), True), x=x)
    np.testing.assert_allclose(y, 8 * x, rtol=1e-4, atol=1e-4)


def test_rfft_and_irfft_helpers():
    x = RNG.standard_normal((2, 16)).astype(np.float32)
    re, im = run_graph(lambda G, i: list(G.rfft(i["x"])), x=x)
    ref = np.fft.rfft(x)
    np.testing.assert_allclose(re, ref.real, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(im, ref.imag, rtol=1e-4, atol=1e-4)


def test_fft_f64_stays_f64():
    with jax.enable_x64(True):
        x = RNG.standard_normal((2, 8))
        (y,) = run_graph(lambda G, i: G.fft(i["x"]), x=x)
    assert y.dtype == np.float64
    z = x[:, :4] + 1j * x[:, 4:]
    np.testing.assert_allclose(y[:, :4], np.fft.fft(z).real, rtol=1e-12, atol=1e-12)
