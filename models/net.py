"""The demo detector: a small anchor-free, YOLOv8-style network and its training loss.

Owned here: the architecture (strided conv backbone, top-down neck, decoupled box/class heads at
strides 8/16/32), the inference head that emits exactly the ultralytics ``yolov8`` layout
(``[1, 4 + nc, N]``: cx, cy, w, h in input pixels, then sigmoid class scores), and the
task-aligned assignment + loss used to train it. The segmentation variant (``masks=32``) adds
what ``yolov8-seg`` has: 32 prototypes at stride 4 and 32 mask coefficients per anchor, exported
as ``[1, 4 + nc + 32, N]`` and ``[1, 32, S/4, S/4]``, trained with a per-instance mask BCE.
Only `models/train.py` imports this; torch is an optional extra and nothing under ``edged/``
depends on it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STRIDES: tuple[int, ...] = (8, 16, 32)
PROTO_STRIDE = STRIDES[0] // 2  # prototypes: the stride-8 features upsampled 2x
# SiLU for the shipped model; ReLU folds into an INT8 convolution, while each SiLU stays a
# separate sigmoid and multiply (models/README.md, "INT8 variant", compares the two).
ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": nn.SiLU, "relu": nn.ReLU}


def conv(c_in: int, c_out: int, k: int = 3, s: int = 1, act: str = "silu") -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), ACTIVATIONS[act](inplace=True)
    )


class Residual(nn.Module):
    """Two 3x3 convs with a skip connection."""

    def __init__(self, c: int, act: str) -> None:
        super().__init__()
        self.body = nn.Sequential(conv(c, c, act=act), conv(c, c, act=act))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class Head(nn.Module):
    """Decoupled branches for one level: 4 box distances (ltrb, in strides), nc class logits and,
    for segmentation, `nm` mask coefficients."""

    def __init__(self, c: int, nc: int, act: str, nm: int = 0) -> None:
        super().__init__()
        self.box = nn.Sequential(conv(c, c, act=act), nn.Conv2d(c, 4, 1))
        self.cls = nn.Sequential(conv(c, c, act=act), nn.Conv2d(c, nc, 1))
        self.coef = nn.Sequential(conv(c, c, act=act), nn.Conv2d(c, nm, 1)) if nm else None
        nn.init.constant_(self.box[-1].get_parameter("bias"), 0.5)
        nn.init.constant_(self.cls[-1].get_parameter("bias"), -math.log(99.0))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        out = (self.box(x).flatten(2), self.cls(x).flatten(2))
        return out if self.coef is None else (*out, self.coef(x).flatten(2))


class Proto(nn.Module):
    """Mask prototypes at stride 4: the stride-8 features, upsampled 2x, to `nm` channels."""

    def __init__(self, c: int, nm: int, act: str) -> None:
        super().__init__()
        self.pre = conv(c, c, act=act)
        self.post = nn.Sequential(conv(c, c, act=act), nn.Conv2d(c, nm, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.post(F.interpolate(self.pre(x), scale_factor=2.0, mode="nearest"))


class Detector(nn.Module):
    """320x320 RGB in; raw per-anchor (ltrb distances in pixels, class logits) out, and with
    `masks` > 0 also per-anchor mask coefficients (B, masks, A) and prototypes (B, masks, S/4, S/4)."""

    def __init__(
        self, nc: int = 3, width: tuple[int, ...] = (16, 24, 48, 96, 128), act: str = "silu", masks: int = 0
    ) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = width
        self.stem = nn.Sequential(conv(3, c1, 3, 2, act), conv(c1, c2, 3, 2, act))
        self.p3 = nn.Sequential(conv(c2, c3, 3, 2, act), Residual(c3, act))
        self.p4 = nn.Sequential(conv(c3, c4, 3, 2, act), Residual(c4, act))
        self.p5 = nn.Sequential(conv(c4, c5, 3, 2, act), Residual(c5, act))
        self.lat5, self.lat4, self.lat3 = conv(c5, c3, 1, act=act), conv(c4, c3, 1, act=act), conv(c3, c3, 1, act=act)
        self.fuse4, self.fuse3 = conv(c3, c3, act=act), conv(c3, c3, act=act)
        self.heads = nn.ModuleList(Head(c3, nc, act, masks) for _ in STRIDES)
        self.proto = Proto(c3, masks, act) if masks else None
        self.nc, self.masks = nc, masks

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        x3 = self.p3(self.stem(x))
        x4 = self.p4(x3)
        t5 = self.lat5(self.p5(x4))
        t4 = self.fuse4(self.lat4(x4) + F.interpolate(t5, scale_factor=2.0, mode="nearest"))
        t3 = self.fuse3(self.lat3(x3) + F.interpolate(t4, scale_factor=2.0, mode="nearest"))
        outs = [head(t) for head, t in zip(self.heads, (t3, t4, t5), strict=True)]
        strides = torch.cat(
            [torch.full((o[0].shape[-1],), float(s), device=x.device) for o, s in zip(outs, STRIDES, strict=True)]
        )
        dist = F.softplus(torch.cat([o[0] for o in outs], 2)) * strides
        logits = torch.cat([o[1] for o in outs], 2)
        if self.proto is None:
            return dist, logits
        return dist, logits, torch.cat([o[2] for o in outs], 2), self.proto(t3)


def anchor_points(size: int, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Anchor centres (A, 2) in input pixels and their strides (A,), level by level."""
    points, strides = [], []
    for s in STRIDES:
        n = size // s
        c = (torch.arange(n, dtype=torch.float32, device=device) + 0.5) * s
        yy, xx = torch.meshgrid(c, c, indexing="ij")
        points.append(torch.stack([xx.flatten(), yy.flatten()], 1))
        strides.append(torch.full((n * n,), float(s), device=device))
    return torch.cat(points), torch.cat(strides)


class ExportHead(nn.Module):
    """Wraps a `Detector` so its output is the ultralytics yolov8 tensor [1, 4+nc, A], or for a
    segmentation model yolov8-seg's pair: [1, 4+nc+nm, A] (raw coefficients last) and prototypes."""

    def __init__(self, model: Detector, size: int) -> None:
        super().__init__()
        self.model = model
        points, _ = anchor_points(size)
        self.register_buffer("points", points.t().unsqueeze(0).contiguous())

    def forward(self, images: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        dist, logits, *seg = self.model(images)
        lt, rb = dist[:, :2], dist[:, 2:]
        x1y1, x2y2 = self.points - lt, self.points + rb
        boxes = torch.cat([(x1y1 + x2y2) / 2, x2y2 - x1y1, logits.sigmoid()], 1)
        if not seg:
            return boxes
        coef, proto = seg
        return torch.cat([boxes, coef], 1), proto


def box_iou_pairs(a: Tensor, b: Tensor, eps: float = 1e-7) -> tuple[Tensor, Tensor]:
    """IoU and GIoU of matching xyxy boxes (..., 4)."""
    wh = (torch.min(a[..., 2:], b[..., 2:]) - torch.max(a[..., :2], b[..., :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    union = area_a + area_b - inter + eps
    iou = inter / union
    hull = torch.max(a[..., 2:], b[..., 2:]) - torch.min(a[..., :2], b[..., :2])
    hull_area = hull[..., 0] * hull[..., 1] + eps
    return iou, iou - (hull_area - union) / hull_area


class TaskAlignedLoss:
    """TAL assignment (top-k of score^alpha * IoU^beta among anchors inside the box) + losses.

    An anchor is a candidate for a ground-truth box when its centre lies in the box widened to
    at least one stride per side, so very thin boxes still own a row of anchors. Class targets
    are the normalised alignment metric (IoU-aware BCE); boxes get GIoU and an L1 on ltrb/stride,
    both weighted by that target.
    """

    def __init__(
        self, points: Tensor, strides: Tensor, nc: int, topk: int = 10, alpha: float = 0.5, beta: float = 6.0
    ) -> None:
        self.points, self.strides, self.nc = points, strides, nc
        self.topk, self.alpha, self.beta = topk, alpha, beta

    def __call__(
        self,
        dist: Tensor,
        logits: Tensor,
        gt_boxes: Tensor,
        gt_cls: Tensor,
        gt_valid: Tensor,
        seg: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Detection loss; with `seg` = (coefficients, prototypes, gt masks (B, G, S/4, S/4) float)
        also the mask loss."""
        dist, logits = dist.transpose(1, 2), logits.transpose(1, 2)
        pred = torch.cat([self.points - dist[..., :2], self.points + dist[..., 2:]], -1)
        scores = logits.sigmoid()
        target_scores, target_boxes, fg, owner = self._assign(scores.detach(), pred.detach(), gt_boxes, gt_cls, gt_valid)
        norm = target_scores.sum().clamp(min=1.0)
        cls_loss = F.binary_cross_entropy_with_logits(logits, target_scores, reduction="sum") / norm
        weight = target_scores.sum(-1)[fg]
        iou, giou = box_iou_pairs(pred[fg], target_boxes[fg])
        box_loss = ((1 - giou) * weight).sum() / norm
        strides = self.strides.expand(fg.shape)[fg][:, None]
        tgt_dist = torch.cat(
            [
                self.points.expand(*fg.shape, 2)[fg] - target_boxes[fg][:, :2],
                target_boxes[fg][:, 2:] - self.points.expand(*fg.shape, 2)[fg],
            ],
            1,
        )
        l1 = ((dist[fg] - tgt_dist).abs() / strides).mean(1)
        l1_loss = (l1 * weight).sum() / norm
        total = 0.5 * cls_loss + 7.5 * box_loss + 1.5 * l1_loss
        stats = {
            "cls": cls_loss.item(),
            "box": box_loss.item(),
            "l1": l1_loss.item(),
            "iou": iou.detach().mean().item() if iou.numel() else 0.0,
        }
        if seg is not None:
            mask_loss = mask_bce(seg[0].transpose(1, 2), seg[1], seg[2], fg, owner, target_boxes)
            total = total + 7.5 * mask_loss
            stats["mask"] = mask_loss.item()
        return total * gt_boxes.shape[0], stats

    @torch.no_grad()
    def _assign(
        self, scores: Tensor, pred: Tensor, gt_boxes: Tensor, gt_cls: Tensor, gt_valid: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Class targets (B, A, nc), box targets (B, A, 4), foreground (B, A) and owning gt (B, A)."""
        b, a, _ = scores.shape
        half = torch.maximum((gt_boxes[..., 2:] - gt_boxes[..., :2])[:, :, None] / 2, self.strides[None, None, :, None] / 2)
        centre = (gt_boxes[..., :2] + gt_boxes[..., 2:])[:, :, None] / 2
        inside = ((self.points[None, None] - centre).abs() <= half).all(-1)
        inside &= gt_valid[..., None]
        iou, _ = box_iou_pairs(pred[:, None], gt_boxes[:, :, None])
        cls_idx = gt_cls.clamp(min=0)[..., None].expand(-1, -1, a)
        cls_score = scores.transpose(1, 2).gather(1, cls_idx)
        iou = iou.clamp(min=0) * inside
        align = cls_score.pow(self.alpha) * iou.pow(self.beta) * inside
        top = align.topk(min(self.topk, a), -1).indices
        pos = torch.zeros_like(inside).scatter_(-1, top, True) & inside & (align > 0)
        multi = pos.sum(1, keepdim=True) > 1
        best = F.one_hot(iou.argmax(1), gt_boxes.shape[1]).transpose(1, 2).bool()
        pos = torch.where(multi, best & inside, pos)
        fg = pos.any(1)
        owner = pos.float().argmax(1)
        align = align * pos
        norm_align = align * (iou * pos).amax(-1, keepdim=True) / (align.amax(-1, keepdim=True) + 1e-9)
        target_scores = torch.zeros(b, a, self.nc, device=scores.device)
        owner_cls = gt_cls.gather(1, owner).clamp(min=0)
        strength = norm_align.amax(1) * fg
        target_scores.scatter_(-1, owner_cls[..., None], strength[..., None])
        target_boxes = gt_boxes.gather(1, owner[..., None].expand(-1, -1, 4))
        return target_scores, target_boxes, fg, owner


def mask_bce(coef: Tensor, proto: Tensor, gt_masks: Tensor, fg: Tensor, owner: Tensor, boxes: Tensor) -> Tensor:
    """Mean over foreground anchors of the BCE of coefficients x prototypes against the owning
    instance's mask, inside its box only (as ultralytics' ``single_mask_loss``), so a mask is
    learnt where `process_mask` will crop it.

    coef (B, A, nm); proto (B, nm, h, w); gt_masks (B, G, h, w) in 0..1 at `PROTO_STRIDE`; boxes
    (B, A, 4) in input pixels.
    """
    if not bool(fg.any()):
        return coef.sum() * 0.0
    batch = fg.nonzero()[:, 0]
    h, w = proto.shape[2:]
    logits = torch.einsum("nc,nchw->nhw", coef[fg], proto[batch])
    target = gt_masks[batch, owner[fg]]
    box = boxes[fg] / PROTO_STRIDE
    xs = torch.arange(w, device=coef.device, dtype=coef.dtype)[None, None, :] + 0.5
    ys = torch.arange(h, device=coef.device, dtype=coef.dtype)[None, :, None] + 0.5
    crop = (xs >= box[:, 0, None, None]) & (xs < box[:, 2, None, None])
    crop = crop & (ys >= box[:, 1, None, None]) & (ys < box[:, 3, None, None])
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none") * crop
    area = crop.sum((1, 2)).clamp(min=1)
    return (bce.sum((1, 2)) / area).mean()
