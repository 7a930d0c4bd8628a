"""Device profiles: shipped YAML loads and round-trips, validation names the bad key, detection."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from devices import (
    DeviceProfile,
    RuntimeDefaults,
    detect_profile,
    list_profiles,
    load_profile,
)
from devices.detect import _meminfo_total_gb

SHIPPED = ["cuda-desktop", "jetson-agx-orin-64gb", "jetson-orin-nano-8gb",
           "jetson-orin-nx-16gb", "x86-cpu"]


def _valid(name: str = "test-dev") -> dict:
    """A valid cuda profile as a plain dict; tests alter one field."""
    d = load_profile("jetson-orin-nx-16gb").to_dict()
    d["name"] = name
    return copy.deepcopy(d)


def _write(tmp_path: Path, d: dict, stem: str | None = None) -> Path:
    path = tmp_path / f"{stem or d.get('name', 'x')}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False), encoding="utf-8")
    return path


def _load_error(tmp_path: Path, d: dict) -> str:
    path = _write(tmp_path, d)
    with pytest.raises(ValueError) as ei:
        load_profile(path)
    msg = str(ei.value)
    assert str(path) in msg  # the message names the file it came from
    return msg


# ---- shipped profiles ----

def test_list_profiles_sorted_and_complete():
    assert list_profiles() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_round_trips(name):
    p = load_profile(name)
    assert p.name == name
    assert DeviceProfile.from_dict(p.to_dict()) == p
    # to_dict must be YAML-safe (lists, not tuples) so it can be written back out
    again = DeviceProfile.from_dict(yaml.safe_load(yaml.safe_dump(p.to_dict())))
    assert again == p
    assert p.runtime.kv_pool_bytes == int(p.runtime.kv_pool_mb * 2**20)
    # every field a profile holds is one the SDK reads (no validated-but-unused fields)
    assert set(p.to_dict()) == {"name", "description", "device", "runtime", "engines", "checkpoint"}
    assert set(p.to_dict()["checkpoint"]) == {"keep_epochs"}


def test_shipped_values():
    nano = load_profile("jetson-orin-nano-8gb")
    assert nano.device == "cuda" and nano.checkpoint.keep_epochs == 4
    assert nano.runtime.batch_buckets == (1, 2, 4)
    assert load_profile("jetson-agx-orin-64gb").runtime.max_context == 16384
    cpu = load_profile("x86-cpu")
    assert cpu.device == "cpu" and cpu.runtime.dtype == "float32"
    assert cpu.runtime.cuda_graphs is False and cpu.engines == ("onnxruntime", "torch")
    assert cpu.runtime.kv_pool_bytes == 256 * 2**20
    assert load_profile("cuda-desktop").runtime.batch_buckets == (1, 2, 4, 8)


def test_the_profile_keep_epochs_reaches_the_store(tmp_path):
    from capsule import Session
    profile = load_profile("x86-cpu").to_dict()
    profile["name"] = "keep-two"
    profile["checkpoint"]["keep_epochs"] = 2
    with Session.open(tmp_path / "s", model=None, device=_write(tmp_path, profile)) as s:
        for i in range(4):
            s.state = {"i": i}
            s.checkpoint()
        assert len(s.epochs()) == 2


@pytest.mark.parametrize("dotted", ["gpu", "storage", "checkpoint.mode", "checkpoint.every_steps",
                                    "checkpoint.group_commit_ms"])
def test_a_removed_key_is_refused_with_what_to_do(tmp_path, dotted):
    d = _valid()
    _set_path(d, dotted, {"arch": "sm_87"} if "." not in dotted else 10)
    msg = _load_error(tmp_path, d)
    assert msg.startswith(f"{dotted}: removed from device profiles, delete it ("), msg


def test_load_by_path_and_pathlike(tmp_path):
    path = _write(tmp_path, _valid("mine"))
    assert load_profile(path).name == "mine"
    assert load_profile(str(path)).name == "mine"


def test_name_must_equal_file_stem(tmp_path):
    path = _write(tmp_path, _valid("one"), stem="other")
    with pytest.raises(ValueError, match=r"name: 'one'.*stem 'other'"):
        load_profile(path)


def test_unknown_profile_name_lists_available():
    with pytest.raises(ValueError) as ei:
        load_profile("no-such-board")
    msg = str(ei.value)
    assert "no-such-board" in msg
    for name in SHIPPED:
        assert name in msg


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "gone.yaml"
    with pytest.raises(ValueError, match="not found") as ei:
        load_profile(missing)
    assert str(missing) in str(ei.value)


def test_bad_yaml_and_non_mapping(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_profile(tmp_path / "broken.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match="expected mapping"):
        load_profile(tmp_path / "empty.yaml")


# ---- validation: each case alters one field of a valid dict ----

def _set_path(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for k in parents:
        d = d[k]
    d[leaf] = value


@pytest.mark.parametrize("dotted,value,key_in_msg,fragment", [
    ("runtime.block_size", 24, "runtime.block_size", "power of two in 1..256"),
    ("runtime.block_size", 512, "runtime.block_size", "power of two"),
    ("runtime.block_size", True, "runtime.block_size", "bool"),
    ("runtime.block_size", "16", "runtime.block_size", "expected int"),
    ("runtime.batch_buckets", [1, 4, 2], "runtime.batch_buckets", "strictly increasing"),
    ("runtime.batch_buckets", [1, 1, 2], "runtime.batch_buckets", "strictly increasing"),
    ("runtime.batch_buckets", [0, 1], "runtime.batch_buckets", "strictly increasing"),
    ("runtime.batch_buckets", [], "runtime.batch_buckets", "empty"),
    ("runtime.batch_buckets", [1, True], "runtime.batch_buckets[1]", "bool"),
    ("runtime.max_context", 1000, "runtime.max_context", "multiple of runtime.block_size"),
    ("runtime.kv_pool_mb", 0, "runtime.kv_pool_mb", "> 0"),
    ("runtime.dtype", "fp16", "runtime.dtype", "float32, float16, bfloat16"),
    ("runtime.cuda_graphs", 1, "runtime.cuda_graphs", "expected bool"),
    ("runtime.prefill_chunk", 0, "runtime.prefill_chunk", ">= 1"),
    ("runtime.kv_pool_mb", float("inf"), "runtime.kv_pool_mb", "finite"),
    ("checkpoint.keep_epochs", 0, "checkpoint.keep_epochs", ">= 1"),
    ("checkpoint.keep_epochs", 2.5, "checkpoint.keep_epochs", "expected int"),
    ("engines", ["tensorrt", "Tensor RT"], "engines[1]", "not an engine name"),
    ("engines", ["torch", "torch"], "engines", "more than once"),
    ("engines", [], "engines", "empty"),
    ("device", "tpu", "device", "cpu, cuda"),
    ("runtime", [1, 2], "runtime", "expected mapping"),
    ("checkpoint", None, "checkpoint", "expected mapping"),
])
def test_bad_value_names_dotted_key(tmp_path, dotted, value, key_in_msg, fragment):
    d = _valid()
    _set_path(d, dotted, value)
    msg = _load_error(tmp_path, d)
    assert msg.startswith(key_in_msg + ":"), msg
    assert fragment in msg, msg


@pytest.mark.parametrize("section", [None, "runtime", "checkpoint"])
def test_unknown_key_rejected_at_every_level(tmp_path, section):
    d = _valid()
    target = d if section is None else d[section]
    target["turbo"] = 1
    msg = _load_error(tmp_path, d)
    dotted = "turbo" if section is None else f"{section}.turbo"
    assert msg.startswith(f"{dotted}: unknown key"), msg
    assert "allowed:" in msg


@pytest.mark.parametrize("dotted", ["description", "engines", "runtime", "runtime.max_context",
                                    "checkpoint", "checkpoint.keep_epochs"])
def test_missing_key_rejected(tmp_path, dotted):
    d = _valid()
    *parents, leaf = dotted.split(".")
    target = d
    for k in parents:
        target = target[k]
    del target[leaf]
    msg = _load_error(tmp_path, d)
    assert msg.startswith(f"{dotted}: missing key"), msg


def test_cpu_profile_rules(tmp_path):
    cpu = load_profile("x86-cpu").to_dict()
    cpu["name"] = "cpu-graphs"
    cpu["runtime"]["cuda_graphs"] = True
    assert "runtime.cuda_graphs" in _load_error(tmp_path, cpu)
    # which engines exist and where each runs is the policy registry's (test_policy_registry)
    cpu = load_profile("x86-cpu").to_dict()
    cpu["name"] = "cpu-trt"
    cpu["engines"] = ["tensorrt", "tvm"]
    assert load_profile(_write(tmp_path, cpu)).engines == ("tensorrt", "tvm")


def test_from_dict_names_source():
    d = _valid()
    d["runtime"]["block_size"] = 24
    with pytest.raises(ValueError, match=r"^runtime\.block_size: 24 .*\(file robot\.yaml\)$"):
        DeviceProfile.from_dict(d, source="robot.yaml")


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="runtime.block_size"):
        RuntimeDefaults(dtype="float16", kv_pool_mb=1, block_size=3, batch_buckets=(1,),
                        max_context=48, prefill_chunk=16, cuda_graphs=False)


def test_replace_runtime():
    p = load_profile("x86-cpu")
    tiny = p.replace_runtime(kv_pool_mb=0.25, batch_buckets=[1, 2])
    assert tiny.runtime.kv_pool_bytes == 2**18
    assert tiny.runtime.batch_buckets == (1, 2)
    assert p.runtime.kv_pool_mb == 256  # original untouched (frozen)
    with pytest.raises(ValueError, match="runtime.block_size"):
        p.replace_runtime(block_size=24)
    with pytest.raises(ValueError, match="runtime.cuda_graphs"):
        p.replace_runtime(cuda_graphs=True)  # cross-check with device still applies
    with pytest.raises(ValueError, match=r"runtime\.nope: unknown key"):
        p.replace_runtime(nope=1)


# ---- detection ----

@pytest.fixture
def tegra(tmp_path) -> str:
    path = tmp_path / "nv_tegra_release"
    path.write_text("# R36 (release), REVISION: 3.0\n")
    return str(path)


@pytest.mark.parametrize("mem_gb,expected", [
    (7.4, "jetson-orin-nano-8gb"), (8.0, "jetson-orin-nano-8gb"),
    (15.3, "jetson-orin-nx-16gb"), (30.0, "jetson-agx-orin-64gb"),
    (61.4, "jetson-agx-orin-64gb"),
])
def test_detect_jetson_by_memory(tegra, mem_gb, expected):
    for device in ("cuda", "auto"):
        p = detect_profile(device, cuda_available=True, tegra_release_path=tegra,
                           total_memory_gb=mem_gb)
        assert p.name == expected


def test_detect_desktop_and_cpu(tmp_path):
    no_tegra = str(tmp_path / "absent")
    assert detect_profile("cuda", cuda_available=True,
                          tegra_release_path=no_tegra).name == "cuda-desktop"
    assert detect_profile("auto", cuda_available=True,
                          tegra_release_path=no_tegra).name == "cuda-desktop"
    assert detect_profile("auto", cuda_available=False).name == "x86-cpu"
    assert detect_profile("cpu", cuda_available=True).name == "x86-cpu"


def test_detect_cuda_without_cuda_raises(tegra):
    no_cuda = r"device='cuda' but torch\.cuda\.is_available\(\) is False"
    with pytest.raises(ValueError, match=no_cuda):
        detect_profile("cuda", cuda_available=False, tegra_release_path=tegra,
                       total_memory_gb=8.0)
    with pytest.raises(ValueError, match="jetson-orin-nx-16gb.*needs CUDA"):
        detect_profile("jetson-orin-nx-16gb", cuda_available=False)


def test_detect_passes_names_and_paths_through(tmp_path):
    assert detect_profile("x86-cpu", cuda_available=False).name == "x86-cpu"
    assert detect_profile("cuda-desktop", cuda_available=True).name == "cuda-desktop"
    path = _write(tmp_path, _valid("custom"))
    assert detect_profile(path, cuda_available=True).name == "custom"
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        detect_profile("tpu", cuda_available=True)


def test_detect_asks_torch_when_not_told():
    import torch
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert detect_profile("auto").device == expected


def test_meminfo_parsing(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        7990772 kB\nMemFree:  100 kB\n")
    assert _meminfo_total_gb(str(meminfo)) == pytest.approx(7.62, abs=0.01)
    meminfo.write_text("MemFree:  100 kB\n")
    with pytest.raises(ValueError, match="MemTotal"):
        _meminfo_total_gb(str(meminfo))
    with pytest.raises(ValueError, match="total_memory_gb"):
        _meminfo_total_gb(str(tmp_path / "absent"))


def test_block_size_is_one_default_a_profile_may_override(tmp_path):
    from devices.profile import BLOCK_SIZE, PROFILE_DIR
    assert {load_profile(n).runtime.block_size for n in list_profiles()} == {BLOCK_SIZE}
    assert all("block_size" not in (PROFILE_DIR / f"{n}.yaml").read_text() for n in list_profiles())
    d = _valid()
    d["runtime"]["block_size"] = 2 * BLOCK_SIZE
    assert load_profile(_write(tmp_path, d)).runtime.block_size == 2 * BLOCK_SIZE
