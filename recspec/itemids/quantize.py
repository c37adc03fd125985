"""Residual quantisation of item embeddings into semantic identifiers (TIGER / LC-Rec style).

Each item's embedding is quantised in ``L`` levels: level ``l`` picks the codeword of
``codebooks[l]`` nearest (Euclidean) to the item's current residual and passes the residual minus
that codeword on to level ``l + 1``. The ``L`` code indices become the item's identifier tokens.

Two ways to learn the codebooks:

* :func:`rq_kmeans` -- k-means on the residuals, level by level, directly in embedding space.
* :func:`rq_vae` -- LC-Rec's RQ-VAE: an MLP autoencoder whose latent is residual-quantised,
  trained end to end with a straight-through estimator.

Preprocessing: none. The embeddings are only cast to float32; they are not centred, scaled or
L2-normalised, because the geometry of the embedding space is the caller's choice (normalise
beforehand for cosine geometry) and a silent change would make the codes disagree with any other
use of the same vectors.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm


@dataclass(frozen=True, eq=False)
class Quantization:
    """Residual quantisation of ``N`` items into ``L`` levels of sizes ``K_0 .. K_{L-1}``.

    Attributes:
        codes: int64 ``[N, L]``; ``codes[i, l]`` indexes a row of ``codebooks[l]``.
        codebooks: ``L`` float32 arrays ``[K_l, D]``; ``D`` is the embedding dim (rq_kmeans) or
            the latent dim (rq_vae).
        last_residuals: float32 ``[N, D]``, the residual each item fed into the last level.
        method: ``"rqkmeans"`` or ``"rqvae"``.
        reconstruction_mse: mean squared error per element between the embeddings and their
            reconstruction from the codes (rq_kmeans: the sum of the chosen codewords; rq_vae: the
            decoder's output on the quantised latent); None when not computed.
        loss_history: rq_vae's mean training loss per epoch; empty for rq_kmeans.
    """

    codes: np.ndarray
    codebooks: list[np.ndarray]
    last_residuals: np.ndarray
    method: str
    reconstruction_mse: float | None = None
    loss_history: tuple[float, ...] = ()

    def last_level_costs(self) -> np.ndarray:
        """Squared distances, float32 ``[N, K_{L-1}]``, of each last residual to each last-level
        codeword."""
        residuals = torch.from_numpy(self.last_residuals)
        return _sq_dists(residuals, torch.from_numpy(self.codebooks[-1])).float().numpy()

    def code_usage(self) -> list[float]:
        """Per level, the fraction of that level's codes used by at least one item."""
        return [np.unique(codes).size / len(cb) for codes, cb in zip(self.codes.T, self.codebooks)]


def rq_kmeans(
    embeddings: np.ndarray, codebook_sizes: Sequence[int], seed: int = 0, n_init: int = 3
) -> Quantization:
    """Residual k-means: level ``l`` runs k-means with ``K_l`` clusters on the current residuals.

    Args:
        embeddings: float ``[N, E]``, finite, ``N >= max(codebook_sizes)``; used as given
            (cast to float32).
        codebook_sizes: ``K_0 .. K_{L-1}``, each ``>= 1``.
        seed: ``random_state`` of every level's :class:`sklearn.cluster.KMeans`.
        n_init: k-means++ restarts per level (the best inertia wins).

    Returns:
        A :class:`Quantization` with ``D = E`` whose codes are the nearest centroid at each level.
    """
    sizes = _validate(embeddings, codebook_sizes)
    x = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32))
    codebooks = _kmeans_codebooks(x, sizes, seed, n_init)
    codes, last_residuals, quantised = _quantize(x, codebooks)
    return Quantization(
        codes=codes.numpy(),
        codebooks=[cb.numpy() for cb in codebooks],
        last_residuals=last_residuals.numpy(),
        method="rqkmeans",
        reconstruction_mse=F.mse_loss(quantised, x).item(),
    )


def rq_vae(
    embeddings: np.ndarray,
    codebook_sizes: Sequence[int],
    latent_dim: int = 32,
    hidden_dims: Sequence[int] = (256, 128),
    epochs: int = 200,
    batch_size: int = 256,
    lr: float = 1e-3,
    beta: float = 0.25,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Quantization:
    """Train an LC-Rec style RQ-VAE on the embeddings and return the codes of all items.

    Model: MLP encoder ``E -> hidden_dims -> latent_dim`` (ReLU between layers), ``L`` residual
    vector-quantisation levels on the latent, mirrored MLP decoder back to ``E``. Codebooks are
    initialised by residual k-means on the encoded latents of all items. The loss per batch is
    ``MSE(decode(z_q), x) + sum_l (||sg[r_l] - e_l||^2 + beta * ||r_l - sg[e_l]||^2)`` (squared
    norms as means over elements), with a straight-through estimator from ``z_q`` to ``z``.
    Optimiser: Adam. Dead codes: before every epoch after the first, codes that no item uses are
    moved onto the residuals of randomly chosen items (distinct items per level), so that code
    usage, and with it identifier uniqueness, does not collapse.

    Deterministic given ``seed`` on CPU: weights are initialised under ``torch.manual_seed(seed)``
    inside :func:`torch.random.fork_rng` (the caller's CPU RNG state is left untouched), shuffling
    and dead-code restarts use a private generator, and k-means uses ``random_state=seed``.

    Args:
        embeddings: float ``[N, E]``, finite, ``N >= max(codebook_sizes)``; used as given
            (cast to float32).
        codebook_sizes: ``K_0 .. K_{L-1}``, each ``>= 1``.
        progress: show a tqdm bar over epochs with the current loss.

    Returns:
        A :class:`Quantization` with ``D = latent_dim``: codes are the nearest codeword at each
        level for the trained encoder's latents, ``loss_history`` has ``epochs`` entries, and
        ``reconstruction_mse`` is that of the decoded quantised latents.
    """
    sizes = _validate(embeddings, codebook_sizes)
    if min(latent_dim, epochs, batch_size, *hidden_dims) < 1 or lr <= 0:
        raise ValueError("latent_dim, hidden_dims, epochs and batch_size must be >= 1 and lr > 0")
    device = torch.device(device)
    x = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _RQVAE(x.shape[1], hidden_dims, latent_dim).to(device)
    with torch.no_grad():
        codebooks = _kmeans_codebooks(model.encoder(x), sizes, seed, n_init=1)
    model.codebooks = nn.ParameterList(codebooks)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)

    history: list[float] = []
    bar = tqdm(range(epochs), desc="rq-vae", disable=not progress)
    for epoch in bar:
        if epoch:
            model.restart_dead_codes(x, generator)
        total = 0.0
        for batch in torch.randperm(len(x), generator=generator).to(device).split(batch_size):
            loss = model.loss(x[batch], beta)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        history.append(total / len(x))
        bar.set_postfix(loss=f"{history[-1]:.4g}")

    with torch.no_grad():
        codes, last_residuals, z_q = _quantize(model.encoder(x), list(model.codebooks))
        mse = F.mse_loss(model.decoder(z_q), x).item()
    return Quantization(
        codes=codes.cpu().numpy(),
        codebooks=[cb.detach().cpu().numpy() for cb in model.codebooks],
        last_residuals=last_residuals.cpu().numpy(),
        method="rqvae",
        reconstruction_mse=mse,
        loss_history=tuple(history),
    )


class _RQVAE(nn.Module):
    """MLP encoder ``[B, E] -> [B, latent_dim]``, codebooks ``[K_l, latent_dim]``, MLP decoder."""

    def __init__(self, dim: int, hidden_dims: Sequence[int], latent_dim: int) -> None:
        super().__init__()
        self.encoder = _mlp([dim, *hidden_dims, latent_dim])
        self.decoder = _mlp([latent_dim, *reversed(hidden_dims), dim])
        self.codebooks = nn.ParameterList()

    def loss(self, x: torch.Tensor, beta: float) -> torch.Tensor:
        """Scalar loss of a batch ``x [B, E]``: reconstruction MSE plus every level's VQ loss."""
        z = self.encoder(x)
        residual, vq_loss = z, z.new_zeros(())
        for codebook in self.codebooks:
            e = codebook[_nearest(residual.detach(), codebook)]
            codebook_loss = F.mse_loss(e, residual.detach())
            vq_loss = vq_loss + codebook_loss + beta * F.mse_loss(residual, e.detach())
            residual = residual - e.detach()
        # Straight-through: value = sum of the chosen codewords, gradient to z = identity.
        z_q = z - residual.detach()
        return F.mse_loss(self.decoder(z_q), x) + vq_loss

    @torch.no_grad()
    def restart_dead_codes(self, x: torch.Tensor, generator: torch.Generator) -> None:
        """Move every code that no item of ``x [N, E]`` uses onto the residual of a random item."""
        residual = self.encoder(x)
        for codebook in self.codebooks:
            dead = torch.bincount(_nearest(residual, codebook), minlength=len(codebook)) == 0
            picks = torch.randperm(len(x), generator=generator)[: int(dead.sum())].to(x.device)
            codebook[dead] = residual[picks]
            residual = residual - codebook[_nearest(residual, codebook)]


def _mlp(dims: Sequence[int]) -> nn.Sequential:
    """Linear layers through ``dims`` with a ReLU between consecutive ones (none after the last)."""
    layers: list[nn.Module] = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _sq_dists(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances, float64 ``[N, K]``, from ``x [N, D]`` to ``codebook [K, D]``.

    Computed in float64 via ``||x||^2 - 2 x.c + ||c||^2`` so that float32 rounding cannot flip the
    nearest codeword.
    """
    x, codebook = x.double(), codebook.double()
    sq_dists = (x * x).sum(1, keepdim=True) - 2 * x @ codebook.T + (codebook * codebook).sum(1)
    return sq_dists.clamp_min_(0)


def _nearest(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index, int64 ``[N]``, of the codeword nearest to each row of ``x [N, D]``."""
    return _sq_dists(x, codebook).argmin(1)


def _quantize(
    x: torch.Tensor, codebooks: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual-quantise ``x [N, D]`` with codebooks ``[K_l, D]``.

    Returns:
        codes int64 ``[N, L]``, the residual fed into the last level ``[N, D]``, and the sum of
        the chosen codewords ``[N, D]``.
    """
    residual, codes = x, []
    for codebook in codebooks:
        last_residual = residual
        codes.append(_nearest(residual, codebook))
        residual = residual - codebook[codes[-1]]
    return torch.stack(codes, 1), last_residual, x - residual


def _kmeans_codebooks(
    x: torch.Tensor, sizes: Sequence[int], seed: int, n_init: int
) -> list[torch.Tensor]:
    """Residual k-means on ``x [N, D]``: per level, a float32 ``[K_l, D]`` codebook fitted on that
    level's residuals."""
    residual, codebooks = x, []
    for size in sizes:
        from sklearn.cluster import KMeans  # the 'train' extra
        kmeans = KMeans(size, n_init=n_init, random_state=seed).fit(residual.cpu().numpy())
        codebook = torch.from_numpy(kmeans.cluster_centers_.astype(np.float32)).to(x.device)
        residual = residual - codebook[_nearest(residual, codebook)]
        codebooks.append(codebook)
    return codebooks


def _validate(embeddings: np.ndarray, codebook_sizes: Sequence[int]) -> tuple[int, ...]:
    """Check the inputs of :func:`rq_kmeans` / :func:`rq_vae`; return the codebook sizes as ints."""
    if not isinstance(embeddings, np.ndarray):
        kind = type(embeddings).__name__
        raise ValueError(f"embeddings must be a 2-D float numpy array, not a {kind}")
    if embeddings.ndim != 2 or not np.issubdtype(embeddings.dtype, np.floating):
        raise ValueError(
            f"embeddings must be a 2-D float array [num_items, dim], got {embeddings.ndim}-D "
            f"{embeddings.dtype}"
        )
    if embeddings.shape[1] < 1:
        raise ValueError("embeddings have zero dimensions")
    if not np.isfinite(embeddings).all():
        raise ValueError("embeddings contain NaN or inf")
    sizes = tuple(operator.index(size) for size in codebook_sizes)
    if not sizes:
        raise ValueError("codebook_sizes is empty; give one size per level")
    if min(sizes) < 1:
        raise ValueError(f"codebook sizes must be >= 1, got {list(sizes)}")
    if len(embeddings) < max(sizes):
        raise ValueError(
            f"{len(embeddings)} items are fewer than the largest codebook size {max(sizes)}"
        )
    return sizes
