"""Plane geometry for the text detector's boxes, on numpy alone: hulls, minimum-area
rectangles, polygons (the contours themselves are in ``contours``).

The DB detector's post-processing needed OpenCV for a handful of functions; these are their
replacements, written to give the same answers (tests/unit/edged/test_geometry.py compares them
with OpenCV on generated inputs). Where OpenCV's result depends on its arithmetic (float32 in
minAreaRect, fixed point in fillPoly) or on the order it visits points (which hull vertex comes
first, which of two equal rectangles wins), the same arithmetic and order are kept, because a
box one ulp off can move by a whole pixel once it is truncated to integers further on.

Points are (x, y) with y growing downwards, as in images.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

_F32 = np.float32
_XY_SHIFT = 16  # OpenCV's fixed-point precision for polygon edges
_XY_ONE = 1 << _XY_SHIFT


class RotatedRect(NamedTuple):
    """A rectangle as OpenCV's minAreaRect gives it: centre, (width, height), angle in degrees."""

    center: tuple[float, float]
    size: tuple[float, float]
    angle: float


# -- hulls and rectangles --------------------------------------------------------------------


def _cross(o: Sequence[float], a: Sequence[float], b: Sequence[float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def convex_hull_indices(points: np.ndarray, clockwise: bool = True) -> list[int]:
    """Indices of the hull's vertices (no collinear points) in the order and from the start
    ``cv2.convexHull(points, clockwise)`` gives: clockwise with x to the right and y up (a
    negative shoelace sum) from the smallest point by (x, y), or counter-clockwise from the
    largest; then, when the indices can run one way around the hull, from the smallest or
    largest index."""
    pts = [(float(x), float(y)) for x, y in np.asarray(points).reshape(-1, 2)]
    order = sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1], i))
    unique: list[int] = []
    for i in order:
        if not unique or pts[unique[-1]] != pts[i]:
            unique.append(i)
    if len(unique) < 3:
        return unique if clockwise else unique[::-1]
    lower: list[int] = []
    for i in unique:
        while len(lower) >= 2 and _cross(pts[lower[-2]], pts[lower[-1]], pts[i]) >= 0:
            lower.pop()
        lower.append(i)
    upper: list[int] = []
    for i in reversed(unique):
        while len(upper) >= 2 and _cross(pts[upper[-2]], pts[upper[-1]], pts[i]) >= 0:
            upper.pop()
        upper.append(i)
    hull = lower[:-1] + upper[:-1]  # clockwise, from the smallest point
    if not clockwise:
        hull = hull[::-1]
        last = hull.index(unique[-1])
        hull = hull[last:] + hull[:last]
    return _cyclic_shift(hull)


def _cyclic_shift(hull: list[int]) -> list[int]:
    """OpenCV's last step of convexHull: rotate the hull to make its indices ascend or descend
    when they can."""
    n = len(hull)
    if n < 3:
        return hull
    min_i = max_i = lt = 0
    for i in range(1, n):
        lt += hull[i - 1] < hull[i]
        if 1 < lt <= i - 2:
            break
        if hull[i] < hull[min_i]:
            min_i = i
        if hull[i] > hull[max_i]:
            max_i = i
    gap = abs(max_i - min_i)
    if (gap == 1 or gap == n - 1) and (lt <= 1 or lt >= n - 2):
        ascending = (max_i + 1) % n == min_i
        i0 = min_i if ascending else max_i
        if i0 > 0:
            rolled = hull[i0:] + hull[:i0]
            if all((rolled[i] < rolled[i + 1]) == bool(ascending) for i in range(n - 1)):
                return rolled
    return hull


def convex_hull(points: np.ndarray, clockwise: bool = True) -> np.ndarray:
    """The hull's vertices as ``cv2.convexHull(points, clockwise=clockwise)`` returns them."""
    pts = np.asarray(points).reshape(-1, 2)
    return pts[convex_hull_indices(pts, clockwise)]


def min_area_rect(points: np.ndarray, *, is_hull: bool = False) -> RotatedRect:
    """The smallest rectangle around the points, as ``cv2.minAreaRect`` finds it: rotating
    calipers over the hull, in float32 like OpenCV, keeping the last of equal areas, with the
    angle brought into [-90, 0) degrees by swapping width and height (OpenCV >= 4.5).

    ``is_hull``: the points are already the hull, counter-clockwise (saves recomputing it).
    """
    hull = np.asarray(points if is_hull else convex_hull(points, clockwise=False), np.float32)
    n = len(hull)
    if n > 2:
        corner, side1, side2 = _calipers(hull)
        cx = corner[0] + (side1[0] + side2[0]) * _F32(0.5)
        cy = corner[1] + (side1[1] + side2[1]) * _F32(0.5)
        w = _F32(math.sqrt(float(side1[0]) ** 2 + float(side1[1]) ** 2))
        h = _F32(math.sqrt(float(side2[0]) ** 2 + float(side2[1]) ** 2))
        degrees = math.atan2(float(side1[1]), float(side1[0])) * 180.0 / math.pi
    elif n == 2:
        cx = (hull[0, 0] + hull[1, 0]) * _F32(0.5)
        cy = (hull[0, 1] + hull[1, 1]) * _F32(0.5)
        dx = float(hull[1, 0] - hull[0, 0])
        dy = float(hull[1, 1] - hull[0, 1])
        w, h = _F32(math.sqrt(dx * dx + dy * dy)), _F32(0)
        degrees = math.atan2(dy, dx) * 180.0 / math.pi
    else:
        cx, cy = (hull[0, 0], hull[0, 1]) if n == 1 else (_F32(0), _F32(0))
        w = h = _F32(0)
        degrees = 0.0
    while degrees >= 0:
        degrees -= 90.0
        w, h = h, w
    while degrees < -90:
        degrees += 90.0
        w, h = h, w
    return RotatedRect((float(cx), float(cy)), (float(w), float(h)), float(_F32(degrees)))


def _calipers(points: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OpenCV's rotatingCalipers (CALIPERS_MINAREARECT), step for step in float32: a corner of
    the rectangle and its two sides as vectors."""
    n = len(points)
    xs = [_F32(v) for v in points[:, 0]]
    ys = [_F32(v) for v in points[:, 1]]
    vx: list[np.float32] = []
    vy: list[np.float32] = []
    inv: list[np.float32] = []
    left = bottom = right = top = 0
    left_x = right_x = xs[0]
    top_y = bottom_y = ys[0]
    for i in range(n):
        x0, y0 = xs[i], ys[i]
        if x0 < left_x:
            left_x, left = x0, i
        if x0 > right_x:
            right_x, right = x0, i
        if y0 > top_y:
            top_y, top = y0, i
        if y0 < bottom_y:
            bottom_y, bottom = y0, i
        j = i + 1 if i + 1 < n else 0
        dx, dy = xs[j] - x0, ys[j] - y0
        vx.append(dx)
        vy.append(dy)
        inv.append(_F32(1.0 / math.sqrt(float(dx) * float(dx) + float(dy) * float(dy))))
    orientation = _F32(0)
    ax, ay = float(vx[-1]), float(vy[-1])
    for i in range(n):
        bx, by = float(vx[i]), float(vy[i])
        convexity = ax * by - ay * bx
        if convexity != 0:
            orientation = _F32(1.0 if convexity > 0 else -1.0)
            break
        ax, ay = bx, by
    if orientation == 0:
        raise ValueError("the hull's points are collinear")
    base_a, base_b = orientation, _F32(0)
    seq = [bottom, right, top, left]
    minarea = _F32(np.finfo(np.float32).max)
    best = (0, base_a, _F32(0), base_b, _F32(0), 0)
    for _ in range(n):
        # The caliper whose next edge turns least: compare the edges, each rotated into the
        # first caliper's frame, by the sign of a dot product (OpenCV >= 4.5).
        s0, s1, s2, s3 = seq
        rot = (
            (vx[s0], vy[s0]),
            (vy[s1], -vx[s1]),
            (-vx[s2], -vy[s2]),
            (-vy[s3], vx[s3]),
        )
        main = 0
        for k in (1, 2, 3):
            # rot[k] lies clockwise of rot[main]: rot90cw(rot[k]) . rot[main] < 0
            if rot[k][1] * rot[main][0] + -rot[k][0] * rot[main][1] < 0:
                main = k
        p = seq[main]
        lead_x, lead_y = vx[p] * inv[p], vy[p] * inv[p]
        if main == 0:
            base_a, base_b = lead_x, lead_y
        elif main == 1:
            base_a, base_b = lead_y, -lead_x
        elif main == 2:
            base_a, base_b = -lead_x, -lead_y
        else:
            base_a, base_b = -lead_y, lead_x
        seq[main] = 0 if seq[main] + 1 == n else seq[main] + 1
        s0, s1, s2, s3 = seq
        width = (xs[s1] - xs[s3]) * base_a + (ys[s1] - ys[s3]) * base_b
        height = -(xs[s2] - xs[s0]) * base_b + (ys[s2] - ys[s0]) * base_a
        area = width * height
        if area <= minarea:
            minarea = area
            best = (s3, base_a, width, base_b, height, s0)
    s3, a1, width, b1, height, s0 = best
    a2, b2 = -b1, a1
    c1 = a1 * xs[s3] + ys[s3] * b1
    c2 = a2 * xs[s0] + ys[s0] * b2
    idet = _F32(1) / (a1 * b2 - a2 * b1)
    corner = np.array([(c1 * b2 - c2 * b1) * idet, (a1 * c2 - a2 * c1) * idet], np.float32)
    return corner, np.array([a1 * width, b1 * width]), np.array([a2 * height, b2 * height])


def box_points(rect: RotatedRect) -> np.ndarray:
    """The rectangle's four corners, float32 [4, 2], in ``cv2.boxPoints``'s order."""
    theta = float(_F32(rect.angle)) * math.pi / 180.0
    b = _F32(math.cos(theta)) * _F32(0.5)
    a = _F32(math.sin(theta)) * _F32(0.5)
    cx, cy = _F32(rect.center[0]), _F32(rect.center[1])
    w, h = _F32(rect.size[0]), _F32(rect.size[1])
    p0 = (cx - a * h - b * w, cy + b * h - a * w)
    p1 = (cx + a * h - b * w, cy - b * h - a * w)
    p2 = (cx + a * h + b * w, cy - b * h + a * w)
    p3 = (cx - a * h + b * w, cy + b * h + a * w)
    return np.array([p0, p1, p2, p3], dtype=np.float32)


# -- polygons ------------------------------------------------------------------------------


def polygon_area(points: np.ndarray) -> float:
    """The polygon's area (absolute), as ``cv2.contourArea``: the shoelace sum in double."""
    pts = np.asarray(points, dtype=np.float32).reshape(-1, 2).astype(np.float64)
    if len(pts) < 3:
        return 0.0
    prev = np.roll(pts, 1, axis=0)
    terms = prev[:, 0] * pts[:, 1] - prev[:, 1] * pts[:, 0]
    total = 0.0
    for term in terms.tolist():  # summed in order, as OpenCV does
        total += term
    return abs(total * 0.5)


def polygon_perimeter(points: np.ndarray) -> float:
    """The closed polygon's perimeter, as ``cv2.arcLength(points, True)``: each side's length
    in float32, summed in double."""
    pts = np.asarray(points, dtype=np.float32).reshape(-1, 2)
    if len(pts) < 2:
        return 0.0
    d = pts - np.roll(pts, 1, axis=0)
    lengths = np.sqrt(d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1])
    total = 0.0
    for length in lengths.tolist():
        total += length
    return total


def fill_polygon(mask: np.ndarray, points: np.ndarray, value: int = 1) -> None:
    """Fill a polygon given by int32 vertices into a 2-D uint8 mask in place, pixel for pixel as
    ``cv2.fillPoly(mask, [points], value)``: its edges as 8-connected lines, then the rows
    between them with OpenCV's fixed-point rule."""
    pts = np.asarray(points, dtype=np.int64).reshape(-1, 2)
    n = len(pts)
    edges: list[tuple[int, int, int, int]] = []  # y0, y1, x (fixed point), dx (fixed point)
    for i in range(n):
        x0, y0 = int(pts[i - 1, 0]), int(pts[i - 1, 1])
        x1, y1 = int(pts[i, 0]), int(pts[i, 1])
        _draw_line(mask, x0, y0, x1, y1, value)
        if y0 == y1:
            continue
        fx0, fx1 = x0 << _XY_SHIFT, x1 << _XY_SHIFT
        dx = _trunc_div(fx1 - fx0, y1 - y0)
        edges.append((y0, y1, fx0, dx) if y0 < y1 else (y1, y0, fx1, dx))
    if len(edges) < 2:
        return
    _fill_edges(mask, edges, value)


def _trunc_div(a: int, b: int) -> int:
    """C's integer division (towards zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _draw_line(mask: np.ndarray, x0: int, y0: int, x1: int, y1: int, value: int) -> None:
    """An 8-connected line from (x0, y0) to (x1, y1), as OpenCV's LineIterator steps it."""
    h, w = mask.shape
    if not (0 <= x0 < w and 0 <= y0 < h and 0 <= x1 < w and 0 <= y1 < h):
        clipped = _clip_line(w, h, x0, y0, x1, y1)
        if clipped is None:
            return
        x0, y0, x1, y1 = clipped
    if x1 < x0:  # OpenCV draws every line left to right
        x0, y0, x1, y1 = x1, y1, x0, y0
    dx, dy = abs(x1 - x0), abs(y1 - y0)
    sx = -1 if x1 < x0 else 1
    sy = -1 if y1 < y0 else 1
    steep = dy > dx
    major, minor = (dy, dx) if steep else (dx, dy)
    i = np.arange(major + 1)
    # The error term starts at major - 2*minor and the minor step is taken whenever it is
    # negative: after i steps the minor coordinate has moved ceil((2*minor*i - major) / 2*major).
    moved = -((major - 2 * minor * i) // (2 * major)) if major else i * 0
    if steep:
        mask[y0 + sy * i, x0 + sx * moved] = value
    else:
        mask[y0 + sy * moved, x0 + sx * i] = value


def _clip_line(w: int, h: int, x1: int, y1: int, x2: int, y2: int) -> tuple[int, ...] | None:
    """OpenCV's clipLine: the part of the segment inside a w x h image, in integers (as
    OpenCV computes it), or None when none is."""
    right, bottom = w - 1, h - 1

    def code(x: int, y: int) -> int:
        return (x < 0) + (x > right) * 2 + (y < 0) * 4 + (y > bottom) * 8

    c1, c2 = code(x1, y1), code(x2, y2)
    if (c1 & c2) == 0 and (c1 | c2) != 0:
        if c1 & 12:
            a = 0 if c1 < 8 else bottom
            x1 += int((a - y1) * (x2 - x1) / (y2 - y1))
            y1 = a
            c1 = (x1 < 0) + (x1 > right) * 2
        if c2 & 12:
            a = 0 if c2 < 8 else bottom
            x2 += int((a - y2) * (x2 - x1) / (y2 - y1))
            y2 = a
            c2 = (x2 < 0) + (x2 > right) * 2
        if (c1 & c2) == 0 and (c1 | c2) != 0:
            if c1:
                a = 0 if c1 == 1 else right
                y1 += int((a - x1) * (y2 - y1) / (x2 - x1))
                x1 = a
                c1 = 0
            if c2:
                a = 0 if c2 == 1 else right
                y2 += int((a - x2) * (y2 - y1) / (x2 - x1))
                x2 = a
                c2 = 0
    return (x1, y1, x2, y2) if (c1 | c2) == 0 else None


def _fill_edges(mask: np.ndarray, edges: list[tuple[int, int, int, int]], value: int) -> None:
    """OpenCV's FillEdgeCollection for the simple polygons used here: on each row, fill between
    pairs of active edges (x rounded up on the left, down on the right)."""
    h, w = mask.shape
    y_min = min(e[0] for e in edges)
    y_max = min(max(e[1] for e in edges), h)
    for y in range(max(y_min, 0), y_max):
        xs = sorted(x + (y - y0) * dx for y0, y1, x, dx in edges if y0 <= y < y1)
        for left, right in zip(xs[0::2], xs[1::2]):
            x1 = (left + _XY_ONE - 1) >> _XY_SHIFT
            x2 = right >> _XY_SHIFT
            if x1 < w and x2 >= 0:
                mask[y, max(x1, 0) : min(x2, w - 1) + 1] = value
