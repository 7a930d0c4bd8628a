"""capsule.lite over a model decoding in the one-call C step (a kit of engine "int4-c": all int4,
the Q8_0 head; "f32-c": dense fp32 under runtime.decode_step "fused", the fp32 head in C): a
process that never imports torch continues the store's newest capsule through the package's C
decode step and head with the very greedy ids the Session generates after restoring it; the kit
maps the weights from the Session's own cache files; a tampered kit, a changed weights file or a
setup the step does not cover is refused with a CapsuleError that says what to do."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from capsule import Session
from capsule.errors import CapsuleCorrupt, CapsuleError, CapsuleMismatch, LiteUnsupported
from capsule.lite import LiteResume
from capsule.lite.kit import Kit, kit_path
from lite_kits import check_a_changed_weights_file_is_refused
from capsule.llm.int4_linear import kernel_missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(kernel_missing() is not None, reason=str(kernel_missing()))]
INT4 = {"threads": 1, "linears": "int4"}
RUNTIMES = {"int4-c": INT4, "f32-c": {"threads": 1}}     # by the kit's engine
PROMPT = "Robot log: picked up the red cup, moving to the sink. The next three steps are"
NEW = 40       # crosses two 16-token blocks: the lite restore allocates blocks as the Session does


@pytest.fixture(scope="module", params=sorted(RUNTIMES))
def store(tmp_path_factory, request) -> Path:
    """A store whose newest capsule was taken mid-reply by SmolLM2 (trained: ids vary) decoding in
    the C step, int4 or fp32 (request.param: the kit's engine), its kit."""
    path = tmp_path_factory.mktemp(request.param) / "s"
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=RUNTIMES[request.param]) as s:
        assert s.engine.runner.model.decode_step == "fused"
        s.append(PROMPT)
        s.generate(5)
        s.checkpoint()
        assert s.write_lite_kit() == kit_path(path)
    return path


def _engine(store: Path) -> str:
    return Kit.read(kit_path(store)).engine


def _session_ids(path: Path, n: int) -> list[int]:
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=RUNTIMES[_engine(path)]) as s:
        n0 = len(s.tokens())
        s.generate(n)
        return s.tokens()[n0:]


def test_fresh_process_without_torch_generates_the_sessions_ids(store):
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
    assert kit.engine in ("int4-c", "f32-c") and kit.model is not None and kit.model.layers == 30
    names = [Path(f.path).name for f in kit.files]
    assert any(n.endswith("-f32.safetensors") for n in names)
    assert any(n.endswith("-int4.safetensors") for n in names) == (kit.engine == "int4-c")
    copied = sorted(w.name for w in kit.weights if w.file < 0)
    assert copied == ["rope_cos", "rope_sin"]          # everything else is mapped, not copied
    assert kit_path(store).stat().st_size < 8 << 20
    assert {w.dtype for w in kit.weights} == ({"F32", "U8", "I8"} if kit.engine == "int4-c" else {"F32"})
    if kit.engine == "f32-c":                           # q|k|v, gate|up: the checkpoint's own tensors
        assert {"0.q", "0.k", "0.v", "0.o", "0.gate", "0.up", "0.down", "head.weight"} <= {w.name for w in kit.weights}


def test_a_kit_is_refused_when_its_weights_file_changes(store, tmp_path):
    suffix = "-int4.safetensors" if _engine(store) == "int4-c" else "-f32.safetensors"
    check_a_changed_weights_file_is_refused(store, tmp_path, suffix)


@pytest.mark.parametrize("damage", ["torn", "flip_json", "shape", "dtype", "model"])
def test_a_damaged_kit_is_refused(store, tmp_path, damage):
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
        w = next(w for w in meta["weights"] if w["name"] in ("0.qkv.nib", "0.q"))
        if damage == "shape":
            w["shape"][0] += 16
        elif damage == "dtype":
            w["dtype"] = "U8" if w["dtype"] == "F32" else "F32"
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
    for rt in ({"decode_step": "layers"}, {"decode_attention": "torch"}):     # fp32 through the layer loop
        with Session.open(tmp_path / "loop", model="smollm2-135m", device="cpu", runtime={"threads": 1, **rt},
                          restore=False) as s:
            with pytest.raises(LiteUnsupported, match="one-call C decode step"):
                s.write_lite_kit()
