"""Backbones and embeddings: which network, which weights, and the per-pixel PaDiM embedding.

``backbones`` (the torchvision networks, their weight sources and the checks on weights files),
``embedding`` (the multi-layer feature maps, the channel reduction, the embedding grid).

May import: :mod:`padim.core`, torch, torchvision, :mod:`padim.models.data`.
"""
