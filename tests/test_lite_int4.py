"""capsule.lite over an all-int4 model (a kit of engine "int4-c"): a process that never imports
torch continues the store's newest capsule through the package's C decode step and Q8_0 head
with the very greedy ids the int4 Session generates after restoring it; the kit maps the
weights from the Session's own cache files; a tampered kit, a changed weights file or a setup the
step does not cover is refused with a CapsuleError that says what to do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsule import Session
from capsule.errors import CapsuleCorrupt, CapsuleError, CapsuleMismatch, LiteUnsupported
from capsule.lite import LiteResume
from capsule.lite.kit import Kit, kit_path
from capsule.llm.int4_linear import kernel_missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))]
INT4 = {"threads": 1, "linears": "int4"}
PROMPT = "Robot log: picked up the red cup, moving to the sink. The next three steps are"
NEW = 40       # crosses two 16-token blocks: the lite restore allocates blocks as the Session does


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store whose newest capsule was taken mid-reply by SmolLM2 int4 (trained: ids vary), its kit."""
    path = tmp_path_factory.mktemp("lite4") / "s"
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=INT4) as s:
        assert s.engine.runner.model.step is not None
        s.append(PROMPT)
        s.generate(5)
        s.checkpoint()
        assert s.write_lite_kit() == kit_path(path)
    return path


def _session_ids(path: Path, n: int, runtime: dict = INT4) -> list[int]:
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=runtime) as s:
        n0 = len(s.tokens())
        s.generate(n)
        return s.tokens()[n0:]


def test_fresh_process_without_torch_generates_the_int4_sessions_ids(store):
    child = ("import json, sys\nsys.modules['torch'] = None   # any import of torch fails\n"
             "from capsule.lite import LiteResume\n"
             f"with LiteResume.open({str(store)!r}, threads=2) as r:\n"
             f"    print(json.dumps({{'epoch': r.epoch, 'ids': r.generate({NEW})}}))\n"
             "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n"
             "assert 'onnxruntime' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    ref = _session_ids(store, NEW)
    assert got["ids"] == ref and got["epoch"] == 1
    assert len(set(ref)) > 10          # a real continuation, not one id repeated


def test_the_kit_maps_the_sessions_cache_files(store):
    kit = Kit.read(kit_path(store))
    assert kit.engine == "int4-c" and kit.model is not None and kit.model.layers == 30
    names = [Path(f.path).name for f in kit.files]
    assert any(n.endswith("-int4.safetensors") for n in names) and any(n.endswith("-f32.safetensors") for n in names)
    copied = sorted(w.name for w in kit.weights if w.file < 0)
    assert copied == ["rope_cos", "rope_sin"]          # everything else is mapped, not copied
    assert kit_path(store).stat().st_size < 8 << 20
    assert {w.dtype for w in kit.weights} == {"F32", "U8", "I8"}


def test_an_int4_kit_is_refused_when_its_cache_file_changes(store):
    kit = Kit.read(kit_path(store))
    path = next(Path(f.path) for f in kit.files if f.path.endswith("-int4.safetensors"))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        with pytest.raises(CapsuleMismatch, match="changed since the kit was written"):
            LiteResume.open(store)
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    LiteResume.open(store).close()


@pytest.mark.parametrize("damage", ["torn", "flip_json", "shape", "dtype", "model"])
def test_a_damaged_int4_kit_is_refused(store, tmp_path, damage):
    from capsule.lite.kitfile import KitFile, pack
    kit = tmp_path / "x.kit"
    good = kit_path(store).read_bytes()
    if damage == "torn":
        kit.write_bytes(good[:len(good) // 2])
    elif damage == "flip_json":
        data = bytearray(good)
        data[40] ^= 0x20
        kit.write_bytes(bytes(data))
    else:                               # a well-formed kit that lies about a tensor or the model
        f = KitFile.open(kit_path(store))
        meta = json.loads(json.dumps(f.meta))
        blobs = {name: bytes(f.blob(name)) for name in meta.pop("blobs")}
        w = next(w for w in meta["weights"] if w["name"] == "0.qkv.nib")
        if damage == "shape":
            w["shape"][0] += 16
        elif damage == "dtype":
            w["dtype"] = "F32"
        else:
            meta["model"]["intermediate"] *= 2
        kit.write_bytes(b"".join(pack(meta, blobs)))
    with pytest.raises(CapsuleError) as exc:
        with LiteResume.open(store, kit=kit) as r:
            r.generate(4)
    assert isinstance(exc.value, (CapsuleCorrupt, CapsuleMismatch)), exc.value


def test_setups_the_c_step_does_not_cover_cannot_write_a_kit(tmp_path):
    with Session.open(tmp_path / "bf16", model="smollm2-135m", device="cpu",
                      runtime={**INT4, "kv_dtype": "bfloat16"}) as s:
        with pytest.raises(LiteUnsupported, match="fp32 K/V pool"):
            s.write_lite_kit()
    with Session.open(tmp_path / "torch-attn", model="smollm2-135m", device="cpu",
                      runtime={**INT4, "decode_attention": "torch"}) as s:
        with pytest.raises(LiteUnsupported, match="decode_attention"):
            s.write_lite_kit()
