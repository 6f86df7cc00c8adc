"""A model's GFLOPs and parameters, counted from its ONNX graph.

GFLOPs are 2 x the multiply-accumulates of Conv, Gemm and MatMul (the convention behind
ultralytics' "8.7 GFLOPs" for YOLOv8n), from the inferred shapes; parameters count the
initialisers and Constant tensors (some exporters store weights as either). BENCHMARKS.md gives
these figures for the models it times (the demo model: 0.75 GFLOPs, 0.86 M; the YOLOv8n-sized
model: 8.74 GFLOPs, 3.15 M). Needs the onnx package, which the daemon does not.

    python benchmarks/graph_cost.py [--model PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import onnx

from edged.errors import EdgedError
from edged.tools.bench_rows import resolve_model


def graph_cost(path: Path) -> tuple[float, int]:
    """(GFLOPs, parameters) of the model at ``path``."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    shapes: dict[str, list[int]] = {}
    for value in [*model.graph.value_info, *model.graph.output, *model.graph.input]:
        shapes[value.name] = [d.dim_value for d in value.type.tensor_type.shape.dim]
    for init in model.graph.initializer:
        shapes[init.name] = list(init.dims)
    macs = 0
    for node in model.graph.node:
        out = shapes.get(node.output[0], [])
        if node.op_type == "Conv" and out and node.input[1] in shapes:
            macs += math.prod(out) * math.prod(shapes[node.input[1]][1:])
        elif node.op_type in ("Gemm", "MatMul") and out and node.input[0] in shapes:
            macs += math.prod(out) * shapes[node.input[0]][-1]
    constants = [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    params = sum(math.prod(t.dims) for t in [*model.graph.initializer, *constants])
    return 2.0 * macs / 1e9, int(params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, metavar="PATH", help="ONNX model (default: the demo model)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    try:
        path = resolve_model(args.model)
    except EdgedError as e:
        parser.error(str(e))
    gflops, params = graph_cost(path)
    if args.json:
        print(json.dumps({"model": str(path), "gflops": round(gflops, 3), "params": params}))
    else:
        print(f"{path.name}: {gflops:.2f} GFLOPs, {params / 1e6:.2f} M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
