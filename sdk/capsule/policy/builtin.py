"""Builtin policies: tiny torch modules with SEEDED RANDOM, UNTRAINED weights.

They exist for examples, tests and benchmarks of the runtime (engines, static buffers,
checkpoints), not to control a robot: their actions are meaningless. Each is deterministic
(the same weights on every machine and every call) and small: state 14, action 6, hidden 32.

    builtin:mlp        observation.state (1, 14) -> action (1, 6)                 stateless
    builtin:mlp-chunk  observation.state (1, 14) -> action (1, 4, 6)              stateless, chunk T=4
    builtin:gru        observation.state (1, 14), hidden_in (1, 32)
                       -> action (1, 6), hidden_out (1, 32)                       recurrent (GRUCell)
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..digests import tensors_sha256
from .spec import STATE, PolicySpec

STATE_DIM, ACTION_DIM, HIDDEN_DIM, MLP_WIDTH, CHUNK = 14, 6, 32, 64, 4
SEEDS = {"mlp": 1001, "mlp-chunk": 1002, "gru": 1003}
BUILTIN_PREFIX = "builtin:"


class BuiltinPolicy(nn.Module):
    """Base of the builtin policies: forward(obs, hidden) -> (action, hidden_out or None).

    obs maps observation keys to (1, *shape) tensors. Untrained: seeded random weights.
    """

    kind: str = ""
    action_shape: tuple[int, ...] = (ACTION_DIM,)
    hidden_shape: tuple[int, ...] | None = None
    description: str = "UNTRAINED builtin policy (seeded random weights)"

    def forward(self, obs: dict[str, torch.Tensor],
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def digest(self) -> str:
        """sha256 of the kind and every weight's name, dtype, shape and bytes."""
        return tensors_sha256(self.state_dict().items(), prefix=self.kind.encode())

    def spec(self) -> PolicySpec:
        return PolicySpec(observation={STATE: ((STATE_DIM,), "float32")}, action_shape=self.action_shape,
                          hidden_shape=self.hidden_shape, digest=self.digest(),
                          name=BUILTIN_PREFIX + self.kind)


class MlpPolicy(BuiltinPolicy):
    """state -> Linear-ReLU-Linear-ReLU-Linear-Tanh -> action (A,) or a chunk (T, A).

    The builtins use the defaults; an app may size one to its robot, train it (it is a plain
    nn.Module) and write it with ``capsule.policy.export_onnx(module, path)`` for Session.open's
    ``policy=`` (set ``description`` to say what it is: it becomes the ONNX doc string)."""

    def __init__(self, kind: str = "mlp", chunk: int | None = None, *, state_dim: int = STATE_DIM,
                 action_dim: int = ACTION_DIM, width: int = MLP_WIDTH):
        super().__init__()
        self.kind = kind
        self.chunk = chunk
        out = action_dim * (chunk or 1)
        self.fc1 = nn.Linear(state_dim, width)
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, out)
        self.action_shape = (chunk, action_dim) if chunk else (action_dim,)

    def forward(self, obs, hidden=None):
        x = obs[STATE]                                            # (1, S)
        x = torch.relu(self.fc1(x))                               # (1, W)
        x = torch.relu(self.fc2(x))                               # (1, W)
        a = torch.tanh(self.head(x))                              # (1, T*A)
        return a.view(a.shape[0], *self.action_shape), None       # (1, [T,] A)


class GruPolicy(BuiltinPolicy):
    """state, hidden -> GRUCell -> hidden_out -> Linear-Tanh -> action (A,)."""

    kind = "gru"
    hidden_shape = (HIDDEN_DIM,)

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(STATE_DIM, HIDDEN_DIM)
        self.head = nn.Linear(HIDDEN_DIM, ACTION_DIM)

    def forward(self, obs, hidden=None):
        x = obs[STATE]                                            # (1, S)
        if hidden is None:
            raise ValueError("builtin:gru is recurrent: pass hidden (1, 32)")
        h = self.cell(x, hidden)                                  # (1, H)
        return torch.tanh(self.head(h)), h                        # (1, A), (1, H)


def _seed_weights(module: nn.Module, seed: int) -> None:
    """Weights ~ U(+-1/sqrt(fan_in)), biases ~ U(+-0.1), from a private generator (global RNG untouched)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            bound = 1.0 / math.sqrt(p.shape[-1]) if p.ndim > 1 else 0.1
            p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float32) * (2 * bound) - bound)


def builtin_names() -> tuple[str, ...]:
    return tuple(SEEDS)


def builtin_policy(name: str) -> BuiltinPolicy:
    """A builtin policy ("mlp" | "mlp-chunk" | "gru", "builtin:" prefix optional), eval mode, CPU.

    UNTRAINED: seeded random weights, for examples and tests only.
    """
    kind = name.removeprefix(BUILTIN_PREFIX)
    if kind not in SEEDS:
        raise ValueError(f"unknown builtin policy {name!r}; builtins: "
                         f"{', '.join(BUILTIN_PREFIX + k for k in SEEDS)}")
    module: BuiltinPolicy
    with torch.random.fork_rng(devices=[]):  # nn.Linear's default init draws from the global RNG
        module = GruPolicy() if kind == "gru" else MlpPolicy(kind, CHUNK if kind == "mlp-chunk" else None)
    _seed_weights(module, SEEDS[kind])
    return module.eval().requires_grad_(False)
