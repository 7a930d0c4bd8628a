"""PolicySpec: what a policy consumes and produces, and its validation from an ONNX graph.

Naming follows LeRobot: inputs `observation.state` (required), `observation.environment_state`
and `observation.images.<cam>` (optional), plus `hidden_in` for a recurrent policy; outputs
`action` and, with `hidden_in`, `hidden_out`. Every tensor has a leading batch dimension of 1
(fixed or symbolic); every other dimension must be a fixed size, because the runtime binds
the policy to static buffers allocated once.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError, UnsupportedArchitecture

STATE = "observation.state"
ENV_STATE = "observation.environment_state"
IMAGE_PREFIX = "observation.images."
HIDDEN_IN, HIDDEN_OUT, ACTION = "hidden_in", "hidden_out", "action"

OBS_DTYPES = ("float32", "float16", "uint8", "int32", "int64")
STATE_DTYPES = ("float32", "float16")  # action and hidden
Shape = tuple[int, ...]


def is_observation_key(key: str) -> bool:
    return key in (STATE, ENV_STATE) or (key.startswith(IMAGE_PREFIX) and len(key) > len(IMAGE_PREFIX))


@dataclass(frozen=True)
class PolicySpec:
    """Shapes (without the batch dim) and numpy dtype names of a policy's inputs and outputs.

    observation: key -> (shape, dtype); `action_shape` is (A,) for one action or (T, A) for a
    chunk of T actions; `hidden_shape` is the recurrent state's shape, None when stateless;
    `digest` is the sha256 of the ONNX bytes (or of a builtin's weights). action_dtype and
    hidden_dtype are "float32" (default) or "float16".
    """

    observation: dict[str, tuple[Shape, str]]
    action_shape: Shape
    hidden_shape: Shape | None
    digest: str
    name: str
    action_dtype: str = "float32"
    hidden_dtype: str = "float32"

    def __post_init__(self) -> None:
        if STATE not in self.observation:
            raise ValueError(f"policy {self.name!r}: observation must include {STATE!r}, "
                             f"got {sorted(self.observation)}")
        for key, (shape, dtype) in self.observation.items():
            if not is_observation_key(key):
                raise ValueError(f"policy {self.name!r}: observation key {key!r} is not "
                                 f"{STATE!r}, {ENV_STATE!r} or '{IMAGE_PREFIX}<cam>'")
            _check_shape(f"observation {key!r}", shape)
            if dtype not in OBS_DTYPES:
                raise ValueError(f"policy {self.name!r}: observation {key!r} dtype {dtype!r} is "
                                 f"not one of {', '.join(OBS_DTYPES)}")
        _check_shape("action_shape", self.action_shape)
        if len(self.action_shape) not in (1, 2):
            raise ValueError(f"policy {self.name!r}: action_shape must be (A,) or (T, A), "
                             f"got {self.action_shape}")
        if self.hidden_shape is not None:
            _check_shape("hidden_shape", self.hidden_shape)
        for what, dtype in (("action_dtype", self.action_dtype), ("hidden_dtype", self.hidden_dtype)):
            if dtype not in STATE_DTYPES:
                raise ValueError(f"policy {self.name!r}: {what} {dtype!r} is not one of "
                                 f"{', '.join(STATE_DTYPES)}")

    @property
    def recurrent(self) -> bool:
        return self.hidden_shape is not None


def _check_shape(what: str, shape: Any) -> None:
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"{what} must be a tuple of positive ints, got {shape!r}")


# -- ONNX ------------------------------------------------------------------------------------

def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def spec_from_onnx(path: str | os.PathLike, *, name: str | None = None,
                   digest: str | None = None) -> PolicySpec:
    """Read and validate an ONNX policy's inputs/outputs against the naming convention.

    Raises ModelLoadError (missing/unknown names, hidden_in without hidden_out, hidden shape
    mismatch) or UnsupportedArchitecture (dtype, batch > 1, dynamic non-batch dims); each
    message names the offending tensor and lists what the graph declares.
    """
    try:
        import onnx
    except ImportError:
        raise ModelLoadError("loading an ONNX policy needs the `onnx` package: "
                             "pip install 'exec-capsules[onnx]'") from None
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"policy file {str(path)!r} does not exist")
    try:  # weights are not needed to read the interface
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types
        raise ModelLoadError(f"{path.name}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    ins = {v.name: v for v in graph.input if v.name not in inits}  # old IRs list weights as inputs
    outs = {v.name: v for v in graph.output}
    label = name or path.stem
    found = f"found inputs {sorted(ins)}, outputs {sorted(outs)}"

    def fail(msg: str, cls: type[ModelLoadError] = ModelLoadError) -> ModelLoadError:
        return cls(f"ONNX policy {path.name}: {msg}; {found}")

    if STATE not in ins:
        raise fail(f"missing required input {STATE!r}")
    if ACTION not in outs:
        raise fail(f"missing required output {ACTION!r}")
    unknown_in = [k for k in ins if k != HIDDEN_IN and not is_observation_key(k)]
    if unknown_in:
        raise fail(f"unknown input(s) {unknown_in} (allowed: {STATE!r}, {ENV_STATE!r}, "
                   f"'{IMAGE_PREFIX}<cam>', {HIDDEN_IN!r})")
    unknown_out = [k for k in outs if k not in (ACTION, HIDDEN_OUT)]
    if unknown_out:
        raise fail(f"unknown output(s) {unknown_out} (allowed: {ACTION!r}, {HIDDEN_OUT!r})")
    if (HIDDEN_IN in ins) != (HIDDEN_OUT in outs):
        have, lack = (HIDDEN_IN, HIDDEN_OUT) if HIDDEN_IN in ins else (HIDDEN_OUT, HIDDEN_IN)
        raise fail(f"has {have!r} but no {lack!r}: a recurrent policy needs both")

    def typed(v: Any, allowed: tuple[str, ...]) -> tuple[Shape, str]:
        return _value_info(onnx, v, allowed, fail)

    observation = {k: typed(v, OBS_DTYPES) for k, v in ins.items() if k != HIDDEN_IN}
    action_shape, action_dtype = typed(outs[ACTION], STATE_DTYPES)
    if len(action_shape) not in (1, 2):
        raise fail(f"output 'action' has shape (1, {action_shape}) after the batch dim; "
                   "expected (1, A) or (1, T, A)", UnsupportedArchitecture)
    hidden_shape, hidden_dtype = None, "float32"
    if HIDDEN_IN in ins:
        hin, din = typed(ins[HIDDEN_IN], STATE_DTYPES)
        hout, dout = typed(outs[HIDDEN_OUT], STATE_DTYPES)
        if (hin, din) != (hout, dout):
            raise fail(f"hidden_in is {hin} {din} but hidden_out is {hout} {dout}; "
                       "they must match (hidden_out is fed back as hidden_in)")
        hidden_shape, hidden_dtype = hin, din
    return PolicySpec(observation=observation, action_shape=action_shape, hidden_shape=hidden_shape,
                      digest=digest or file_digest(path), name=label, action_dtype=action_dtype,
                      hidden_dtype=hidden_dtype)


def _value_info(onnx: Any, v: Any, allowed: tuple[str, ...], fail: Any) -> tuple[Shape, str]:
    """(shape without batch, dtype name) of one graph input/output, or a typed error."""
    tt = v.type.tensor_type
    if not v.type.HasField("tensor_type") or tt.elem_type == 0:
        raise fail(f"{v.name!r} is not a typed tensor", UnsupportedArchitecture)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
    if dtype not in allowed:
        raise fail(f"{v.name!r} has dtype {dtype}; supported: {', '.join(allowed)}", UnsupportedArchitecture)
    if not tt.HasField("shape") or not tt.shape.dim:
        raise fail(f"{v.name!r} has no static shape (need (1, ...))", UnsupportedArchitecture)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    if dims[0] not in (1, None):
        raise fail(f"{v.name!r} has batch dim {dims[0]}; policies run with batch 1", UnsupportedArchitecture)
    rest = dims[1:]
    if any(d is None or d <= 0 for d in rest):
        shown = ["?" if d is None else d for d in dims]
        raise fail(f"{v.name!r} has shape {shown}: every dim after the batch must be fixed "
                   "(static buffers)", UnsupportedArchitecture)
    return tuple(rest), dtype
