"""models/net.py: the demo network's segmentation variant has yolov8-seg's shapes and trains masks.

Needs the optional ``train`` extra (torch); skipped where it is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from net import Detector, ExportHead, TaskAlignedLoss, anchor_points, mask_bce  # noqa: E402

pytestmark = pytest.mark.unit

SIZE = 320
ANCHORS = sum((SIZE // s) ** 2 for s in (8, 16, 32))


def test_detector_without_masks_keeps_the_detect_outputs() -> None:
    model = Detector(3).eval()
    with torch.no_grad():
        out = model(torch.zeros(1, 3, SIZE, SIZE))
        exported = ExportHead(model, SIZE).eval()(torch.zeros(1, 3, SIZE, SIZE))
    assert [tuple(t.shape) for t in out] == [(1, 4, ANCHORS), (1, 3, ANCHORS)]
    assert tuple(exported.shape) == (1, 7, ANCHORS)


def test_segment_variant_has_the_yolov8_seg_shapes() -> None:
    model = Detector(3, masks=32).eval()
    with torch.no_grad():
        dist, logits, coef, proto = model(torch.zeros(2, 3, SIZE, SIZE))
        boxes, protos = ExportHead(model, SIZE).eval()(torch.zeros(1, 3, SIZE, SIZE))
    assert tuple(dist.shape) == (2, 4, ANCHORS) and tuple(logits.shape) == (2, 3, ANCHORS)
    assert tuple(coef.shape) == (2, 32, ANCHORS)
    assert tuple(proto.shape) == (2, 32, SIZE // 4, SIZE // 4)
    assert tuple(boxes.shape) == (1, 4 + 3 + 32, ANCHORS)
    assert tuple(protos.shape) == (1, 32, SIZE // 4, SIZE // 4)
    assert torch.all((boxes[:, 4:7] >= 0) & (boxes[:, 4:7] <= 1)), "scores are sigmoids, coefficients raw"


def test_mask_loss_rewards_the_right_mask_inside_the_box_only() -> None:
    h = w = 8
    target = torch.zeros(1, 1, h, w)
    target[0, 0, 2:4, 2:4] = 1.0
    proto = torch.stack([target[0, 0] * 2 - 1, torch.ones(h, w)])[None]  # (1, 2, h, w)
    fg = torch.tensor([[True]])
    owner = torch.zeros(1, 1, dtype=torch.long)
    box = torch.tensor([[[4.0, 4.0, 20.0, 20.0]]])  # input pixels: cells 1..4 at stride 4
    right = mask_bce(torch.tensor([[[8.0, 0.0]]]), proto, target, fg, owner, box)
    wrong = mask_bce(torch.tensor([[[-8.0, 0.0]]]), proto, target, fg, owner, box)
    assert right.item() < 0.01 < 1.0 < wrong.item()
    outside = proto.clone()
    outside[0, :, 6:, :] = 50.0  # wildly wrong, but outside the box
    assert mask_bce(torch.tensor([[[8.0, 0.0]]]), outside, target, fg, owner, box).item() == pytest.approx(right.item())
    none = mask_bce(torch.tensor([[[8.0, 0.0]]]), proto, target, torch.tensor([[False]]), owner, box)
    assert none.item() == 0.0


def test_segment_loss_reaches_the_prototype_branch() -> None:
    model = Detector(3, masks=32)
    points, strides = anchor_points(SIZE)
    criterion = TaskAlignedLoss(points, strides, 3)
    boxes = torch.tensor([[[40.0, 40.0, 120.0, 100.0]]])
    masks = torch.zeros(1, 1, SIZE // 4, SIZE // 4)
    masks[0, 0, 10:25, 10:30] = 1.0
    dist, logits, coef, proto = model(torch.rand(1, 3, SIZE, SIZE))
    loss, stats = criterion(
        dist, logits, boxes, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), (coef, proto, masks)
    )
    loss.backward()
    assert stats["mask"] > 0
    assert model.proto is not None
    grad = model.proto.post[-1].weight.grad
    assert grad is not None and grad.abs().sum() > 0
