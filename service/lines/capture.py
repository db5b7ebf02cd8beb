"""OpenCV, for camera lines: a capture of a device, stream or file, and a frame as bytes."""

from __future__ import annotations


def open_capture(device: int | str):
    """An OpenCV capture of a camera index, a stream URL or a video file."""
    import cv2  # opencv-python-headless: the `camera` extra, imported only where a camera line is

    return cv2.VideoCapture(device)


def encode_frame(frame) -> bytes:
    """A BGR frame as BMP bytes: lossless, and decoded by the service as any uploaded picture."""
    import cv2  # the `camera` extra

    ok, encoded = cv2.imencode(".bmp", frame)
    if not ok:
        raise ValueError("the frame could not be encoded")
    return encoded.tobytes()
