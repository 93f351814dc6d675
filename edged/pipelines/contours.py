"""The contours of the text detector's binary map, as their convex hulls, on numpy alone.

OpenCV's findContours follows every border pixel by pixel; the detector only fits a rectangle
to each contour's convex hull, so the hulls are all it needs, and they come from horizontal
runs of pixels without following any border: an outer border's hull is the hull of its
8-connected component; a hole's border (the hole a 4-connected region of background that does
not reach the image's edge) is made of the enclosing component's pixels 4-adjacent to it, and
each row's leftmost and rightmost of them are among a few candidates per run of the hole.
tests/unit/edged/test_geometry.py checks the hulls against OpenCV's contours.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from edged.pipelines.geometry import convex_hull


def dilate_2x2(bitmap: np.ndarray) -> np.ndarray:
    """Dilation by a 2x2 square with OpenCV's default anchor: each pixel takes the maximum of
    itself and its neighbours above, to the left and above-left (outside the image is ignored)."""
    out = bitmap.copy()
    out[1:, :] = np.maximum(out[1:, :], bitmap[:-1, :])
    out[:, 1:] = np.maximum(out[:, 1:], out[:, :-1])
    return out


class _Runs(NamedTuple):
    row: np.ndarray  # int64, the run's row
    start: np.ndarray  # first column
    end: np.ndarray  # last column (inclusive)


def _runs(mask: np.ndarray) -> _Runs:
    """Horizontal runs of True in a 2-D bool array, in raster order."""
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    step = np.diff(padded, axis=1)
    rows, starts = np.nonzero(step == 1)
    _, ends = np.nonzero(step == -1)
    return _Runs(rows.astype(np.int64), starts.astype(np.int64), ends.astype(np.int64) - 1)


def _touching(runs: _Runs, width: int, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i, j) of runs in consecutive rows (j one row below i) that connect: columns
    overlapping (reach 0: 4-connectivity) or touching diagonally (reach 1: 8-connectivity)."""
    key = width + 3
    start_key = runs.row * key + runs.start
    end_key = runs.row * key + runs.end
    lo = np.searchsorted(end_key, (runs.row + 1) * key + runs.start - reach, side="left")
    hi = np.searchsorted(start_key, (runs.row + 1) * key + runs.end + reach, side="right")
    counts = np.maximum(hi - lo, 0)
    first = np.repeat(np.arange(len(counts)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return first, np.repeat(lo, counts) + offsets


def _components(n: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Connected components of a graph on n nodes: each node's label is the smallest node of
    its component (so the label of a run is the component's first run in raster order)."""
    label = np.arange(n)
    while True:
        a, b = label[first], label[second]
        if np.array_equal(a, b):
            return label
        # Hook each root to the smallest root it touches, then flatten the trees.
        np.minimum.at(label, np.maximum(a, b), np.minimum(a, b))
        while True:
            flat = label[label]
            if np.array_equal(flat, label):
                break
            label = flat


def _groups(labels: np.ndarray, wanted: np.ndarray) -> list[np.ndarray]:
    """For each wanted label, the indices that carry it."""
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    lo = np.searchsorted(sorted_labels, wanted, side="left")
    hi = np.searchsorted(sorted_labels, wanted, side="right")
    return [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]


def contour_hulls(bitmap: np.ndarray, limit: int | None = None) -> list[np.ndarray]:
    """The convex hulls of what ``cv2.findContours(bitmap, RETR_LIST, CHAIN_APPROX_SIMPLE)``
    returns, in its order (by first pixel in raster order, last first), each as int64 [k, 2]
    points in the order ``cv2.convexHull(contour, clockwise=False)`` gives them, the order
    minAreaRect walks. Only the first ``limit`` contours are made into hulls: a noisy map has
    many, and their order is known before any hull is."""
    fg = np.asarray(bitmap) != 0
    w = fg.shape[1]
    runs = _runs(fg)
    if len(runs.row) == 0:
        return []
    label = _components(len(runs.row), *_touching(runs, w, 1))
    roots = np.flatnonzero(label == np.arange(len(label)))
    outer_keys = runs.row[roots] * w + runs.start[roots]
    holes = _holes(fg)
    hole_keys = holes.first_y * w + holes.first_x
    keys = np.concatenate([outer_keys, hole_keys])
    order = np.argsort(-keys, kind="stable")[:limit]
    chosen_outer = order[order < len(roots)]
    chosen_holes = order[order >= len(roots)] - len(roots)
    hulls: dict[int, np.ndarray] = {}
    for i, members in zip(chosen_outer.tolist(), _groups(label, roots[chosen_outer])):
        points = np.concatenate(
            [
                np.stack([runs.start[members], runs.row[members]], axis=1),
                np.stack([runs.end[members], runs.row[members]], axis=1),
            ]
        )
        start = (int(runs.start[roots[i]]), int(runs.row[roots[i]]))
        hulls[i] = _outer_hull(points, start)
    if len(chosen_holes):
        key = w + 3
        run_keys = runs.row * key + runs.start
        # Only the enclosing component's pixels are the hole's border, not an island's.
        comp = label[np.searchsorted(run_keys, holes.ys * key + holes.xs, side="right") - 1]
        for j, members in zip(chosen_holes.tolist(), _groups(holes.hole, chosen_holes)):
            sx, sy = int(holes.first_x[j]), int(holes.first_y[j])
            enclosing = label[np.searchsorted(run_keys, sy * key + sx, side="right") - 1]
            members = members[comp[members] == enclosing]
            points = np.stack([holes.xs[members], holes.ys[members]], axis=1)
            hulls[len(roots) + j] = _hole_hull(points, (sx, sy))
    return [hulls[i] for i in order.tolist()]


class _Holes(NamedTuple):
    first_x: np.ndarray  # per hole: its border's first pixel (left of its first run)
    first_y: np.ndarray
    xs: np.ndarray  # candidate border pixels, all holes together
    ys: np.ndarray
    hole: np.ndarray  # the hole (0..n-1) each candidate belongs to


def _holes(fg: np.ndarray) -> _Holes:
    """The holes of the map and the candidate pixels of their borders (module docstring)."""
    h, w = fg.shape
    empty = np.zeros(0, np.int64)
    # Background with a frame around it, so that everything reaching the edge is one region.
    bg = np.ones((h + 2, w + 2), dtype=bool)
    bg[1:-1, 1:-1] = ~fg
    runs = _runs(bg)
    label = _components(len(runs.row), *_touching(runs, w + 2, 0))
    inside = label != label[0]
    if not inside.any():
        return _Holes(empty, empty, empty, empty, empty)
    firsts, hole = np.unique(label[inside], return_inverse=True)
    # Back to the image's coordinates.
    row, start, end = runs.row[inside] - 1, runs.start[inside] - 1, runs.end[inside] - 1
    xs = [start - 1, end + 1]
    ys = [row, row]
    which = [hole, hole]
    for dy in (-1, 1):
        for x in (start, end):
            keep = fg[row + dy, x]
            xs.append(x[keep])
            ys.append((row + dy)[keep])
            which.append(hole[keep])
    return _Holes(
        runs.start[firsts] - 2,
        runs.row[firsts] - 1,
        np.concatenate(xs),
        np.concatenate(ys),
        np.concatenate(which),
    )


def _outer_hull(points: np.ndarray, start: tuple[int, int]) -> np.ndarray:
    """The hull as minAreaRect orders it for an outer border: OpenCV traces the border
    clockwise from its first pixel, so the counter-clockwise hull of the contour's indices
    descends and starts at the vertex the trace reaches last, the one after the first pixel."""
    hull = convex_hull(points, clockwise=False)
    at = np.flatnonzero((hull[:, 0] == start[0]) & (hull[:, 1] == start[1]))
    return np.roll(hull, -(int(at[0]) + 1), axis=0) if len(at) else hull


def _hole_hull(points: np.ndarray, start: tuple[int, int]) -> np.ndarray:
    """The hull as minAreaRect orders it for a hole border: OpenCV traces it counter-clockwise
    from its first pixel, so the hull starts at the first vertex the trace reaches (the first
    pixel itself when it is a vertex; else the next one by angle around the hull's centre)."""
    hull = convex_hull(points, clockwise=False)
    if len(hull) < 3:
        return hull
    at = np.flatnonzero((hull[:, 0] == start[0]) & (hull[:, 1] == start[1]))
    if len(at):
        return np.roll(hull, -int(at[0]), axis=0)
    centre = hull.mean(axis=0)
    angles = np.arctan2(hull[:, 1] - centre[1], hull[:, 0] - centre[0])
    own = math.atan2(start[1] - centre[1], start[0] - centre[0])
    return np.roll(hull, -int(np.argmin((angles - own) % (2 * math.pi))), axis=0)
