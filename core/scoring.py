"""Mahalanobis scoring and anomaly-map post-processing (PaDiM, Sec. III-C, Eq. 2).

Shapes: ``B`` images, ``P = H * W`` pixels of the feature grid, ``D`` embedding channels,
``S`` the model's input size in pixels.

Example:
    >>> import torch
    >>> from padim.core.statistics import precision_factor
    >>> x = torch.randn(2, 4, 3)                                    # (B, P, D)
    >>> mean = torch.zeros(4, 3)
    >>> W = precision_factor(torch.eye(3).expand(4, 3, 3), epsilon=0.0)
    >>> torch.allclose(squared_mahalanobis(x, mean, W), x.square().sum(-1))
    True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import IMAGE_SCORES


def squared_mahalanobis(
    embedding: torch.Tensor, mean: torch.Tensor, precision_factor: torch.Tensor, chunk_pixels: int = 128
) -> torch.Tensor:
    """Squared Mahalanobis distance of every pixel of every image, in one batched product.

    ``d^2 = (x - mu)^T Sigma^-1 (x - mu) = ||W (x - mu)||^2`` with ``Sigma^-1 = W^T W``
    (Eq. 2). This returns the **squared** distance, as sklearn's
    ``EmpiricalCovariance.mahalanobis`` does.

    Args:
        embedding: ``(B, P, D)``.
        mean: ``(P, D)``.
        precision_factor: ``(P, D, D)`` lower-triangular ``W`` (see
            :func:`padim.core.statistics.precision_factor`), in the embedding's dtype or a
            narrower one (float16 as a model file stores it): then it is upcast
            ``chunk_pixels`` pixels at a time inside the product, never as a whole, which keeps
            the factors at half the memory for the same result as upcasting them first.
        chunk_pixels: pixels per upcast chunk (128 x D x D floats: 5 MB at D = 100, in cache).

    Returns:
        ``(B, P)`` squared distances, in the embedding's dtype.
    """
    # (P, B, D) written contiguous in one pass: the embedding usually arrives channels-first
    # ((B, D, P) in memory), and bmm would then copy every pixel's (B, D) matrix on its own.
    batch, pixels, dim = embedding.shape
    dtype = torch.result_type(embedding, mean)
    delta = torch.empty((pixels, batch, dim), dtype=dtype, device=embedding.device)
    torch.sub(embedding.transpose(0, 1), mean.unsqueeze(1), out=delta)
    if precision_factor.dtype == dtype:
        whitened_delta = torch.bmm(delta, precision_factor.transpose(1, 2))  # (P, B, D): (W delta)^T, unit covariance
        return whitened_delta.square().sum(dim=-1).transpose(0, 1)  # (B, P)
    squared = torch.empty((pixels, batch), dtype=dtype, device=embedding.device)
    for start in range(0, pixels, chunk_pixels):
        stop = min(start + chunk_pixels, pixels)
        factor = precision_factor[start:stop].to(dtype)  # (c, D, D), upcast in cache
        whitened_delta = torch.bmm(delta[start:stop], factor.transpose(1, 2))  # (c, B, D)
        torch.sum(whitened_delta.square_(), dim=-1, out=squared[start:stop])
    return squared.transpose(0, 1)  # (B, P)


def gaussian_kernel1d(sigma: float, dtype=torch.float32, device=None) -> torch.Tensor:
    """Normalised 1-D Gaussian, radius ``round(4 sigma)`` (as ``scipy.ndimage.gaussian_filter``)."""
    radius = int(4.0 * sigma + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    return (kernel / kernel.sum()).to(dtype=dtype, device=device)


def gaussian_blur(maps: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian smoothing of ``(B, 1, H, W)`` maps, reflecting at the borders."""
    if sigma <= 0:
        return maps
    kernel = gaussian_kernel1d(sigma, maps.dtype, maps.device)
    radius = kernel.numel() // 2
    height, width = maps.shape[-2:]
    mode = "reflect" if radius < min(height, width) else "replicate"
    padded = F.pad(maps, (radius, radius, radius, radius), mode=mode)
    rows = F.conv2d(padded, kernel.view(1, 1, -1, 1))  # blur along H
    return F.conv2d(rows, kernel.view(1, 1, 1, -1))  # then along W


def anomaly_maps(
    squared_distance: torch.Tensor,
    grid_shape: tuple[int, int],
    output_size: int,
    sigma: float,
) -> torch.Tensor:
    """Distance maps at the input resolution (Sec. III-C).

    Square root, bilinear upsampling from the feature grid to ``output_size``
    (``align_corners=False``), Gaussian smoothing (reflecting borders). Upsampling and blur are
    both linear and separable, so they are applied as one precomputed ``(S, H)`` matrix per
    axis: ``A_rows @ X @ A_cols^T``, the same result as ``F.interpolate`` followed by
    :func:`gaussian_blur` for about 1/15 of the arithmetic at 224 px.

    Args:
        squared_distance: ``(B, P)`` from :func:`squared_mahalanobis`.
        grid_shape: ``(H, W)`` of the feature grid, ``H * W == P``.
        output_size: side ``S`` of the model input, in pixels.
        sigma: standard deviation of the Gaussian blur, in output pixels (the paper: 4).

    Returns:
        ``(B, S, S)`` anomaly maps.
    """
    batch = squared_distance.shape[0]
    distance = squared_distance.clamp_min(0).sqrt().view(batch, *grid_shape)  # (B, H, W)
    dtype, device = distance.dtype, distance.device
    rows = upsample_blur_operator(grid_shape[0], output_size, sigma, dtype, device)  # (S, H)
    cols = upsample_blur_operator(grid_shape[1], output_size, sigma, dtype, device)  # (S, W)
    return rows @ distance @ cols.T  # (B, S, S)


@functools.lru_cache(maxsize=32)
def upsample_blur_operator(
    length: int, size: int, sigma: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``(size, length)`` matrix: 1-D linear upsampling then Gaussian blur, as one linear map."""
    basis = torch.eye(length, dtype=torch.float64).unsqueeze(1)  # (L, 1, L): one signal per input sample
    upsampled = F.interpolate(basis, size=size, mode="linear", align_corners=False)  # (L, 1, S)
    if sigma > 0:
        kernel = gaussian_kernel1d(sigma, torch.float64)
        radius = kernel.numel() // 2
        mode = "reflect" if radius < size else "replicate"
        upsampled = F.conv1d(F.pad(upsampled, (radius, radius), mode=mode), kernel.view(1, 1, -1))
    return upsampled[:, 0].T.contiguous().to(dtype=dtype, device=device)


def resize_map(anomaly_map: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """One ``(S, S)`` map, bilinearly resized to ``(height, width)`` (e.g. an image's own size)."""
    return F.interpolate(anomaly_map[None, None], size=(height, width), mode="bilinear", align_corners=False)[0, 0]


def image_scores(
    maps: torch.Tensor,
    method: str = "map_max",
    squared_distance: torch.Tensor | None = None,
    top_fraction: float = 0.01,
) -> torch.Tensor:
    """Image anomaly scores ``(B,)`` from the ``(B, S, S)`` maps.

    Args:
        maps: ``(B, S, S)`` from :func:`anomaly_maps`.
        method: ``map_max`` (the maximum of each map, the paper's), ``patch_max`` (the largest
            distance on the feature grid, before upsampling and smoothing: needs
            ``squared_distance``) or ``top_mean`` (the mean of the ``top_fraction`` largest map
            pixels, at least one).
        squared_distance: ``(B, P)`` from :func:`squared_mahalanobis` (``patch_max`` only).
        top_fraction: share of the map's pixels averaged by ``top_mean``.

    Every method is in distance units, as the map is; ``patch_max`` is never below ``map_max``
    (upsampling and blurring average grid values) and ``top_mean`` never above it.
    """
    if method == "map_max":
        return maps.flatten(1).amax(dim=1)
    if method == "patch_max":
        if squared_distance is None:
            raise ValueError("image score patch_max needs the squared distances")
        return squared_distance.amax(dim=1).clamp_min(0).sqrt()
    if method == "top_mean":
        count = top_count(maps.shape[-2] * maps.shape[-1], top_fraction)
        return maps.flatten(1).topk(count, dim=1, sorted=False).values.mean(dim=1)
    raise ValueError(f"unknown image score {method!r}; choose one of: {', '.join(IMAGE_SCORES)}")


def top_count(pixels: int, fraction: float) -> int:
    """How many of ``pixels`` map pixels ``top_mean`` averages: ``round(fraction * pixels)``, at least 1."""
    return max(1, min(pixels, round(fraction * pixels)))
