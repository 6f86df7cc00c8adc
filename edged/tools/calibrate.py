"""``edged calibrate``: an anomaly model's thresholds, from how it scores good parts.

An anomaly model learns from good parts only, and its export's threshold was chosen on anomalib's
validation set, not on this line's parts, light and camera. Calibration runs images of good parts
through the daemon's own pipeline (`edged.pipeline.FramePipeline`: the same preprocessing and
model as ``run``), or ``--frames N`` of the configured camera as the daemon takes them, prints
the distribution of their scores and proposes, as a config snippet:

- ``model.anomaly_threshold``: the 99.5th percentile of the good parts' image scores plus a margin
  of 0.02 (so that about one good part in 200, or none of a smaller set, is called anomalous);
- ``model.pixel_threshold``: the 99.9th percentile of the good parts' map values plus the same
  margin, so that a good part shows almost no region.

With ``--bad`` (images of some bad parts) it reports how well the scores separate the two: the
image AUROC, the threshold with the best F1 and that F1, and the F1 and misses at the proposal.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from edged.anomaly import Anomaly
from edged.capture import Capture
from edged.check import next_frame
from edged.config import Settings
from edged.contract import ChannelOrder
from edged.errors import DataError, ImageError, UsageError
from edged.model import LoadedModel, load_model, require_task
from edged.pipeline import FramePipeline, planned
from edged.settings.sources import SourceBase
from edged.sources.images import IMAGE_SUFFIXES, is_image_file, read_image
from edged.sources.registry import open_source

log = logging.getLogger(__name__)

IMAGE_QUANTILE = 99.5
PIXEL_QUANTILE = 99.9
MARGIN = 0.02
# Fewer good parts than this and the IMAGE_QUANTILE is all but their highest score: said with the proposal.
FEW_GOOD_PARTS = math.ceil(100 / (100 - IMAGE_QUANTILE))
FRAME_TIMEOUT_S = 30.0  # longer than any camera's own open timeout: its error comes first


@dataclass(frozen=True, slots=True)
class Scored:
    """The image scores of a set of images, and (when the model outputs a map) the chosen quantile of their map values."""

    scores: np.ndarray
    pixel_quantile: float | None


MapSink = Callable[[int, np.ndarray], None]  # each frame's index and anomaly map, valid during the call only


class UpperQuantile:
    """``np.percentile(values, q)`` (linear) of the values of ``maps`` maps of one size, added one at
    a time. It holds only the largest values that percentile can need, 0.1 % of them at the 99.9th:
    keeping every map took 256 KB an image, gigabytes for a folder of evidence."""

    def __init__(self, q: float, maps: int) -> None:
        self.q, self._maps = q, maps
        self._total = self._seen = 0
        self._top = np.empty(0, np.float32)

    def add(self, _index: int, values: np.ndarray) -> None:
        flat = values.ravel()
        if not self._total:
            self._total = self._maps * flat.size
        self._seen += flat.size
        keep = self._total - math.floor((self._total - 1) * (self.q / 100))  # from the lower of the two interpolated
        merged = np.concatenate([self._top, flat])
        self._top = np.partition(merged, merged.size - keep)[merged.size - keep :] if merged.size > keep else merged

    def value(self) -> float | None:
        """The percentile; None when no map came."""
        if not self._seen:
            return None
        if self._seen != self._total:
            raise ValueError(f"{self._seen} values added, {self._total} announced: maps of another size or number")
        position = (self._total - 1) * (self.q / 100)
        top = np.sort(self._top)  # the first is the value at the position's lower neighbour
        upper = top[1] if top.size > 1 else top[0]
        return float(top[0]) + (float(upper) - float(top[0])) * (position - math.floor(position))


class PixelAuroc:
    """The AUROC of map values against their pixels' truth, over more pixels than memory holds: each
    value counted in one of 2^20 bins ordered as float32 values are (the top 20 bits of their
    order-preserving integer form: sign, exponent and 11 bits of mantissa), positives and negatives
    apart, in 16 MB whatever the number of maps. Values within one bin, a relative 2^-11 of each
    other, tie and count half, as equal values do in `ranked_auroc`."""

    BITS = 20

    def __init__(self) -> None:
        self.positive = np.zeros(1 << self.BITS, np.int64)
        self.negative = np.zeros(1 << self.BITS, np.int64)

    def good(self, _index: int, values: np.ndarray) -> None:
        """A good part's map (a `MapSink`): no pixel marked."""
        self.add(values, None)

    def add(self, values: np.ndarray, truth: np.ndarray | None) -> None:
        """One map's values and its defect pixels (None: a good part, none)."""
        bits = np.ascontiguousarray(values, np.float32).view(np.uint32).ravel()
        ordered = np.where(bits >> 31, ~bits, bits | np.uint32(1 << 31)) >> np.uint32(32 - self.BITS)
        if truth is None:
            self.negative += np.bincount(ordered, minlength=self.negative.size)
        else:
            marked = truth.ravel()
            self.positive += np.bincount(ordered[marked], minlength=self.positive.size)
            self.negative += np.bincount(ordered[~marked], minlength=self.negative.size)

    def value(self) -> float | None:
        """The AUROC; None when no pixel is marked or none is left unmarked."""
        n_pos, n_neg = int(self.positive.sum()), int(self.negative.sum())
        if not n_pos or not n_neg:
            return None
        below = np.cumsum(self.negative, dtype=np.float64) - self.negative
        return float((self.positive * (below + 0.5 * self.negative)).sum() / (n_pos * n_neg))


def images_in(folder: Path) -> list[Path]:
    """The images in ``folder``, sorted, without its subfolders (an evidence day's ``maps/`` are no
    parts), whose images are counted and said; `DataError` when there is none or it is no folder."""
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder of images")
    found = sorted(p for p in folder.iterdir() if is_image_file(p))
    nested = sum(1 for p in folder.rglob("*") if p.parent != folder and is_image_file(p))
    if not found:
        below = f"; {nested} in its subfolders: give the folder that holds them" if nested else ""
        raise DataError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)}){below}")
    if nested:
        log.warning("%s: %d image(s) in its subfolders are not read (give each folder of parts itself)", folder, nested)
    return found


def score_images(model: LoadedModel, paths: Sequence[Path], maps: MapSink | None = None) -> np.ndarray:
    """Each image's score through the daemon's pipeline (`score_frames`)."""
    return score_frames(model, frames_of(paths), maps)


def frames_of(paths: Sequence[Path]) -> Iterator[tuple[np.ndarray, ChannelOrder]]:
    """Each image, decoded when its turn comes."""
    return ((decoded(path), "bgr") for path in paths)


def scored_with_quantile(model: LoadedModel, frames: Iterable[tuple[np.ndarray, ChannelOrder]], count: int) -> Scored:
    """The scores of ``count`` frames, and the `PIXEL_QUANTILE` of their map values when the model outputs a map."""
    quantile = UpperQuantile(PIXEL_QUANTILE, count)
    scores = score_frames(model, frames, quantile.add)
    return Scored(scores, quantile.value())


def decoded(path: Path) -> np.ndarray:
    """The image at ``path``, BGR, as the tools read one; `DataError` naming it and why where it cannot be decoded."""
    try:
        return read_image(path)
    except ImageError as e:
        raise DataError(f"{e}; replace or remove it") from e


def camera_frames(
    cfg: SourceBase, count: int, timeout_s: float = FRAME_TIMEOUT_S
) -> Iterator[tuple[np.ndarray, ChannelOrder]]:
    """``count`` frames of camera ``cfg``, opened and taken as the daemon does; ``SourceError`` when it
    gives none for ``timeout_s`` or ends first."""
    capture = Capture(lambda: open_source(cfg), cfg.camera_id, decode_all=True)
    capture.start()
    try:
        for taken in range(count):
            frame = next_frame(capture, cfg, timeout_s, f"{taken} of {count} frames")
            yield frame.image, frame.channel_order
    finally:
        capture.stop()


def score_frames(
    model: LoadedModel, frames: Iterable[tuple[np.ndarray, ChannelOrder]], maps: MapSink | None = None
) -> np.ndarray:
    """Each frame's score (an image and its channel order) through the daemon's pipeline, and its
    anomaly map to ``maps`` when the model outputs one. A plan is made when the size or order
    changes, and only the last kept (a folder of crops has as many sizes as images: a plan kept for
    each would grow without bound); no map is kept (`UpperQuantile`, `PixelAuroc`)."""
    plan: FramePipeline | None = None
    scores = []
    names = [o.name for o in model.engine.output_meta]
    for index, (image, order) in enumerate(frames):
        plan = planned(plan, model, image, order)
        result, _ = plan.process(image)
        if not isinstance(result, Anomaly):
            raise UsageError("edged calibrate is for anomaly models (anomalib exports)")
        scores.append(result.score)
        if maps is not None and "anomaly_map" in names:
            maps(index, plan.binding.outputs[names.index("anomaly_map")][0, 0])
    return np.array(scores, dtype=np.float64)


def ranked_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """AUROC of ``scores`` against the boolean ``positive``, from average ranks (ties count half):
    for the millions of pixels of a pixel AUROC, where the pairwise `auroc` would not fit."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[inverse]  # each value's average rank, from 1
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auroc(good: np.ndarray, bad: np.ndarray) -> float:
    """The probability that a bad part scores above a good one (ties count half): the image AUROC,
    from ranks (`ranked_auroc`), where comparing every pair took good x bad bytes."""
    return ranked_auroc(np.concatenate([good, bad]), np.arange(good.size + bad.size) >= good.size)


def f1_at(good: np.ndarray, bad: np.ndarray, threshold: float) -> float:
    """F1 of calling a part bad when its score is above ``threshold``."""
    hits, false_alarms = int((bad > threshold).sum()), int((good > threshold).sum())
    misses = bad.size - hits
    return 2 * hits / (2 * hits + false_alarms + misses) if hits else 0.0


def best_f1(good: np.ndarray, bad: np.ndarray) -> tuple[float, float]:
    """(threshold, F1) of the best threshold: each candidate just below a bad part's score."""
    candidates = np.unique(np.concatenate([good, bad]))
    best = max(((float(t), f1_at(good, bad, float(t))) for t in np.nextafter(candidates, -np.inf)), key=lambda x: x[1])
    return best


def _distribution(scores: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(scores, [50, 90, 99]).tolist()
    return f"min {scores.min():.4f}  median {p50:.4f}  p90 {p90:.4f}  p99 {p99:.4f}  max {scores.max():.4f}"


def report(model: LoadedModel, good: Scored, bad: np.ndarray | None, out: TextIO) -> None:
    """The distributions, the proposed thresholds as a config snippet, and the separation with bad parts."""
    proposed = min(1.0, float(np.percentile(good.scores, IMAGE_QUANTILE)) + MARGIN)
    print(f"model {model.info.name}: export threshold 0.5 (scores normalised by the export)", file=out)
    print(f"good parts ({good.scores.size}): {_distribution(good.scores)}", file=out)
    if bad is not None:
        print(f"bad parts  ({bad.size}): {_distribution(bad)}", file=out)
    print("\nproposed, for the configuration file:\n\n[model]", file=out)
    print(
        f"anomaly_threshold = {proposed:.4f}  # the {IMAGE_QUANTILE}th percentile of the good parts' scores plus {MARGIN}",
        file=out,
    )
    if good.pixel_quantile is not None:
        pixel = min(1.0, good.pixel_quantile + MARGIN)
        print(
            f"pixel_threshold = {pixel:.4f}  # the {PIXEL_QUANTILE}th percentile of their map values plus {MARGIN}",
            file=out,
        )
    if good.scores.size < FEW_GOOD_PARTS:
        print(
            f"\nwarning: from {good.scores.size} good part(s), fewer than {FEW_GOOD_PARTS}, the {IMAGE_QUANTILE}th "
            "percentile is about their highest score: a good part scoring above these is called anomalous; "
            f"score {FEW_GOOD_PARTS} or more for a threshold that holds on the line",
            file=out,
        )
    if bad is not None:
        threshold, f1 = best_f1(good.scores, bad)
        missed = int((bad <= proposed).sum())
        print(f"\nimage AUROC {auroc(good.scores, bad):.4f}", file=out)
        print(f"best F1 {f1:.4f} at anomaly_threshold = {threshold:.4f}", file=out)
        print(
            f"at the proposed threshold: F1 {f1_at(good.scores, bad, proposed):.4f}, "
            f"{missed} of {bad.size} bad part(s) missed",
            file=out,
        )


def run_calibrate(args: argparse.Namespace, settings: Settings, out: TextIO) -> int:
    model = load_model(settings.model, settings.runtime)
    require_task(model, ("anomaly",), "calibrate", "model.path")
    if (args.good is None) == (args.frames is None):
        raise UsageError("edged calibrate takes good parts from --good DIR or from --frames N of the camera, one of them")
    bad_images = images_in(args.bad) if args.bad is not None else None  # said before the good parts are scored
    if args.frames is not None:
        if len(settings.source) != 1:
            raise UsageError("edged calibrate --frames takes the frames of a config's one camera; this one has several")
        good = scored_with_quantile(model, camera_frames(settings.source[0], args.frames), args.frames)
    else:
        paths = images_in(args.good)
        good = scored_with_quantile(model, frames_of(paths), len(paths))
    bad = score_images(model, bad_images) if bad_images is not None else None
    report(model, good, bad, out)
    return 0
