"""Pictures in: reading and decoding images, where the model looks, changed copies, generated data sets.

``images`` (decoding every mode Pillow reads to RGB, EXIF orientation, draft-mode JPEG decoding, size limits,
batches), ``framing`` (the region of interest, resize mode and tiles: a picture to model input and a map back),
``changes`` (the changed copies ``--expect`` fits and scores), ``spread`` (how far the training pictures' own
light, placement, focus and compression wander: ``--expect auto``), ``synthetic`` (texture data sets with drawn
defects, MVTec AD layout).

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`;
numpy, Pillow, torch.
"""
