"""Synthetic inspection frames with exact ground truth: edged's stand-in camera and dataset.

A `SceneGenerator` paints a textured part surface (brushed metal, wood, PCB, fabric, painted
sheet) under uneven lighting with sensor noise and slight blur, adds things that look like
defects but are not (screw holes, printed text, marker lines, glints, PCB pads and chips), then
0..N real defects of three classes with tight pixel boxes. It feeds the daemon's live
``synthetic`` source and the training/evaluation of the demo model, so it has to be fast
(textures are made once per seed and kept on disk for the next process, `cache_folder`; a frame
is cv2 work on whole images plus small tiles) and exactly reproducible from ``(seed, index, size)``.

Defects are painted as alpha layers on small tiles; alpha below `_ALPHA_FLOOR` is dropped, and
the box is the bounding rectangle of what is left, so every painted pixel lies in its box. The
same pixels form the defect's instance mask, which `render(masks=True)` returns for training and
scoring segmentation models; the live source leaves it off and allocates nothing for it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import string
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from edged.settings.service_dirs import service_dir

log = logging.getLogger(__name__)
_CODE = Path(__file__).read_bytes()  # what the generated textures depend on, with the libraries' versions

CLASS_NAMES: tuple[str, ...] = ("scratch", "spot", "crack")
SURFACES: tuple[str, ...] = ("metal", "wood", "pcb", "fabric", "painted")

_TEX = 1024
_ALPHA_FLOOR = 0.15
_TRIES = 12
_NOISE_PAD = 32
CACHE_BYTES = 256 << 20  # the cache folder's bound: eight texture pools (31 MB each), or fewer with noise fields
# Per-surface colour casts (BGR gains), applied with the lighting; same order as SURFACES.
_TINTS: tuple[tuple[tuple[float, float, float], ...], ...] = (
    ((1.0, 1.0, 1.0), (1.06, 1.0, 0.94), (0.92, 0.96, 1.04)),
    ((1.0, 1.0, 1.0), (0.85, 0.92, 1.05), (1.1, 1.05, 0.95)),
    ((1.0, 1.0, 1.0), (2.2, 0.8, 0.9), (0.5, 0.55, 0.6), (0.8, 0.9, 1.6)),
    ((1.45, 0.95, 0.6), (0.85, 1.05, 1.2), (1.0, 1.0, 1.0), (0.7, 1.0, 0.6), (0.6, 0.55, 1.1), (0.5, 0.5, 0.5)),
    ((0.3, 1.15, 1.4), (1.4, 0.8, 0.5), (1.0, 1.0, 1.0), (1.3, 1.3, 1.3), (0.3, 0.75, 1.45), (0.6, 1.0, 0.6)),
)
_INKS = ((25, 25, 25), (235, 235, 235), (140, 50, 20), (30, 30, 190))

# One painted layer: alpha tile, gain, offset -> pixel moves towards pixel * gain + offset.
_Layer = tuple[np.ndarray, float, tuple[float, float, float]]
Box = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Scene:
    """One frame and its ground truth (boxes are x1 y1 x2 y2 in frame pixels, half-open).

    `masks` is (N, H, W) bool, one per box, when rendered with ``masks=True``; else None.
    """

    image: np.ndarray
    boxes: np.ndarray
    class_ids: np.ndarray
    masks: np.ndarray | None = None


def _smooth(rng: np.random.Generator, cells: int) -> np.ndarray:
    grid = rng.standard_normal((cells, cells)).astype(np.float32)
    return cv2.resize(grid, (_TEX, _TEX), interpolation=cv2.INTER_CUBIC)


def _streaks(rng: np.random.Generator, length: int) -> np.ndarray:
    s: np.ndarray = cv2.blur(rng.standard_normal((_TEX, _TEX)).astype(np.float32), (length, 1))
    normalised: np.ndarray = s / (s.std() + 1e-6)
    return normalised


def _grey_to_bgr(v: np.ndarray, bgr: tuple[float, float, float]) -> np.ndarray:
    pixels: np.ndarray = np.clip(v[..., None] * np.asarray(bgr, np.float32), 0, 255).astype(np.uint8)
    return pixels


def _metal(rng: np.random.Generator) -> np.ndarray:
    v = 140 + 8 * _streaks(rng, 151) + 4 * _streaks(rng, 15) + 6 * _smooth(rng, 6)
    return _grey_to_bgr(v, (1.02, 1.0, 0.97))


def _wood(rng: np.random.Generator) -> np.ndarray:
    y, x = np.mgrid[0:_TEX, 0:_TEX].astype(np.float32)
    phase = (y + 30 * _smooth(rng, 4) + 8 * _smooth(rng, 12) + 0.03 * x) / rng.uniform(14, 30)
    rings = (0.5 + 0.5 * np.sin(2 * np.pi * phase)) ** 3
    v = 1.0 - 0.35 * rings + 0.04 * _streaks(rng, 61) + 0.05 * _smooth(rng, 8)
    return _grey_to_bgr(v, (95, 150, 200))


def _pcb(rng: np.random.Generator) -> np.ndarray:
    img = _grey_to_bgr(1 + 0.04 * _smooth(rng, 32) + 0.05 * _smooth(rng, 4), (45, 115, 35))
    for _ in range(45):
        pts = [rng.integers(0, _TEX, 2)]
        for _ in range(int(rng.integers(2, 5))):
            step = int(rng.integers(40, 260)) * rng.choice([-1, 1], 2) * rng.choice([(1, 0), (0, 1), (1, 1)])
            pts.append(pts[-1] + step)
        cv2.polylines(img, [np.asarray(pts, np.int32)], False, (55, 150, 50), int(rng.integers(4, 12)), cv2.LINE_AA)
        for p in (pts[0], pts[-1]):
            cv2.circle(img, (int(p[0]), int(p[1])), 9, (70, 150, 190), -1, cv2.LINE_AA)
            cv2.circle(img, (int(p[0]), int(p[1])), 4, (20, 35, 20), -1, cv2.LINE_AA)
    return img


def _fabric(rng: np.random.Generator) -> np.ndarray:
    p = int(rng.integers(6, 11))
    y, x = np.mgrid[0:_TEX, 0:_TEX]
    threads = rng.normal(1.0, 0.06, _TEX // p + 1).astype(np.float32)
    warp = np.cos(np.pi * ((x % p) / p - 0.5)) * threads[x // p]
    weft = np.cos(np.pi * ((y % p) / p - 0.5)) * threads[y // p]
    v = np.where((x // p + y // p) % 2 == 0, warp, weft).astype(np.float32)
    return _grey_to_bgr(100 + 60 * v + 5 * _smooth(rng, 16), (1.0, 1.0, 1.0))


def _painted(rng: np.random.Generator) -> np.ndarray:
    peel = cv2.GaussianBlur(rng.standard_normal((_TEX, _TEX)).astype(np.float32), (0, 0), 2.0)
    return _grey_to_bgr(150 + 25 * peel + 6 * _smooth(rng, 5), (1.0, 1.0, 1.0))


_MAKERS: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "metal": _metal,
    "wood": _wood,
    "pcb": _pcb,
    "fabric": _fabric,
    "painted": _painted,
}


def cache_folder() -> Path | None:
    """Where generated textures are kept between processes: the service's cache directory under
    systemd (``$CACHE_DIRECTORY``), else the user's (``$XDG_CACHE_HOME``, ``~/.cache``); None without one."""
    service = service_dir("cache")
    if service is not None:
        return service / "scenes"
    user = os.environ.get("XDG_CACHE_HOME", "")
    if user:
        return Path(user) / "edged" / "scenes"
    try:
        return Path.home() / ".cache" / "edged" / "scenes"
    except RuntimeError:  # no $HOME and no password entry
        return None


def _kept(name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
    """``make()`` (a uint8 array of ``shape``), read back from the cache folder when an earlier
    process made it, else made and written there for the next one.

    Making the texture pool takes most of a second of CPU, which every process with a synthetic
    camera paid at start. The file's name changes with this module's code and numpy's and
    OpenCV's versions, so a stale file is never read. A file that cannot be read or written is
    made again: the cache only saves time (logged, never an error).
    """
    folder = cache_folder()
    if folder is None:
        return make()
    facts = f"{name} {shape} numpy {np.__version__} opencv {cv2.__version__}".encode()
    path = folder / f"{name}-{hashlib.sha256(_CODE + facts).hexdigest()[:16]}.npy"
    try:
        kept = np.load(path, allow_pickle=False)
        if isinstance(kept, np.ndarray) and kept.shape == shape and kept.dtype == np.uint8:
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: the last file `_keep` would drop
            return kept
        log.warning("scene cache %s is not the uint8 array %s expected: making it again", path, shape)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, EOFError) as e:
        log.warning("scene cache %s could not be read (%s): making it again", path, e)
    made = make()
    _keep(path, made, name)
    return made


def _bound(folder: Path) -> None:
    """Drop the least recently used files until the folder holds at most `CACHE_BYTES`: each seed
    and frame size a camera or a script ever used would otherwise stay there for good."""
    files = []
    for path in folder.glob("*.npy"):
        with contextlib.suppress(FileNotFoundError):  # another process's `_keep` dropped it meanwhile
            files.append((path.stat(), path))
    files.sort(key=lambda f: f[0].st_mtime_ns, reverse=True)
    total = 0
    for stat, path in files:
        total += stat.st_size
        if total > CACHE_BYTES:
            path.unlink(missing_ok=True)


def _keep(path: Path, array: np.ndarray, name: str) -> None:
    """Write ``array`` to ``path`` whole (a reader never sees part of it, a power cut leaves it whole or
    not there), and drop the files an older code or library version left under ``name``."""
    written: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-", suffix=".npy")
        written = Path(temporary)
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())  # on the disk before it is named: a power cut leaves no file of zeros there
        os.replace(written, path)
        written = None
        for stale in path.parent.glob(f"{name}-*.npy"):
            if stale != path:
                stale.unlink(missing_ok=True)
        _bound(path.parent)
    except OSError as e:
        log.debug("scene cache %s not written: %s", path, e)
    finally:
        if written is not None:
            with contextlib.suppress(OSError):
                written.unlink()


@functools.lru_cache(maxsize=8)
def _texture_pool(seed: int) -> tuple[tuple[np.ndarray, ...], ...]:
    """Two textures per surface (metal: one per brushing direction), built once per seed."""
    shape = (2 * len(SURFACES), _TEX, _TEX, 3)

    def make() -> np.ndarray:
        rng = np.random.default_rng((seed, 0x7E57))
        pool = np.empty(shape, np.uint8)
        for i, name in enumerate(SURFACES):
            pool[2 * i] = _MAKERS[name](rng)
            b = _MAKERS[name](rng)
            pool[2 * i + 1] = b.transpose(1, 0, 2) if name == "metal" else b
        return pool

    textures = _kept(f"textures-{seed}", shape, make)
    textures.setflags(write=False)
    return tuple((textures[i], textures[i + 1]) for i in range(0, len(textures), 2))


@functools.lru_cache(maxsize=8)
def _noise_field(seed: int, width: int, height: int) -> np.ndarray:
    """Sensor noise (uint8, mean 128, sd 20) with a margin so frames can take shifted crops."""
    shape = (height + _NOISE_PAD, width + _NOISE_PAD, 3)

    def make() -> np.ndarray:
        rng = np.random.default_rng((seed, width, height, 0x0153))
        n = rng.standard_normal(shape, dtype=np.float32)
        return np.clip(128 + 20 * n, 0, 255).astype(np.uint8)

    field = _kept(f"noise-{seed}-{width}x{height}", shape, make)
    field.setflags(write=False)
    return field


def _blend(img: np.ndarray, x0: int, y0: int, layers: list[_Layer]) -> None:
    h, w = layers[0][0].shape
    roi = img[y0 : y0 + h, x0 : x0 + w]
    f = roi.astype(np.float32)
    for alpha, gain, offset in layers:
        f += alpha[..., None] * (f * gain + np.asarray(offset, np.float32) - f)
    roi[...] = np.clip(np.rint(f), 0, 255).astype(np.uint8)


def _alpha(mask: np.ndarray, strength: float) -> np.ndarray:
    a = mask.astype(np.float32) * (strength / 255.0)
    a[a < _ALPHA_FLOOR] = 0.0
    return a


def _canvas(paths: list[np.ndarray], pad: float) -> tuple[np.ndarray, np.ndarray]:
    """Blank mask fitting all paths (pad px around), and the paths moved onto it."""
    allp = np.concatenate(paths)
    lo = np.floor(allp.min(0) - pad)
    hi = np.ceil(allp.max(0) + pad)
    w, h = (hi - lo).astype(int) + 1
    return np.zeros((h, w), np.uint8), lo


def _poly(mask: np.ndarray, pts: np.ndarray, lo: np.ndarray, value: int, thick: int) -> None:
    fixed = np.rint((pts - lo) * 16).astype(np.int32)
    cv2.polylines(mask, [fixed], False, value, max(1, thick), cv2.LINE_AA, 4)


def _scratch(rng: np.random.Generator, s: float) -> list[_Layer]:
    length = rng.uniform(70, 380) * s
    ang = rng.uniform(0, np.pi)
    bend = rng.uniform(-0.18, 0.18) * length
    d = np.array([np.cos(ang), np.sin(ang)])
    t = np.linspace(0, 1, 24)[:, None]
    ctrl = d * length / 2 + np.array([-d[1], d[0]]) * bend
    pts = 2 * (1 - t) * t * ctrl + t * t * d * length
    width = rng.uniform(3, 6) * s
    mask, lo = _canvas([pts], width + 2)
    fade = np.clip(np.minimum(t[:, 0], 1 - t[:, 0]) * rng.uniform(5, 12), 0.5, 1.0)
    level = fade * rng.uniform(0.75, 1.0, len(t))
    for i in range(len(pts) - 1):
        _poly(mask, pts[i : i + 2], lo, int(255 * level[i]), round(width * (0.6 + 0.4 * fade[i])))
    if rng.random() < 0.7:
        return [(_alpha(mask, 1.0), 1.0, (float(rng.uniform(70, 120)),) * 3)]
    return [(_alpha(mask, 1.0), float(rng.uniform(0.3, 0.5)), (0.0, 0.0, 0.0))]


def _crack(rng: np.random.Generator, s: float) -> list[_Layer]:
    n = int(rng.integers(10, 22))
    step = rng.uniform(60, 300) * s / n
    heading = rng.uniform(0, 2 * np.pi)
    turns = heading + np.cumsum(rng.uniform(-0.35, 0.35, n)) + rng.uniform(-0.9, 0.9, n)
    main = np.vstack([[0.0, 0.0], np.cumsum(step * np.c_[np.cos(turns), np.sin(turns)], 0)])
    paths = [main]
    for _ in range(int(rng.integers(1, 4))):
        k, m = int(rng.integers(2, n - 2)), int(rng.integers(3, 7))
        bt = heading + rng.choice([-1, 1]) * rng.uniform(0.5, 1.1) + rng.uniform(-0.8, 0.8, m)
        paths.append(main[k] + np.vstack([[0, 0], np.cumsum(0.8 * step * np.c_[np.cos(bt), np.sin(bt)], 0)]))
    width = rng.uniform(3, 5) * s
    mask, lo = _canvas(paths, width + 2)
    for j, path in enumerate(paths):
        w = width if j == 0 else width * 0.7
        _poly(mask, path, lo, 255, round(w))
    mask = cv2.GaussianBlur(mask, (3, 3), 0.6)
    return [(_alpha(mask, rng.uniform(0.85, 1.0)), float(rng.uniform(0.08, 0.25)), (0.0, 0.0, 0.0))]


def _spot(rng: np.random.Generator, s: float) -> list[_Layer]:
    r = rng.uniform(12, 40) * s
    th = np.linspace(0, 2 * np.pi, 36, endpoint=False)
    rad = r * (1 + sum(rng.uniform(-0.12, 0.12) * np.sin(k * th + rng.uniform(0, 6.3)) for k in (2, 3, 5)))
    squash, rot = rng.uniform(0.6, 1.0), rng.uniform(0, np.pi)
    ex, ey = rad * np.cos(th), rad * np.sin(th) * squash
    pts = np.c_[ex * np.cos(rot) - ey * np.sin(rot), ex * np.sin(rot) + ey * np.cos(rot)]
    mask, lo = _canvas([pts], r * 0.5 + 2)
    cv2.fillPoly(mask, [np.rint((pts - lo) * 16).astype(np.int32)], 255, cv2.LINE_AA, 4)
    mask = cv2.GaussianBlur(mask, (0, 0), max(0.8, r * 0.2))
    if rng.random() < 0.35:
        hi = np.zeros_like(mask)
        c = tuple(np.rint((-lo + rng.uniform(-0.3, 0.3, 2) * r) * 16).astype(int))
        cv2.circle(hi, c, int(r * 0.4 * 16), 255, -1, cv2.LINE_AA, 4)
        hi = np.minimum(cv2.GaussianBlur(hi, (0, 0), max(0.8, r * 0.15)), mask)
        return [(_alpha(mask, 0.9), 0.5, (0.0, 0.0, 0.0)), (_alpha(hi, 0.7), 1.0, (70.0, 70.0, 70.0))]
    tint = [(10.0, 30.0, 70.0), (5.0, 5.0, 5.0), (30.0, 25.0, 10.0)][int(rng.integers(0, 3))]
    return [(_alpha(mask, rng.uniform(0.7, 0.95)), float(rng.uniform(0.25, 0.5)), tint)]


_DEFECTS = (_scratch, _spot, _crack)


def _iou(a: Box, b: Box) -> tuple[float, float]:
    iw = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    if inter == 0:
        return 0.0, 0.0
    area_a, area_b = (a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1])
    return inter / (area_a + area_b - inter), inter / min(area_a, area_b)


def _fits(box: Box, kind: int, s: float) -> bool:
    w, h = box[2] - box[0], box[3] - box[1]
    if kind == 1:
        return min(w, h) >= 14 * s
    return max(w, h) >= 40 * s and min(w, h) >= max(10 * s, 0.1 * max(w, h))


class SceneGenerator:
    """Reproducible frames: `render(index)` depends only on (seed, index, width, height)."""

    def __init__(self, width: int = 1280, height: int = 720, seed: int = 0, max_defects: int = 4) -> None:
        if width < 32 or height < 32:
            raise ValueError(f"frame must be at least 32x32, got {width}x{height}")
        if max_defects < 0:
            raise ValueError(f"max_defects must be >= 0, got {max_defects}")
        self.width, self.height, self.seed, self.max_defects = width, height, seed, max_defects
        self._scale = min(width, height) / 720
        self._pool = _texture_pool(seed)
        self._noise = _noise_field(seed, width, height)

    def render(self, index: int, out: np.ndarray | None = None, masks: bool = False) -> Scene:
        """Frame `index` with its defects; drawn into `out` (H, W, 3 uint8) when given.

        With `masks`, each defect's painted pixels (alpha above the floor) come back as a
        full-frame mask; the frame itself is the same either way.
        """
        img = self._target(out)
        bg_rng, defect_rng = np.random.default_rng((self.seed, index)).spawn(2)
        surface, occupied = self._paint_surface(img, bg_rng)
        boxes, kinds, tiles = self._paint_defects(img, defect_rng, occupied)
        self._finish(img, bg_rng, surface)
        return Scene(
            img,
            np.asarray(boxes, np.float32).reshape(-1, 4),
            np.asarray(kinds, np.int32),
            self._masks(tiles) if masks else None,
        )

    def _masks(self, tiles: list[tuple[int, int, np.ndarray]]) -> np.ndarray:
        """Full-frame bool masks from each defect's placed tile (x0, y0, painted pixels)."""
        out = np.zeros((len(tiles), self.height, self.width), bool)
        for m, (x0, y0, union) in zip(out, tiles, strict=True):
            th, tw = union.shape
            m[y0 : y0 + th, x0 : x0 + tw] = union.astype(bool)
        return out

    def _render_background(self, index: int) -> np.ndarray:
        """Frame `index` exactly as `render` draws it, minus the defects."""
        img = self._target(None)
        bg_rng, _ = np.random.default_rng((self.seed, index)).spawn(2)
        surface, _ = self._paint_surface(img, bg_rng)
        self._finish(img, bg_rng, surface)
        return img

    def _target(self, out: np.ndarray | None) -> np.ndarray:
        shape = (self.height, self.width, 3)
        if out is None:
            return np.empty(shape, np.uint8)
        if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}")
        return out

    def _paint_surface(self, img: np.ndarray, rng: np.random.Generator) -> tuple[int, list[Box]]:
        kind = int(rng.integers(0, len(SURFACES)))
        tex = self._pool[kind][int(rng.integers(0, 2))]
        cw = rng.uniform(0.55, 1.0) * _TEX
        ch = cw * self.height / self.width
        if ch > _TEX:
            cw, ch = cw * _TEX / ch, float(_TEX)
        x0, y0 = int(rng.uniform(0, _TEX - cw)), int(rng.uniform(0, _TEX - ch))
        crop = tex[y0 : y0 + int(ch), x0 : x0 + int(cw)]
        cv2.resize(crop, (self.width, self.height), dst=img, interpolation=cv2.INTER_AREA)
        if rng.random() < 0.5:
            cv2.flip(img, int(rng.integers(-1, 2)), dst=img)
        count = int(rng.integers(1, 8))
        return kind, [self._distractor(img, rng, SURFACES[kind]) for _ in range(count)]

    def _distractor(self, img: np.ndarray, rng: np.random.Generator, surface: str) -> Box:
        s, choice = self._scale, rng.random()
        if surface == "pcb" and choice < 0.5:
            return self._chip(img, rng, s)
        if choice < 0.6:
            return self._text(img, rng, s, (235, 235, 235) if surface == "pcb" else None)
        if choice < 0.75:
            return self._screw(img, rng, s)
        if choice < 0.88:
            return self._glint(img, rng, s)
        return self._marker(img, rng, s)

    def _place(self, rng: np.random.Generator, w: float, h: float) -> tuple[int, int]:
        return (int(rng.uniform(0, max(1.0, self.width - w))), int(rng.uniform(0, max(1.0, self.height - h))))

    def _text(self, img: np.ndarray, rng: np.random.Generator, s: float, ink: tuple[int, int, int] | None) -> Box:
        chars = string.ascii_uppercase + string.digits + "-/:."
        text = "".join(rng.choice(list(chars), int(rng.integers(3, 11))))
        font = int(rng.choice([cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_PLAIN, cv2.FONT_HERSHEY_DUPLEX]))
        scale, thick = rng.uniform(0.6, 1.6) * s, max(1, round(rng.uniform(1, 3) * s))
        (tw, th), base = cv2.getTextSize(text, font, scale, thick)
        x, y = self._place(rng, tw, th + base)
        colour = ink or _INKS[int(rng.integers(0, len(_INKS)))]
        cv2.putText(img, text, (x, y + th), font, scale, colour, thick, cv2.LINE_AA)
        return x, y, x + tw, y + th + base

    def _screw(self, img: np.ndarray, rng: np.random.Generator, s: float) -> Box:
        r = rng.uniform(9, 22) * s
        x, y = self._place(rng, 3 * r, 3 * r)
        c, rim = (int(x + 1.5 * r), int(y + 1.5 * r)), int(r * 1.35)
        cv2.circle(img, c, rim, (int(rng.integers(190, 235)),) * 3, -1, cv2.LINE_AA)
        cv2.circle(img, c, int(r), (int(rng.integers(25, 55)),) * 3, -1, cv2.LINE_AA)
        a = rng.uniform(0, np.pi)
        for da in (0, np.pi / 2):
            dx, dy = 0.65 * r * np.cos(a + da), 0.65 * r * np.sin(a + da)
            cv2.line(
                img,
                (int(c[0] - dx), int(c[1] - dy)),
                (int(c[0] + dx), int(c[1] + dy)),
                (90, 90, 90),
                max(2, int(r * 0.25)),
                cv2.LINE_AA,
            )
        return c[0] - rim, c[1] - rim, c[0] + rim, c[1] + rim

    def _glint(self, img: np.ndarray, rng: np.random.Generator, s: float) -> Box:
        a = rng.uniform(15, 80) * s
        b = max(2.0, a * rng.uniform(0.12, 0.5))
        mask = np.zeros((int(2.6 * a), int(2.6 * a)), np.uint8)
        c = (mask.shape[1] // 2, mask.shape[0] // 2)
        cv2.ellipse(mask, c, (int(a), int(b)), rng.uniform(0, 180), 0, 360, 255, -1)
        soft = cv2.GaussianBlur(mask, (0, 0), max(1.0, b * 0.5))
        if soft.shape[0] > self.height or soft.shape[1] > self.width:
            return 0, 0, 0, 0
        x, y = self._place(rng, soft.shape[1], soft.shape[0])
        _blend(img, x, y, [(_alpha(soft, rng.uniform(0.6, 0.95)), 0.15, (225.0,) * 3)])
        return x, y, x + soft.shape[1], y + soft.shape[0]

    def _marker(self, img: np.ndarray, rng: np.random.Generator, s: float) -> Box:
        colour = _INKS[int(rng.choice([0, 2, 3]))]
        w, h = rng.uniform(60, 300) * s, rng.uniform(40, 200) * s
        x, y = self._place(rng, w, h)
        p1, p2 = (x, y), (int(x + w), int(y + h))
        thick = max(2, round(rng.uniform(4, 8) * s))
        shape = int(rng.integers(0, 3))
        if shape == 0:
            cv2.rectangle(img, p1, p2, colour, thick, cv2.LINE_AA)
        elif shape == 1:
            cv2.arrowedLine(img, p1, (p2[0], y), colour, thick, cv2.LINE_AA, 0, 0.2)
        else:
            cv2.ellipse(img, ((x + w / 2, y + h / 2), (w, h), 0.0), colour, thick, cv2.LINE_AA)
        return x - thick, y - thick, p2[0] + thick, p2[1] + thick

    def _chip(self, img: np.ndarray, rng: np.random.Generator, s: float) -> Box:
        w, h = rng.uniform(40, 200) * s, rng.uniform(25, 140) * s
        pad_l, pad_w = max(3.0, 10 * s), max(2.0, rng.uniform(4, 9) * s)
        if rng.random() < 0.3:
            h = 0.0
        x, y = self._place(rng, w, h + 2 * pad_l)
        metal = [(190, 190, 195), (80, 170, 210)][int(rng.integers(0, 2))]
        n = max(1, int(w / (2.2 * pad_w)))
        for i in range(n):
            px = int(x + (i + 0.5) * w / n - pad_w / 2)
            cv2.rectangle(img, (px, int(y)), (int(px + pad_w), int(y + h + 2 * pad_l)), metal, -1)
        if h > 0:
            body = (int(x), int(y + pad_l)), (int(x + w), int(y + pad_l + h))
            cv2.rectangle(img, body[0], body[1], (int(rng.integers(20, 45)),) * 3, -1)
        return int(x), int(y), int(x + w) + 1, int(y + h + 2 * pad_l) + 1

    def _paint_defects(
        self, img: np.ndarray, rng: np.random.Generator, occupied: list[Box]
    ) -> tuple[list[Box], list[int], list[tuple[int, int, np.ndarray]]]:
        """Boxes, classes and placed tiles (x0, y0, painted pixels) of the defects painted."""
        boxes: list[Box] = []
        kinds: list[int] = []
        tiles: list[tuple[int, int, np.ndarray]] = []
        for _ in range(int(rng.integers(0, self.max_defects + 1))):
            kind = int(rng.integers(0, len(CLASS_NAMES)))
            for _ in range(_TRIES):
                placed = self._try_defect(img, rng, kind, occupied, boxes)
                if placed is not None:
                    boxes.append(placed[0])
                    kinds.append(kind)
                    tiles.append(placed[1])
                    break
        return boxes, kinds, tiles

    def _try_defect(
        self, img: np.ndarray, rng: np.random.Generator, kind: int, occupied: list[Box], defects: list[Box]
    ) -> tuple[Box, tuple[int, int, np.ndarray]] | None:
        """Paint one defect of `kind` at a random free spot; its box and placed tile, or None.

        Defects keep clear of distractors and mostly of each other (IoU <= 0.05, and at most
        30% of either box covered by another defect).
        """
        layers = _DEFECTS[kind](rng, self._scale)
        union = np.zeros(layers[0][0].shape, np.uint8)
        for alpha, _, _ in layers:
            union |= (alpha > 0).astype(np.uint8)
        bx, by, bw, bh = cv2.boundingRect(union)
        th, tw = layers[0][0].shape
        if tw > self.width or th > self.height or bw == 0:
            return None
        x0, y0 = int(rng.integers(0, self.width - tw + 1)), int(rng.integers(0, self.height - th + 1))
        box = (x0 + bx, y0 + by, x0 + bx + bw, y0 + by + bh)
        if not _fits(box, kind, self._scale):
            return None
        for j, other in enumerate(occupied + defects):
            iou, cover = _iou(box, other)
            if iou > 0.05 or (j >= len(occupied) and cover > 0.3):
                return None
        _blend(img, x0, y0, layers)
        return box, (x0, y0, union)

    def _finish(self, img: np.ndarray, rng: np.random.Generator, surface: int) -> None:
        """Lighting and tint, sensor noise, then optics blur — identical with or without defects."""
        tints = _TINTS[surface]
        tint = np.asarray(tints[int(rng.integers(0, len(tints)))], np.float32)
        gy, gx = np.mgrid[0:3, 0:4].astype(np.float32)
        light = rng.uniform(0.8, 1.15, (3, 4)) + rng.uniform(-0.12, 0.12) * (gx - 1.5) + rng.uniform(-0.12, 0.12) * (gy - 1)
        grid = np.clip(light[..., None] * tint * 128, 0, 255).astype(np.uint8)
        full = cv2.resize(grid, (self.width, self.height), interpolation=cv2.INTER_CUBIC)
        cv2.multiply(img, full, dst=img, scale=1 / 128)
        amp = rng.uniform(2, 7) / 20
        ox, oy = (int(v) for v in rng.integers(0, _NOISE_PAD, 2))
        noise = self._noise[oy : oy + self.height, ox : ox + self.width]
        cv2.addWeighted(img, 1.0, noise, amp, -128 * amp, dst=img)
        cv2.GaussianBlur(img, (5, 5), rng.uniform(0.5, 1.1), dst=img)
