"""export_onnx: a builtin policy -> an ONNX file, built node by node with `onnx.helper`.

No torch.onnx (whose exporter may need `onnxscript`): the graph is written directly from the
module's weights, opset 17, IR version 8 (readable by onnxruntime >= 1.13 and TensorRT 8.6+),
batch dim fixed at 1. The GRU uses the ONNX `GRU` op with linear_before_reset=1, which is
torch.nn.GRUCell's formula n = tanh(W_in x + b_in + r * (W_hn h + b_hn)); torch orders the
gate rows (r, z, n), ONNX (z, r, h), so the rows are permuted on the way out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedArchitecture
from ..paths import cache_dir, write_private
from .builtin import BuiltinPolicy, GruPolicy, MlpPolicy, builtin_policy
from .spec import ACTION, HIDDEN_IN, HIDDEN_OUT, STATE

OPSET, IR_VERSION = 17, 8


def export_onnx(source_or_module: str | BuiltinPolicy, path: str | os.PathLike) -> Path:
    """Write `source_or_module` ("builtin:gru", "mlp", or a builtin policy module) as ONNX to path.

    The file is written atomically (temp file + rename) and passes onnx.checker. Returns path.
    """
    onnx = _onnx()
    module = builtin_policy(source_or_module) if isinstance(source_or_module, str) else source_or_module
    model = build_onnx(module)
    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, model.SerializeToString())
    return path


def builtin_onnx_path(module: BuiltinPolicy, digest: str) -> Path:
    """The builtin's ONNX file in the capsule cache, exported once per weights digest."""
    path = cache_dir() / "policy" / f"{module.kind}-{digest[:16]}.onnx"
    if not path.is_file():
        export_onnx(module, path)
    return path


def build_onnx(module: BuiltinPolicy) -> Any:
    """The ModelProto of a builtin policy module (MlpPolicy or GruPolicy)."""
    if not isinstance(module, (MlpPolicy, GruPolicy)):
        raise UnsupportedArchitecture(f"export_onnx handles the builtin policies (MlpPolicy, GruPolicy), "
                                      f"not {type(module).__name__}")
    onnx = _onnx()
    h = onnx.helper
    inits: list[Any] = []

    def init(name: str, t: torch.Tensor) -> str:  # float weights as float32, int64 shapes/axes as is
        t = t.detach().cpu().contiguous()
        inits.append(onnx.numpy_helper.from_array((t.float() if t.is_floating_point() else t).numpy(), name))
        return name

    def gemm(x: str, lin: torch.nn.Linear, out: str) -> Any:  # y = x W^T + b
        return h.make_node("Gemm", [x, init(f"{out}.W", lin.weight), init(f"{out}.b", lin.bias)], [out],
                           transB=1)

    f32 = onnx.TensorProto.FLOAT
    state_dim = module.fc1.in_features if isinstance(module, MlpPolicy) else module.cell.input_size
    ins = [h.make_tensor_value_info(STATE, f32, [1, state_dim])]
    outs = [h.make_tensor_value_info(ACTION, f32, [1, *module.action_shape])]
    if isinstance(module, MlpPolicy):
        nodes = [gemm(STATE, module.fc1, "fc1"), h.make_node("Relu", ["fc1"], ["r1"]),        # (1, W)
                 gemm("r1", module.fc2, "fc2"), h.make_node("Relu", ["fc2"], ["r2"]),          # (1, W)
                 gemm("r2", module.head, "head")]                                              # (1, T*A)
        if module.chunk:
            shape = init("chunk_shape", torch.tensor([1, *module.action_shape]))
            nodes += [h.make_node("Tanh", ["head"], ["a"]),
                      h.make_node("Reshape", ["a", shape], [ACTION])]                          # (1, T, A)
        else:
            nodes.append(h.make_node("Tanh", ["head"], [ACTION]))                              # (1, A)
    else:  # GruPolicy
        cell, hd = module.cell, module.cell.hidden_size

        def zrn(t: torch.Tensor) -> torch.Tensor:  # torch rows (r, z, n) -> ONNX rows (z, r, h)
            r, z, n = t.chunk(3, dim=0)
            return torch.cat([z, r, n], dim=0)

        W = zrn(cell.weight_ih).unsqueeze(0)                                  # (1, 3H, S)
        R = zrn(cell.weight_hh).unsqueeze(0)                                  # (1, 3H, H)
        B = torch.cat([zrn(cell.bias_ih), zrn(cell.bias_hh)]).unsqueeze(0)   # (1, 6H) = [Wb, Rb]
        axes0 = init("axes0", torch.tensor([0]))
        ins.append(h.make_tensor_value_info(HIDDEN_IN, f32, [1, hd]))
        outs.append(h.make_tensor_value_info(HIDDEN_OUT, f32, [1, hd]))
        nodes = [h.make_node("Unsqueeze", [STATE, axes0], ["X"]),           # (seq 1, batch 1, S)
                 h.make_node("Unsqueeze", [HIDDEN_IN, axes0], ["H0"]),      # (dirs 1, batch 1, H)
                 h.make_node("GRU", ["X", init("W", W), init("R", R), init("B", B), "", "H0"],
                             ["", "Y_h"], hidden_size=hd, linear_before_reset=1),  # Y_h (1, 1, H)
                 h.make_node("Squeeze", ["Y_h", axes0], [HIDDEN_OUT]),      # (1, H)
                 gemm(HIDDEN_OUT, module.head, "head"),                     # (1, A)
                 h.make_node("Tanh", ["head"], [ACTION])]
    graph = h.make_graph(nodes, f"capsule-{module.kind}", ins, outs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="capsule",
                         ir_version=IR_VERSION)
    model.doc_string = f"{module.kind}: {module.description}"
    return model


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise UnsupportedArchitecture("exporting to ONNX needs the `onnx` package: "
                                      "pip install 'exec-capsules[onnx]'") from None
    return onnx
