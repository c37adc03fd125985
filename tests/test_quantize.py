"""Tests for recspec.itemids.quantize (residual k-means and RQ-VAE item identifiers)."""

from __future__ import annotations

import numpy as np
import pytest

from recspec.itemids.quantize import Quantization, rq_kmeans, rq_vae

SIZES = (8, 8, 8)
VAE_ARGS = dict(
    latent_dim=8, hidden_dims=(64, 32), epochs=40, batch_size=128, lr=3e-3, progress=False
)


def _mixture(n: int = 800, dim: int = 32, components: int = 12, seed: int = 0) -> np.ndarray:
    """float32 [n, dim] Gaussian mixture: unit-variance noise around well-separated centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(components, dim))
    points = centres[rng.integers(components, size=n)] + rng.normal(size=(n, dim))
    return points.astype(np.float32)


def _mean_mse(x: np.ndarray) -> float:
    """MSE per element of predicting every row of x [N, E] by the column means."""
    return float(((x - x.mean(0)) ** 2).mean())


def _brute_sq_dists(x: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    """float64 [N, K] squared distances by explicit differences."""
    return ((x[:, None, :].astype(np.float64) - codebook[None].astype(np.float64)) ** 2).sum(-1)


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return _mixture()


@pytest.fixture(scope="module")
def kmeans_q(data: np.ndarray) -> Quantization:
    return rq_kmeans(data, SIZES, seed=0)


@pytest.fixture(scope="module")
def vae_q(data: np.ndarray) -> Quantization:
    return rq_vae(data, SIZES, seed=0, **VAE_ARGS)


@pytest.fixture(scope="module", params=["kmeans_q", "vae_q"])
def q(request: pytest.FixtureRequest) -> Quantization:
    return request.getfixturevalue(request.param)


def test_shapes_dtypes_ranges(q: Quantization, data: np.ndarray) -> None:
    dim_q = data.shape[1] if q.method == "rqkmeans" else VAE_ARGS["latent_dim"]
    assert q.codes.shape == (len(data), len(SIZES)) and q.codes.dtype == np.int64
    assert (q.codes >= 0).all() and (q.codes < np.array(SIZES)).all()
    assert [cb.shape for cb in q.codebooks] == [(k, dim_q) for k in SIZES]
    assert all(cb.dtype == np.float32 for cb in q.codebooks)
    assert q.last_residuals.shape == (len(data), dim_q) and q.last_residuals.dtype == np.float32


def test_last_level_costs_match_brute_force(q: Quantization) -> None:
    costs = q.last_level_costs()
    assert costs.shape == (len(q.codes), SIZES[-1]) and costs.dtype == np.float32
    brute = _brute_sq_dists(q.last_residuals, q.codebooks[-1])
    np.testing.assert_allclose(costs, brute, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(q.codes[:, -1], costs.argmin(1))


def test_code_usage(q: Quantization) -> None:
    usage = q.code_usage()
    assert len(usage) == len(SIZES) and all(0 < u <= 1 for u in usage)
    expected = [len(np.unique(q.codes[:, level])) / k for level, k in enumerate(SIZES)]
    assert usage == pytest.approx(expected)


def test_rqkmeans_codes_are_nearest_codewords(kmeans_q: Quantization, data: np.ndarray) -> None:
    residual = data
    for level, codebook in enumerate(kmeans_q.codebooks):
        nearest = _brute_sq_dists(residual, codebook).argmin(1)
        np.testing.assert_array_equal(kmeans_q.codes[:, level], nearest)
        last_residual = residual
        residual = residual - codebook[kmeans_q.codes[:, level]]
    np.testing.assert_allclose(kmeans_q.last_residuals, last_residual, atol=1e-5)


def test_rqkmeans_round_trip(kmeans_q: Quantization, data: np.ndarray) -> None:
    """The sum of the chosen codewords approximates the embedding, better with every level."""
    mses, approx = [], np.zeros_like(data)
    for level, codebook in enumerate(kmeans_q.codebooks):
        approx = approx + codebook[kmeans_q.codes[:, level]]
        mses.append(float(((data - approx) ** 2).mean()))
    assert mses == sorted(mses, reverse=True)
    assert mses[-1] < 0.25 * _mean_mse(data)
    assert kmeans_q.reconstruction_mse == pytest.approx(mses[-1], rel=1e-4)
    assert kmeans_q.loss_history == ()


def test_rqkmeans_deterministic(kmeans_q: Quantization, data: np.ndarray) -> None:
    again = rq_kmeans(data, SIZES, seed=0)
    np.testing.assert_array_equal(again.codes, kmeans_q.codes)
    for a, b in zip(again.codebooks, kmeans_q.codebooks):
        np.testing.assert_array_equal(a, b)


def test_rqkmeans_single_level_equals_codebook_size_items() -> None:
    x = _mixture(n=10, dim=4)
    q = rq_kmeans(x, [10])
    assert sorted(q.codes[:, 0]) == list(range(10))
    assert q.reconstruction_mse == pytest.approx(0, abs=1e-10)


def test_rqvae_learns(vae_q: Quantization, data: np.ndarray) -> None:
    history = vae_q.loss_history
    assert vae_q.method == "rqvae" and len(history) == VAE_ARGS["epochs"]
    assert history[-1] < 0.5 * history[0]
    assert vae_q.reconstruction_mse < 0.5 * _mean_mse(data)


def test_rqvae_deterministic(vae_q: Quantization, data: np.ndarray) -> None:
    again = rq_vae(data, SIZES, seed=0, **VAE_ARGS)
    np.testing.assert_array_equal(again.codes, vae_q.codes)
    assert again.loss_history == vae_q.loss_history
    np.testing.assert_array_equal(again.last_residuals, vae_q.last_residuals)


@pytest.mark.parametrize(
    ("embeddings", "sizes", "message"),
    [
        (np.zeros(40, np.float32), (4,), "2-D float"),
        (np.zeros((40, 3), np.int64), (4,), "2-D float"),
        ([[0.0, 1.0]] * 40, (4,), "2-D float"),
        (np.full((40, 3), np.nan, np.float32), (4,), "NaN or inf"),
        (np.full((40, 3), np.inf), (4,), "NaN or inf"),
        (np.zeros((40, 0), np.float32), (4,), "zero dimensions"),
        (np.zeros((40, 3), np.float32), (), "empty"),
        (np.zeros((40, 3), np.float32), (4, 0), ">= 1"),
        (np.zeros((40, 3), np.float32), (4, 41), "fewer than the largest codebook size 41"),
    ],
)
@pytest.mark.parametrize("method", [rq_kmeans, rq_vae])
def test_validation(method, embeddings, sizes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        method(embeddings, sizes)


def test_rqvae_validates_training_args(data: np.ndarray) -> None:
    with pytest.raises(ValueError, match="epochs"):
        rq_vae(data, SIZES, epochs=0)
