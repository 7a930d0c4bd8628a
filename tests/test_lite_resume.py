"""capsule.lite: a process that never imports torch continues a store's newest capsule with the
very greedy ids the Session generates after restoring it; every way it cannot is refused with a
CapsuleError that says what to do (no kit, another setup, a changed weights file, a torn or
flipped kit, text not yet prefilled, a memory region, an unknown stream)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from capsule import Session
from capsule.errors import (CapsuleCorrupt, CapsuleError, CapsuleMismatch, LiteUnsupported,
                            UnknownStream)
from capsule.lite import LiteResume
from capsule.lite.kit import Kit, kit_path
from lite_kits import check_a_changed_weights_file_is_refused

pytestmark = pytest.mark.slow
ORT = {"threads": 1, "llm_engines": ["onnxruntime"]}
PROMPT = "Robot log: picked up the red cup, moving to the sink. The next three steps are"
NEW = 40       # crosses two 16-token blocks: the lite restore allocates blocks as the Session does


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store whose newest capsule was taken mid-reply (SmolLM2, trained: ids vary), its kit."""
    path = tmp_path_factory.mktemp("lite") / "s"
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        s.append(PROMPT)
        s.generate(5)
        s.checkpoint()
        assert s.write_lite_kit() == kit_path(path)
    return path


def _session_ids(path: Path, n: int, stream: str = "main") -> list[int]:
    with Session.open(path, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        n0 = len(s.tokens(stream))
        s.generate(n, stream=stream)
        return s.tokens(stream)[n0:]


def test_fresh_process_without_torch_generates_the_sessions_ids(store):
    child = ("import json, sys\nsys.modules['torch'] = None   # any import of torch fails\n"
             "from capsule.lite import LiteResume\n"
             f"with LiteResume.open({str(store)!r}) as r:\n"
             f"    print(json.dumps({{'epoch': r.epoch, 'ids': r.generate({NEW}), 'n': len(r.tokens)}}))\n"
             "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m])\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    ref = _session_ids(store, NEW)
    assert got["ids"] == ref
    assert len(set(ref)) > 10          # a real continuation, not one id repeated
    assert got["epoch"] == 1


def test_calls_split_like_the_sessions_give_the_same_ids(store):
    with LiteResume.open(store) as r:
        first = r.generate(1)
        rest = r.generate(NEW - 1)
    with Session.open(store, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        n0 = len(s.tokens())
        s.generate(1)
        s.generate(NEW - 1)
        assert s.tokens()[n0:] == first + rest


def test_reply_is_the_text_the_sessions_generate_returns(store):
    with LiteResume.open(store) as r:
        texts = [r.reply(7), r.reply(NEW - 7)]
    with Session.open(store, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        assert [s.generate(7), s.generate(NEW - 7)] == texts
    assert len(texts[1]) > 20


def test_reads_nothing_back_into_the_store(store):
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if p.is_file()}
    with LiteResume.open(store) as r:
        r.generate(3)
    with Session.open(store, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        assert s.restored_epoch == 1
    assert {p for p in before} <= {p for p in store.rglob("*") if p.is_file()}


def test_refusals_name_what_to_do(store, tmp_path):
    with pytest.raises(LiteUnsupported, match="write_lite_kit"):
        LiteResume.open(store, kit=tmp_path / "none.kit")
    with pytest.raises(UnknownStream, match="no stream 'other'"):
        LiteResume.open(store, stream="other")
    # text appended after the last generate: its tokens need a prefill
    pending = tmp_path / "pending"
    with Session.open(pending, model="smollm2-135m", device="cpu", runtime=ORT) as s:
        s.append(PROMPT)
        s.checkpoint()
        s.write_lite_kit()
    with pytest.raises(LiteUnsupported, match="not in the K/V cache yet"):
        LiteResume.open(pending)
    # a Session on the torch engine decoding through the layer loop cannot write one
    with Session.open(tmp_path / "torch", model="builtin:tiny", device="cpu", runtime={"decode_step": "layers"}) as s:
        with pytest.raises(LiteUnsupported, match="one-call C decode step or the onnxruntime"):
            s.write_lite_kit()


def test_another_setups_capsule_is_refused(store, tmp_path):
    other = tmp_path / "other"
    with Session.open(other, model="smollm2-135m", device="cpu", runtime={**ORT, "kv_pool_mb": 96}) as s:
        s.append(PROMPT)
        s.generate(2)
        s.checkpoint()
    with pytest.raises(CapsuleMismatch, match="restore kit"):
        LiteResume.open(other, kit=kit_path(store))


def test_changed_weights_file_is_refused(store, tmp_path):
    kit = Kit.read(kit_path(store))
    assert kit.files, "the kit maps SmolLM2's weights from the dequantized cache, not a copy"
    check_a_changed_weights_file_is_refused(store, tmp_path, Path(kit.files[0].path).name)


@pytest.mark.parametrize("damage", ["torn", "flip_json", "flip_graph", "symlink", "empty"])
def test_damaged_kit_is_refused(store, tmp_path, damage):
    good = kit_path(store).read_bytes()
    kit = tmp_path / "x.kit"
    data = bytearray(good)
    if damage == "torn":
        data = data[:len(data) // 2]
    elif damage == "flip_json":
        data[40] ^= 0x20
    elif damage == "flip_graph":
        meta = Kit.read(kit_path(store)).file
        start = meta.meta["blobs"]["head/1"][0]    # used by every step
        n = int.from_bytes(good[8:16], "little")
        data[16 + n + start + 100] ^= 0x01
    elif damage == "empty":
        data = bytearray()
    if damage == "symlink":
        kit.symlink_to(kit_path(store))
    else:
        kit.write_bytes(bytes(data))
    with pytest.raises(CapsuleError) as exc:
        with LiteResume.open(store, kit=kit) as r:
            r.generate(NEW)          # a graph blob is checked when its session is built
    if damage != "symlink":
        assert isinstance(exc.value, CapsuleCorrupt), exc.value


def test_open_starts_building_the_sessions_the_first_token_runs(store, monkeypatch):
    from capsule.lite.steps import Sessions
    started, got = [], []
    start, get = Sessions.start, Sessions.get
    monkeypatch.setattr(Sessions, "start", lambda self, name: (started.append(name), start(self, name))[1])
    monkeypatch.setattr(Sessions, "get", lambda self, name: (got.append(name), get(self, name))[1])
    with LiteResume.open(store) as r:
        assert got == []                        # nothing built on the main thread yet
        ids = r.generate(1)
    assert ids == _session_ids(store, 1)
    assert got[:2] == started                  # the step of the right width, then the head
    assert started[0].startswith("step/1/") and started[1] == "head/1"
