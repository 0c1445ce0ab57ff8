"""Gradient-boosted regression trees on binned features, in numpy: the learner behind the cost model.

Squared loss, depth-limited trees grown level by level from per-bin gradient histograms (each feature cut at up to
BINS quantiles of its training values), shrinkage and seeded row subsampling. Small on purpose: it needs nothing
the GPU image lacks (no scikit-learn, no scipy), trains on tens of thousands of rows in a fraction of a second, and
the same data and seed always give the same trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BINS = 32


@dataclass(frozen=True)
class Settings:
    trees: int = 60
    depth: int = 4
    learning_rate: float = 0.15
    min_leaf: float = 3.0  # least total row weight on either side of a split
    l2: float = 1.0  # shrinks the value of leaves with little weight
    subsample: float = 0.5  # the share of rows each tree is grown on (drawn afresh for each)
    seed: int = 0


@dataclass(frozen=True)
class Booster:
    cuts: tuple[np.ndarray, ...]  # per feature, ascending: bin b holds values in (cuts[b-1], cuts[b]]
    base: float
    split_feature: np.ndarray  # (trees, 2^depth - 1); -1: no split, every row goes left
    split_bin: np.ndarray  # (trees, 2^depth - 1): rows whose bin is above it go right
    leaf_value: np.ndarray  # (trees, 2^depth), shrinkage applied

    @property
    def depth(self) -> int:
        return int(np.log2(self.leaf_value.shape[1]))

    def predict(self, x: np.ndarray) -> np.ndarray:
        xb = bin_features(np.asarray(x, dtype=float), self.cuts)
        out = np.full(len(xb), self.base)
        inner = self.split_feature.shape[1]
        for t in range(len(self.leaf_value)):
            out += self.leaf_value[t, _leaf_of(xb, self.split_feature[t], self.split_bin[t], self.depth) - inner]
        return out


def make_cuts(x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Cut points per feature (at most BINS - 1): midpoints between its distinct values, or between quantiles where
    there are more than BINS of them."""
    cuts = []
    for column in x.T:
        values = np.unique(column)
        if len(values) > BINS:
            values = np.unique(np.quantile(column, np.linspace(0, 1, BINS)))
        cuts.append((values[:-1] + values[1:]) / 2)
    return tuple(cuts)


def bin_features(x: np.ndarray, cuts: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.stack([np.searchsorted(c, x[:, j], side="left") for j, c in enumerate(cuts)], axis=1).astype(np.uint8)


def fit(x: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None, settings: Settings = Settings()) -> Booster:
    """Trees that predict y from x (rows of features), rows weighted by `weight`."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    w = np.ones(len(y)) if weight is None else np.asarray(weight, dtype=float)
    if x.ndim != 2 or len(x) != len(y) or len(y) != len(w) or len(y) == 0:
        raise ValueError(f"fit wants rows of features and one target and weight per row, got x {x.shape}, "
                         f"y {y.shape}, weight {w.shape}")
    cuts = make_cuts(x)
    xb = bin_features(x, cuts)
    base = float(np.average(y, weights=w))
    pred = np.full(len(y), base)
    rng = np.random.default_rng(settings.seed)
    inner, leaves = 2**settings.depth - 1, 2**settings.depth
    split_feature = np.full((settings.trees, inner), -1, dtype=np.int64)
    split_bin = np.zeros((settings.trees, inner), dtype=np.int64)
    leaf_value = np.zeros((settings.trees, leaves))
    for t in range(settings.trees):
        rows = np.flatnonzero(rng.random(len(y)) < settings.subsample)
        if len(rows) == 0:
            rows = np.arange(len(y))
        g, h = w[rows] * (y[rows] - pred[rows]), w[rows]  # the negative gradient and the hessian of squared loss
        node = _grow(xb[rows], g, h, settings, split_feature[t], split_bin[t])
        sums_g = np.bincount(node - inner, weights=g, minlength=leaves)
        sums_h = np.bincount(node - inner, weights=h, minlength=leaves)
        leaf_value[t] = settings.learning_rate * sums_g / (sums_h + settings.l2)
        pred += leaf_value[t, _leaf_of(xb, split_feature[t], split_bin[t], settings.depth) - inner]
    return Booster(cuts, base, split_feature, split_bin, leaf_value)


def _grow(xb: np.ndarray, g: np.ndarray, h: np.ndarray, s: Settings, feature: np.ndarray,
          threshold: np.ndarray) -> np.ndarray:
    """Choose one tree's splits level by level (filling feature and threshold); returns each row's leaf node.
    Histograms of g and h per (node, feature, bin) are summed for the left children only; a right child's is its
    parent's less its sibling's."""
    n, features = xb.shape
    cells = xb + (np.arange(features, dtype=np.int32) * BINS)[None, :]
    node = np.zeros(n, dtype=np.int64)
    hist = _histograms(cells, g, h, node, 1)
    for level in range(s.depth):
        first, count = 2**level - 1, 2**level
        if level:
            local = node - first
            left = np.flatnonzero(local % 2 == 0)
            sums = _histograms(cells.take(left, axis=0), g[left], h[left], local[left] // 2, count // 2)
            children = np.empty((2, count, features, BINS))
            children[:, 0::2], children[:, 1::2] = sums, hist - sums
            hist = children
        left_g, left_h = np.cumsum(hist[0], axis=2), np.cumsum(hist[1], axis=2)
        total_g, total_h = left_g[:, :, -1:], left_h[:, :, -1:]
        right_g, right_h = total_g - left_g, total_h - left_h
        gain = left_g**2 / (left_h + s.l2) + right_g**2 / (right_h + s.l2) - total_g**2 / (total_h + s.l2)
        gain[(left_h < s.min_leaf) | (right_h < s.min_leaf)] = -np.inf
        flat = gain.reshape(count, -1)
        best = np.argmax(flat, axis=1)  # the first of equal gains: deterministic
        ok = flat[np.arange(count), best] > 1e-12
        feature[first:first + count] = np.where(ok, best // BINS, -1)
        threshold[first:first + count] = np.where(ok, best % BINS, 0)
        node = _descend(xb, node, feature, threshold)
    return node


def _histograms(cells: np.ndarray, g: np.ndarray, h: np.ndarray, node: np.ndarray, count: int) -> np.ndarray:
    """Sums of g and h per (node, feature, bin) over the given rows: shape (2, count, features, BINS)."""
    features = cells.shape[1]
    index = (node[:, None] * (features * BINS) + cells).ravel()
    size = count * features * BINS
    return np.stack([np.bincount(index, weights=np.repeat(v, features), minlength=size).reshape(count, features, BINS)
                     for v in (g, h)])


def _descend(xb: np.ndarray, node: np.ndarray, feature: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """Each row's child node one level down."""
    f, b = feature[node], threshold[node]
    rows = np.arange(0, xb.size, xb.shape[1])  # where each row starts in the flat array
    return 2 * node + 1 + ((f >= 0) & (xb.ravel().take(rows + np.maximum(f, 0)) > b))


def _leaf_of(xb: np.ndarray, feature: np.ndarray, threshold: np.ndarray, depth: int) -> np.ndarray:
    node = np.zeros(len(xb), dtype=np.int64)
    for _ in range(depth):
        node = _descend(xb, node, feature, threshold)
    return node
