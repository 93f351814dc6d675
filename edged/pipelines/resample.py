"""Image resampling for the OCR pipeline on numpy alone: resize, perspective crop.

PaddleOCR's models were trained on images that OpenCV resized and warped, and the detector's
threshold turns small differences in its input into moved box edges, so these follow OpenCV's
arithmetic for uint8 images (fixed-point weights, the same rounding) rather than Pillow's
filters, which weigh pixels differently (antialiasing on downscale, another cubic kernel).
tests/unit/edged/test_geometry.py measures how close they come.
"""

from __future__ import annotations

import numpy as np

_RESIZE_BITS = 11  # OpenCV's INTER_RESIZE_COEF_BITS
_RESIZE_ONE = 1 << _RESIZE_BITS


def _linear_axis(src: int, dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each output position along one axis: the two source indices, their fixed-point
    weights, and whether the pair is real (OpenCV takes the first pixel alone, unweighted,
    where the second would fall past the edge)."""
    scale = src / dst
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    i = np.floor(f).astype(np.int64)
    f = f - i.astype(np.float32)
    low = i < 0
    f[low], i[low] = 0, 0
    high = i >= src - 1
    f[high], i[high] = 0, src - 1
    w0 = np.rint((np.float32(1) - f) * np.float32(_RESIZE_ONE)).astype(np.int64)
    w1 = np.rint(f * np.float32(_RESIZE_ONE)).astype(np.int64)
    return i, np.minimum(i + 1, src - 1), np.stack([w0, w1]), ~high


def resize_linear(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """Bilinear resize of a uint8 H x W (x C) image to width x height, as ``cv2.resize`` with
    its default INTER_LINEAR: 11-bit weights per axis, rows first, then the vertical sum
    rounded the way OpenCV's vector code does it (within 1 of its scalar code)."""
    src = np.asarray(image)
    squeeze = src.ndim == 2
    if squeeze:
        src = src[:, :, np.newaxis]
    h, w = src.shape[:2]
    y0, y1, wy, _ = _linear_axis(h, height)
    x0, x1, wx, pair_x = _linear_axis(w, width)
    wx = wx.copy()
    wx[0, ~pair_x], wx[1, ~pair_x] = _RESIZE_ONE, 0
    # Only the source rows that some output row reads, each resized horizontally once.
    rows = np.unique(np.concatenate([y0, y1]))
    picked = src[rows].astype(np.int32)
    across = picked[:, x0] * wx[0][:, None].astype(np.int32) + picked[:, x1] * wx[1][
        :, None
    ].astype(np.int32)
    top = across[np.searchsorted(rows, y0)]
    bottom = across[np.searchsorted(rows, y1)]
    b0 = wy[0].astype(np.int32)[:, None, None]
    b1 = wy[1].astype(np.int32)[:, None, None]
    # OpenCV's SIMD path: (((S0 >> 4) * b0) >> 16) + (((S1 >> 4) * b1) >> 16), then (+2) >> 2.
    total = ((top >> 4) * b0 >> 16) + ((bottom >> 4) * b1 >> 16)
    out = np.clip((total + 2) >> 2, 0, 255).astype(np.uint8)
    return out[:, :, 0] if squeeze else out


def perspective_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 3 x 3 matrix mapping four src points onto four dst points, as
    ``cv2.getPerspectiveTransform`` solves it (the 8 x 8 system, in double)."""
    a = np.zeros((8, 8), np.float64)
    b = np.zeros(8, np.float64)
    for i in range(4):
        x, y = np.float32(src[i][0]), np.float32(src[i][1])
        u, v = np.float32(dst[i][0]), np.float32(dst[i][1])
        # OpenCV multiplies the float32 points before widening to double.
        a[i] = [x, y, 1, 0, 0, 0, -x * u, -y * u]
        a[i + 4] = [0, 0, 0, x, y, 1, -x * v, -y * v]
        b[i], b[i + 4] = u, v
    m = np.linalg.solve(a, b)
    return np.append(m, 1.0).reshape(3, 3)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """Keys' cubic kernel with a = -0.75 (OpenCV's) for the four taps around each fractional
    offset t in [0, 1): [..., 4] float32."""
    a = np.float32(-0.75)
    t = t.astype(np.float32)
    one = np.float32(1)
    u = t + one
    c0 = ((a * u - np.float32(5) * a) * u + np.float32(8) * a) * u - np.float32(4) * a
    c1 = ((a + np.float32(2)) * t - (a + np.float32(3))) * t * t + one
    v = one - t
    c2 = ((a + np.float32(2)) * v - (a + np.float32(3))) * v * v + one
    return np.stack([c0, c1, c2, one - c0 - c1 - c2], axis=-1)


def warp_perspective_cubic(
    image: np.ndarray, matrix: np.ndarray, width: int, height: int
) -> np.ndarray:
    """Warp a uint8 H x W x C image by a 3 x 3 matrix (source to destination) into width x
    height, as ``cv2.warpPerspective(image, matrix, (width, height), flags=INTER_CUBIC,
    borderMode=BORDER_REPLICATE)`` does in OpenCV 5: each output pixel's exact source position,
    4 x 4 cubic weights, edge pixels repeated outwards. (OpenCV 4 rounded the position to 1/32
    pixel first: a difference of a few grey levels, not of what is read.)"""
    src = np.asarray(image)
    h, w = src.shape[:2]
    inv = np.linalg.inv(np.asarray(matrix, np.float64))
    xs = np.arange(width, dtype=np.float64)[None, :]
    ys = np.arange(height, dtype=np.float64)[:, None]
    den = inv[2, 0] * xs + inv[2, 1] * ys + inv[2, 2]
    den = np.where(den != 0, den, np.inf)
    fx = (inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2]) / den
    fy = (inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]) / den
    # Far outside the image every tap repeats the edge: clamping the position keeps it so.
    fx = np.clip(fx, -4.0, w + 4.0)
    fy = np.clip(fy, -4.0, h + 4.0)
    x0 = np.floor(fx)
    y0 = np.floor(fy)
    wx = _cubic_weights(fx - x0)
    wy = _cubic_weights(fy - y0)
    x0i = x0.astype(np.int64) - 1
    y0i = y0.astype(np.int64) - 1
    extra = src.shape[2:]
    acc = np.zeros((height, width, *extra), np.float32)
    for r in range(4):
        rows = np.clip(y0i + r, 0, h - 1)
        part = np.zeros_like(acc)
        for c in range(4):
            cols = np.clip(x0i + c, 0, w - 1)
            weight = wx[..., c] if not extra else wx[..., c, None]
            part += src[rows, cols].astype(np.float32) * weight
        acc += part * (wy[..., r] if not extra else wy[..., r, None])
    return np.clip(np.rint(acc), 0, 255).astype(np.uint8)
