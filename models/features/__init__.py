"""Backbones and embeddings: which network, which weights, and the per-pixel PaDiM embedding.

``backbones`` (the one constructor of every family's torchvision network, their weight sources and the checks on
weights files; what each backbone gives is :mod:`padim.models.families`'),
``embedding`` (the multi-layer feature maps, the channel reduction, the embedding grid), ``photometric`` (each
picture's light set before the backbone: ``train --standardise``), ``quantised`` (the int8 backbone of ``train
--precision int8``: quantised from the training pictures, run by ONNX Runtime).

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`,
:mod:`padim.models.options`, :mod:`padim.models.devices`, :mod:`padim.models.data`, :mod:`padim.models.config`;
torch, torchvision; onnx and onnxruntime for an int8 backbone.
"""
