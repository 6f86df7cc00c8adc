"""A loaded model: the session, its checked input contract, its head format and class names.

`run`, `check`, `eval` and `bench` all load a model through `load_model`, so they refuse the
same models for the same reasons and decode with the same settings.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edged.anomaly import AnomalyDecoder
from edged.classify import Classifier
from edged.config import ModelConfig, ProviderConfig, RuntimeConfig
from edged.contract import InputContract, build_contract
from edged.decode import Decoder
from edged.engines import InferenceEngine, open_engine
from edged.errors import ContractError, HeadError, ModelError
from edged.files import labels_bytes
from edged.heads.anomaly import AnomalyHead, anomalib_size
from edged.heads.base import fmt_classes
from edged.heads.classify import ClassifyHead
from edged.heads.metadata import name_problem, parse_names
from edged.heads.registry import detect_format, format_named
from edged.heads.segment import SegmentHead
from edged.messages import ModelInfo, Task
from edged.segment import Segmenter
from edged.signature import Signed, verify

log = logging.getLogger(__name__)


@dataclass(frozen=True)  # not slotted: a fallback holds it weakly (`edged.reload.Fallback`), and 3.10 has no weakref_slot
class LoadedModel:
    engine: InferenceEngine
    contract: InputContract
    head: str  # a name in edged.heads.registry.FORMATS
    num_classes: int
    labels: list[str]
    cfg: ModelConfig
    info: ModelInfo  # what every message says about the model
    class_names: tuple[str, ...]  # the labels, or the class ids where the model names none: a dataset's names

    @property
    def task(self) -> Task:
        tasks: dict[str, Task] = {ClassifyHead.name: "classify", SegmentHead.name: "segment", AnomalyHead.name: "anomaly"}
        return tasks.get(self.head, "detect")

    def anomaly_decoder(
        self, outputs: Sequence[tuple[str, tuple[int, ...]]], near_margin: float | None = None
    ) -> AnomalyDecoder:
        """An anomaly model's decoder for its bound outputs (name, shape), with the thresholds of the
        config; ``near_margin`` has it mark a score just below the threshold (``ng+near``)."""
        cfg = self.cfg
        return AnomalyDecoder(
            outputs,
            threshold=cfg.anomaly_threshold,
            pixel_threshold=cfg.pixel_threshold,
            max_regions=cfg.max_det,
            near_margin=near_margin,
            max_outline_points=cfg.max_outline_points,
        )

    def make_decoder(
        self,
        output_shape: tuple[int, ...],
        thresholds: Sequence[float] | None = None,
        near_margin: float | None = None,
        prototypes: np.ndarray | None = None,
    ) -> Decoder | Classifier | Segmenter:
        """A decoder for a bound output (its size is only known after `Engine.bind`); ``thresholds``
        per class id replace model.conf (``[inspect]``); ``near_margin`` has it find near misses
        (evidence saved under ``ng+near``). A classifier's ranks its ``top_k`` classes; a segmentation
        model's makes the masks from its bound ``prototypes`` output too."""
        if self.task == "classify":
            return Classifier(output_shape, self.num_classes, self.cfg.top_k)
        decoder = Decoder(
            self.head,
            output_shape,
            self.num_classes,
            conf=self.cfg.conf,
            iou=self.cfg.iou,
            max_det=self.cfg.max_det,
            agnostic=self.cfg.agnostic_nms,
            thresholds=thresholds,
            near_margin=near_margin,
        )
        if prototypes is not None:
            cfg = self.cfg
            return Segmenter(
                decoder,
                prototypes,
                self.num_classes,
                cfg.max_masks,
                cfg.max_det,
                retina=cfg.retina_masks,
                max_outline_points=cfg.max_outline_points,
            )
        return decoder

    def label(self, class_id: int) -> str:
        return self.labels[class_id] if 0 <= class_id < len(self.labels) else str(class_id)


TASK_NAMES: dict[Task, str] = {
    "detect": "detection",
    "segment": "segmentation",
    "classify": "classification",
    "anomaly": "anomaly",
}


def require_task(model: LoadedModel, tasks: Sequence[Task], command: str, key: str) -> None:
    """`ModelError` (exit 78) for a model of a task ``command`` does not serve, naming its task and those
    served: no option makes the command serve it, the model given as ``key`` must change."""
    if model.task in tasks:
        return
    names = [TASK_NAMES[task] for task in tasks]
    found = TASK_NAMES[model.task]

    def listed(joint: str) -> str:
        return f"{', '.join(names[:-1])} {joint} {names[-1]}" if len(names) > 1 else names[0]

    one = listed("or")
    raise ModelError(
        f"{key} {model.cfg.path} is {_a(found)} {found} model, and edged {command} serves {listed('and')} models only: "
        f"give {key} {_a(one)} {one} model"
    )


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def read_labels(path: Path, data: bytes) -> list[str]:
    """The class names in ``data``, the labels file ``path``'s bytes, one per line; `ModelError` for
    one that lists no class: the model's own names would be dropped for its class ids. A byte-order
    mark (Windows' Notepad saves one) is no part of the first name: kept, it is unseen in every
    output, and ``inspect.ng_classes`` naming that class would not find it."""
    try:
        lines = data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        raise ModelError(f"cannot read labels file {path}: {e}") from None
    names = [line.strip() for line in lines if line.strip()]
    if not names:
        raise ModelError(f"labels file {path} lists no class: one name per line, in class order")
    for class_id, name in enumerate(names):
        if (problem := name_problem(name)) is not None:
            raise ModelError(
                f"labels file {path}: class {class_id}'s name {name!r} cannot be published or logged: {problem}"
            )
    return names


def _labels(cfg: ModelConfig, metadata: dict[str, str], signed: Signed | None) -> list[str]:
    """model.labels' names, read once: the bytes whose names are served are the bytes the signature
    covers; else the model's own."""
    if cfg.labels is None:
        names = parse_names(metadata)
        if names is None and metadata.get("names"):
            log.warning(
                "the model's names metadata cannot name its classes (it must give each class id from 0 a "
                "name of one line, without control characters): they are named by their ids; set model.labels "
                "to a file naming them, one per line in class order"
            )
        return names or []
    data = labels_bytes(cfg.labels)
    if signed is not None and hashlib.sha256(data).hexdigest() != signed.labels_sha256:
        raise ModelError(f"labels file {cfg.labels} changed while the model was loaded: not the file its signature covers")
    return read_labels(cfg.labels, data)


def _distinct(labels: Sequence[str], source: str, *, labels_file: bool) -> None:
    """`ContractError` naming each class name ``labels`` repeats and its class ids: the configuration
    names a class by its label (inspect.ng_classes, class_conf), so of two classes named alike one
    would go unjudged, and a message's label could not tell them apart. Names are compared in
    Unicode's NFC: an ``é`` written as one code point and one written as ``e`` and an accent look
    alike in every output, yet differ as text."""
    ids: dict[str, list[int]] = {}
    for class_id, name in enumerate(labels):
        ids.setdefault(unicodedata.normalize("NFC", name), []).append(class_id)
    repeated = [f"{name!r} (class ids {', '.join(map(str, found))})" for name, found in ids.items() if len(found) > 1]
    if repeated:
        fix = "give each class its own name" if labels_file else "set model.labels to a file naming each class once"
        raise ContractError(
            f"{source} names more than one class alike: {'; '.join(repeated)}; "
            f"{fix}, one per line in class order, so that each can be judged and published on its own"
        )


def _head(engine: InferenceEngine, cfg: ModelConfig) -> tuple[str, int]:
    outputs = [(o.name, list(o.shape)) for o in engine.output_meta]
    shapes = [shape for _, shape in outputs]
    try:
        head, num_classes = detect_format(outputs, engine.metadata, cfg.head)
    except HeadError as e:
        if cfg.head == "auto":
            raise
        raise ContractError(f"model.head = {cfg.head!r} does not fit the model: {e}") from None
    if cfg.head not in ("auto", head):
        raise ContractError(f"config model.head = {cfg.head!r} but the outputs {shapes} are a {head!r} head")
    return head, num_classes


def load_model(cfg: ModelConfig, runtime: RuntimeConfig, *, record_placement: bool = False, lanes: int = 1) -> LoadedModel:
    """Load and check a model for ``lanes`` threads running it at once (`edged.lanes`); raises
    ModelError (cannot load) or ContractError (cannot trust)."""
    if not cfg.path.is_file():
        what = "is not a file" if cfg.path.exists() else "does not exist"
        raise ModelError(f"model file {cfg.path} {what}")
    signed = verify(cfg) if cfg.require_signature else None  # before the runtime parses a byte of it
    engine = open_engine(cfg, runtime, record_placement=record_placement, lanes=lanes)
    if signed is not None and engine.identity.sha256 != signed.model_sha256:
        raise ModelError(f"model {cfg.path} changed while it was loaded: it is not the file its signature verified")
    head, num_classes = _head(engine, cfg)
    inputs = [(i.name, list(i.shape), i.type) for i in engine.input_meta]
    trained = anomalib_size([(o.name, list(o.shape)) for o in engine.output_meta])
    contract = build_contract(inputs, engine.metadata, cfg, format_named(head), trained)
    labels = _labels(cfg, engine.metadata, signed)
    if head == AnomalyHead.name:
        labels = labels or ["anomaly"]
    source = str(cfg.labels) if cfg.labels else "the model's names metadata"
    if labels and len(labels) != num_classes:
        raise ContractError(f"{source} lists {fmt_classes(len(labels))} but the model outputs {num_classes}")
    _distinct(labels, source, labels_file=cfg.labels is not None)
    identity = engine.identity
    info = ModelInfo(name=identity.name, sha256=identity.sha256, provider=engine.provider)
    names = tuple(labels) if labels else tuple(str(i) for i in range(num_classes))
    return LoadedModel(engine, contract, head, num_classes, labels, cfg, info, names)


def fallback_runtime(runtime: RuntimeConfig, model: LoadedModel) -> RuntimeConfig | None:
    """``runtime`` without the provider ``model`` runs first, which keeps failing, so that the model
    loaded again with it runs on the next one (`edged.reload.Reloads.fall_back`); None when no
    provider is left below it."""
    providers = model.engine.providers
    if len(providers) < 2:
        return None
    remaining = [ProviderConfig(name=name, options=options) for name, options in providers[1:]]
    return runtime.model_copy(update={"providers": remaining})
