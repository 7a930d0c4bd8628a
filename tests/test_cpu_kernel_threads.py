"""The C kernels' workers (edge_kernels/csrc/parallel.c): on torch's own OpenMP team where the
loader found it, on pthreads in a process without one, and every worker runs even when the
team is smaller than asked; the results are the same bits on every path and thread count."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from edge_kernels import cpu_library, paged_decode_cpu
from edge_kernels.q8_linear_cpu import q8_linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, K, M = 200, 256, 3


# numpy only: run here and in torch-free children alike
CASE = f"""
import hashlib
import numpy as np
N, K, M = {N}, {K}, {M}


def _case():
    rng = np.random.default_rng(7)
    return (rng.standard_normal((M, K)).astype(np.float32), rng.integers(-127, 128, (N, K)).astype(np.int8),
            rng.random((N, K // 32)).astype(np.float32) * 0.01)


def _digest(y):
    return hashlib.sha256(np.ascontiguousarray(y, dtype=np.float32).tobytes()).hexdigest()
"""
_names: dict = {}
exec(CASE, _names)
_case, _digest = _names["_case"], _names["_digest"]

# a child that calls the library through ctypes on numpy arrays, never importing torch
_CHILD = CASE + """
import sys
from edge_kernels import cpu_library
x, codes, scales = _case()
out = []
for threads in (1, 3):
    y = np.empty((M, N), np.float32)
    rc = cpu_library.library().capsule_q8_linear(x.ctypes.data, M, codes.ctypes.data, scales.ctypes.data,
                                                 N, K, y.ctypes.data, threads)
    assert rc == 0
    out.append(_digest(y))
print(cpu_library.shares_openmp(), "torch" in sys.modules, *out)
"""


def test_with_torch_loaded_the_kernels_share_its_openmp_team():
    if sys.platform != "linux" or not torch.backends.openmp.is_available():
        pytest.skip("the team is found through /proc/self/maps of an OpenMP torch")
    assert cpu_library.shares_openmp()
    assert paged_decode_cpu.kernel_threads() == torch.get_num_threads()


def test_every_path_gives_the_same_bits():
    x, codes, scales = _case()
    want = _digest(q8_linear(torch.from_numpy(x), torch.from_numpy(codes), torch.from_numpy(scales), 1).numpy())
    for threads in (2, 5):                              # the OpenMP team (in this process)
        got = q8_linear(torch.from_numpy(x), torch.from_numpy(codes), torch.from_numpy(scales), threads)
        assert _digest(got.numpy()) == want
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shares, has_torch, *digests = out.stdout.split()
    assert (shares, has_torch) == ("False", "False")   # pthreads: no OpenMP runtime loaded
    assert digests == [want, want]


def test_a_team_smaller_than_asked_still_runs_every_worker():
    # OMP_THREAD_LIMIT=1: the runtime gives a team of one; each member runs the workers it owns
    child = CASE + ("import torch\nfrom edge_kernels import cpu_library\n"
                    "from edge_kernels.q8_linear_cpu import q8_linear\n"
                    "x, c, s = (torch.from_numpy(a) for a in _case())\n"
                    "print(cpu_library.shares_openmp(), _digest(q8_linear(x, c, s, 4).numpy()))\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_THREAD_LIMIT": "1"}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    x, codes, scales = _case()
    want = _digest(q8_linear(torch.from_numpy(x), torch.from_numpy(codes), torch.from_numpy(scales), 1).numpy())
    assert out.stdout.split() == [str(cpu_library.shares_openmp()), want]


def test_callers_on_several_threads_at_once_get_their_own_results():
    # two Sessions on two threads (a control loop beside a chat): each caller's OpenMP team is
    # its own; no result leaks into another's
    from concurrent.futures import ThreadPoolExecutor
    x, codes, scales = (torch.from_numpy(a) for a in _case())
    inputs = [x * (i + 1) for i in range(6)]
    want = [q8_linear(xi, codes, scales, 1) for xi in inputs]
    with ThreadPoolExecutor(3) as pool:
        for _ in range(5):
            got = list(pool.map(lambda xi: q8_linear(xi, codes, scales, 2), inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, want))
