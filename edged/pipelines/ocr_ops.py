"""PP-OCRv4 pre/post-processing (det, cls, rec) as plain functions over numpy arrays.

The daemon runs the three ONNX graphs itself; these functions turn an encoded image into their
input tensors and their output tensors into boxes and text. All images are H x W x 3 uint8 BGR,
the channel order PaddleOCR trained on (it reads with OpenCV and never converts to RGB).
OpenCV is not used: Pillow decodes, and ``contours``, ``geometry`` and ``resample`` redo the
few OpenCV functions PaddleOCR's processing calls, with OpenCV's arithmetic (tests/unit/edged/
test_geometry.py holds them to it).
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyclipper
from PIL import Image, ImageOps

from edged.common.errors import InvalidRequest, PayloadTooLarge
from edged.pipelines import contours, geometry, resample

NOT_AN_IMAGE = "the body is not an image (PNG, JPEG, BMP, WebP, TIFF)"
DEFAULT_MAX_PIXELS = 40_000_000

# PaddleOCR's det NormalizeImage: ImageNet statistics, applied to the BGR planes in that order.
_DET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_DET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
CLS_SHAPE = (48, 192)
REC_HEIGHT = 48
# PaddleOCR never makes a rec batch narrower than its training width 320 (ratio 320/48).
REC_MIN_WIDTH = 320
_MIN_BOX_SIDE = 3  # DB: candidates thinner than this (in map pixels) are noise
_MAX_CANDIDATES = 1000


class DetScale(NamedTuple):
    """How det_preprocess resized the image: resized size / original size, per axis."""

    ratio_h: float
    ratio_w: float


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode PNG/JPEG/BMP/WebP/TIFF bytes into an H x W x 3 uint8 BGR array.

    Grayscale is expanded to three channels, transparency is composited onto white (text drawn
    on a transparent background is usually dark), 16-bit images are scaled to 8 bits, and JPEG
    EXIF orientation is applied. Raises InvalidRequest for bytes that are not an image and
    PayloadTooLarge for images over ``max_pixels``, checked from the header before decoding.
    """
    try:
        # Pillow reads only the header here: the size is known before anything is decoded, so a
        # small file that claims a huge image is refused without allocating it. Formats Pillow
        # cannot identify are refused too, so that this check is never skipped.
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            has_alpha = probe.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
                probe.mode == "P" and "transparency" in probe.info
            )
    except Image.DecompressionBombError as exc:
        # Pillow's own guard (over 2 x 89 M pixels) fired before ours could.
        raise PayloadTooLarge(f"the image is too large: {exc}") from None
    except (OSError, ValueError, SyntaxError, struct.error):
        raise InvalidRequest(NOT_AN_IMAGE) from None
    _check_pixels(width, height, max_pixels)
    try:
        with Image.open(io.BytesIO(data)) as opened:
            # OpenCV, which this replaces, applied EXIF orientation except when it kept alpha.
            oriented = opened if has_alpha else ImageOps.exif_transpose(opened)
            image = _to_array(oriented, has_alpha)
    except Image.DecompressionBombError as exc:
        raise PayloadTooLarge(f"the image is too large: {exc}") from None
    except (OSError, ValueError, SyntaxError, struct.error, EOFError):
        raise InvalidRequest(NOT_AN_IMAGE) from None
    _check_pixels(image.shape[1], image.shape[0], max_pixels)  # in case the header lied
    return _to_bgr8(image)


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
        )


def _to_array(image: Image.Image, has_alpha: bool) -> np.ndarray:
    """Pixels as OpenCV's decoder gave them: gray (H x W, 8 or 16 bits), gray and alpha,
    BGR or BGRA."""
    mode = image.mode
    if mode == "F":
        raise InvalidRequest("only 8- and 16-bit images are supported")
    if mode.startswith("I"):  # 16-bit gray (Pillow's "I;16" family or "I")
        return np.asarray(image, dtype=np.uint32).clip(0, 65535).astype(np.uint16)
    if mode in ("1", "L") and not has_alpha:
        return np.asarray(image.convert("L"))
    if has_alpha and mode in ("LA", "La"):
        return np.asarray(image.convert("LA"))
    if has_alpha:
        rgba = np.asarray(image.convert("RGBA"))
        return np.ascontiguousarray(rgba[:, :, [2, 1, 0, 3]])
    rgb = np.asarray(image.convert("RGB"))
    return np.ascontiguousarray(rgb[:, :, ::-1])


def _to_bgr8(image: np.ndarray) -> np.ndarray:
    if image.dtype == np.uint16:
        image = (image >> 8).astype(np.uint8)
    elif image.dtype != np.uint8:
        raise InvalidRequest("only 8- and 16-bit images are supported")
    if image.ndim == 2:
        return _gray_to_bgr(image[:, :, np.newaxis])
    channels = image.shape[2]
    if channels == 1:
        return _gray_to_bgr(image)
    if channels == 2 or channels == 4:
        alpha = image[:, :, -1:].astype(np.float32) / 255.0
        color = image[:, :, :1] if channels == 2 else image[:, :, :3]
        blended = color.astype(np.float32) * alpha + 255.0 * (1.0 - alpha)
        out = np.clip(blended + 0.5, 0, 255).astype(np.uint8)
        return _gray_to_bgr(out) if channels == 2 else out
    return np.ascontiguousarray(image[:, :, :3])


def _gray_to_bgr(gray: np.ndarray) -> np.ndarray:
    """H x W x 1 to H x W x 3 by a broadcast assignment, which releases the GIL while it copies:
    np.repeat holds it (350 ms for 36 MP, the event loop's stall, issue 44)."""
    out = np.empty((*gray.shape[:2], 3), dtype=gray.dtype)
    out[...] = gray
    return out


def det_preprocess(image: np.ndarray, limit_side_len: int = 960) -> tuple[np.ndarray, DetScale]:
    """Resize (longer side <= limit_side_len, both sides multiples of 32) and normalise for det.

    Returns the float32 [1, 3, H', W'] tensor and the resize ratios for det_postprocess.
    """
    h, w = image.shape[:2]
    ratio = min(1.0, limit_side_len / max(h, w))
    # The backbone downsamples by 32: round to the nearest multiple, but never above the limit
    # nor down to zero.
    cap = max(1, limit_side_len // 32)
    new_h = 32 * max(1, min(cap, round(h * ratio / 32)))
    new_w = 32 * max(1, min(cap, round(w * ratio / 32)))
    resized = resample.resize_linear(image, new_w, new_h)
    x = (resized.astype(np.float32) / 255.0 - _DET_MEAN) / _DET_STD
    tensor = np.ascontiguousarray(x.transpose(2, 0, 1)[np.newaxis], dtype=np.float32)
    return tensor, DetScale(new_h / h, new_w / w)


def det_postprocess(
    prob_map: np.ndarray,
    original_shape: Sequence[int],
    scale: DetScale,
    thresh: float = 0.3,
    box_thresh: float = 0.5,
    unclip_ratio: float = 1.6,
) -> tuple[np.ndarray, np.ndarray]:
    """DB post-processing of the det output [1, 1, H', W'] into text boxes.

    Returns boxes float32 [n, 4, 2] (x, y in original image pixels, clockwise from top-left,
    sorted top-to-bottom then left-to-right) and their scores float32 [n] (mean probability
    inside the unexpanded box).
    """
    pred = np.asarray(prob_map, dtype=np.float32).reshape(prob_map.shape[-2:])
    orig_h, orig_w = int(original_shape[0]), int(original_shape[1])
    # A 2x2 dilation joins characters the threshold split apart (RapidOCR's default).
    bitmap = contours.dilate_2x2((pred > thresh).astype(np.uint8))
    boxes: list[np.ndarray] = []
    scores: list[float] = []
    for hull in contours.contour_hulls(bitmap, _MAX_CANDIDATES):
        rect = geometry.min_area_rect(hull, is_hull=True)
        if min(rect.size) < _MIN_BOX_SIDE:
            continue
        points = geometry.box_points(rect)
        score = _box_score(pred, points)
        if score < box_thresh:
            continue
        expanded = _unclip(points, unclip_ratio)
        if expanded is None:
            continue
        rect = geometry.min_area_rect(expanded)
        if min(rect.size) < _MIN_BOX_SIDE + 2:
            continue
        box = _order_clockwise(geometry.box_points(rect))
        box[:, 0] = np.clip(box[:, 0] / scale.ratio_w, 0, orig_w - 1)
        box[:, 1] = np.clip(box[:, 1] / scale.ratio_h, 0, orig_h - 1)
        # Clipping can flatten a box on the border into a sliver nobody can read.
        if np.linalg.norm(box[0] - box[1]) <= 3 or np.linalg.norm(box[0] - box[3]) <= 3:
            continue
        boxes.append(box)
        scores.append(score)
    if not boxes:
        return np.zeros((0, 4, 2), np.float32), np.zeros((0,), np.float32)
    order = _reading_order(boxes)
    return (
        np.stack([boxes[i] for i in order]).astype(np.float32),
        np.array([scores[i] for i in order], dtype=np.float32),
    )


def _box_score(pred: np.ndarray, points: np.ndarray) -> float:
    """Mean probability inside the polygon (DB's "fast" score)."""
    h, w = pred.shape
    x0 = int(np.clip(np.floor(points[:, 0].min()), 0, w - 1))
    x1 = int(np.clip(np.ceil(points[:, 0].max()), 0, w - 1))
    y0 = int(np.clip(np.floor(points[:, 1].min()), 0, h - 1))
    y1 = int(np.clip(np.ceil(points[:, 1].max()), 0, h - 1))
    mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=np.uint8)
    shifted = (points - np.array([x0, y0], dtype=np.float32)).astype(np.int32)
    geometry.fill_polygon(mask, shifted, 1)
    inside = mask.astype(bool)
    if not inside.any():
        return 0.0  # what cv2.mean answers for an empty mask
    # float64 sum, as OpenCV's masked mean
    return float(pred[y0 : y1 + 1, x0 : x1 + 1][inside].astype(np.float64).mean())


def _unclip(points: np.ndarray, ratio: float) -> np.ndarray | None:
    """Grow the shrunk DB kernel back to the text's extent: offset by area * ratio / perimeter."""
    area = geometry.polygon_area(points)
    perimeter = geometry.polygon_perimeter(points)
    if perimeter <= 0:
        return None
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(points.tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    paths = offset.Execute(area * ratio / perimeter)
    if not paths:
        return None
    # A convex box grows into one polygon; take the largest should rounding split it.
    largest = max(paths, key=lambda p: geometry.polygon_area(np.array(p, np.float32)))
    return np.array(largest, dtype=np.float32)


def _order_clockwise(points: np.ndarray) -> np.ndarray:
    """Order 4 points as top-left, top-right, bottom-right, bottom-left."""
    by_x = points[np.argsort(points[:, 0], kind="stable")]
    left = by_x[:2][np.argsort(by_x[:2, 1], kind="stable")]
    right = by_x[2:][np.argsort(by_x[2:, 1], kind="stable")]
    return np.array([left[0], right[0], right[1], left[1]], dtype=np.float32)


def _reading_order(boxes: list[np.ndarray]) -> list[int]:
    """Indices top-to-bottom, then left-to-right within a line.

    Boxes whose top-left y is within half a line height of the line's first box belong to that
    line: a fixed pixel tolerance (PaddleOCR uses 10) breaks for large or small text.
    """
    by_y = sorted(range(len(boxes)), key=lambda i: (boxes[i][0, 1], boxes[i][0, 0]))
    order: list[int] = []
    line: list[int] = []
    for i in by_y:
        if line:
            first = boxes[line[0]]
            height = float(np.linalg.norm(first[3] - first[0]))
            if boxes[i][0, 1] - first[0, 1] > max(height / 2, 1.0):
                order.extend(sorted(line, key=lambda j: boxes[j][0, 0]))
                line = []
        line.append(i)
    order.extend(sorted(line, key=lambda j: boxes[j][0, 0]))
    return order


def crop_text(image: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Perspective-crop a box (4 points clockwise from top-left) out of the image.

    Crops at least 1.5 times taller than wide are rotated 90 degrees counter-clockwise, on the
    assumption that they hold vertical text read top-to-bottom (PaddleOCR's rule).
    """
    pts = np.asarray(box, dtype=np.float32)
    width = max(1, int(max(np.linalg.norm(pts[0] - pts[1]), np.linalg.norm(pts[2] - pts[3]))))
    height = max(1, int(max(np.linalg.norm(pts[0] - pts[3]), np.linalg.norm(pts[1] - pts[2]))))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
    matrix = resample.perspective_transform(pts, target)
    crop = resample.warp_perspective_cubic(image, matrix, width, height)
    if height / width >= 1.5:
        crop = np.ascontiguousarray(np.rot90(crop))
    return crop


def _resize_pad(crop: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize to ``height`` keeping the aspect ratio (capped at ``width``), normalise to [-1, 1]
    and pad on the right with zeros, as PaddleOCR's cls and rec models were trained."""
    h, w = crop.shape[:2]
    new_w = max(1, min(width, math.ceil(height * w / h)))
    resized = resample.resize_linear(crop, new_w, height).astype(np.float32)
    out = np.zeros((3, height, width), dtype=np.float32)
    out[:, :, :new_w] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out


def cls_preprocess(crops: Sequence[np.ndarray]) -> np.ndarray:
    """The cls input float32 [n, 3, 48, 192] for the given BGR crops."""
    h, w = CLS_SHAPE
    if not crops:
        return np.zeros((0, 3, h, w), dtype=np.float32)
    return np.stack([_resize_pad(c, h, w) for c in crops])


def apply_cls(
    crops: Sequence[np.ndarray], cls_output: np.ndarray, thresh: float = 0.9
) -> list[np.ndarray]:
    """Rotate by 180 degrees the crops that cls (output [n, 2]: P(0 deg), P(180 deg)) says are
    upside down with probability above ``thresh``; the others are returned unchanged."""
    probs = np.asarray(cls_output, dtype=np.float32).reshape(len(crops), 2)
    return [
        np.ascontiguousarray(crop[::-1, ::-1]) if p[1] > p[0] and p[1] > thresh else crop
        for crop, p in zip(crops, probs)
    ]


def rec_preprocess(crops: Sequence[np.ndarray], min_width: int = REC_MIN_WIDTH) -> np.ndarray:
    """The rec input float32 [n, 3, 48, W] for the given BGR crops.

    W fits the widest aspect ratio in the batch (at least ``min_width``); narrower crops are
    padded on the right. Batch crops of similar aspect ratios to waste less compute on padding.
    """
    if not crops:
        return np.zeros((0, 3, REC_HEIGHT, min_width), dtype=np.float32)
    max_ratio = max(c.shape[1] / c.shape[0] for c in crops)
    width = max(min_width, int(REC_HEIGHT * max_ratio))
    return np.stack([_resize_pad(c, REC_HEIGHT, width) for c in crops])


def ctc_decode(rec_output: np.ndarray, keys: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """Greedy CTC decoding of rec output [n, T, C] (softmax probabilities).

    Class 0 is the CTC blank, classes 1..len(keys) are ``keys`` in order, and when
    C == len(keys) + 2 the last class is a space (PP-OCR's ``use_space_char``). Per step take the
    argmax, merge repeats, drop blanks. The confidence is the mean probability of the kept
    steps (0.0 for an empty text).
    """
    probs = np.asarray(rec_output, dtype=np.float32)
    n_classes = probs.shape[-1]
    table = ["", *keys]
    if n_classes == len(keys) + 2:
        table.append(" ")
    elif n_classes != len(keys) + 1:
        raise ValueError(
            f"rec output has {n_classes} classes; {len(keys)} keys need {len(keys) + 1} "
            f"(blank + keys) or {len(keys) + 2} (blank + keys + space)"
        )
    best = probs.argmax(axis=2)
    best_p = probs.max(axis=2)
    texts: list[str] = []
    confidences = np.zeros(len(best), dtype=np.float32)
    for row, (idx, p) in enumerate(zip(best, best_p)):
        keep = idx != 0
        keep[1:] &= idx[1:] != idx[:-1]
        texts.append("".join(table[i] for i in idx[keep]))
        if keep.any():
            confidences[row] = float(p[keep].mean())
    return texts, confidences


def keys_from_onnx_metadata(metadata: Mapping[str, str]) -> list[str]:
    """The rec dictionary from an ONNX model's metadata (entry ``character``: one per line).

    Split on "\\n" only: entries may be whitespace (U+3000 is one), so never strip them.
    """
    text = metadata.get("character")
    if not text:
        raise ValueError("the rec model's metadata has no 'character' entry")
    return _split_keys(text)


def _split_keys(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    # Tolerate CRLF files; "\r" is never a dictionary entry.
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def load_keys(path: str | Path) -> list[str]:
    """Read keys.txt: UTF-8, one character per line ("\\n"), for classes 1..K; blank and space
    are implied (see ctc_decode). The format of PaddleOCR's dictionaries and of save_keys."""
    keys = _split_keys(Path(path).read_text(encoding="utf-8"))
    if not keys:
        raise ValueError(f"{path} holds no keys")
    return keys


def save_keys(keys: Sequence[str], path: str | Path) -> None:
    """Write keys in the format load_keys reads (each followed by "\\n")."""
    bad = [k for k in keys if "\n" in k or k.endswith("\r")]
    if bad:
        raise ValueError(f"keys cannot contain line breaks: {bad[:3]!r}")
    Path(path).write_text("".join(f"{k}\n" for k in keys), encoding="utf-8")
