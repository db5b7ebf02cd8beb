"""Pictures in: reading and decoding images, and generated data sets.

``images`` (decoding every mode Pillow reads to RGB, EXIF orientation, draft-mode JPEG decoding,
size limits, batches), ``synthetic`` (texture data sets with drawn defects, MVTec AD layout).

May import: numpy, Pillow, torch. Nothing else of padim.
"""
