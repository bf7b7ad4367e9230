"""A tiny Qwen3 checkpoint whose greedy answer is scripted: it thinks, then answers.

No real Qwen3 is available offline and a random one never writes `<think>`, so this one is built to:
its weights make greedy decoding follow a fixed table, `SCRIPT`, from each token to the next:

    "\\n" (the end of "<|im_start|>assistant\\n") -> <think> -> "I" -> " think" -> </think> -> "\\n\\n"
    -> "Answer" -> <|im_end|> (the end of the turn)

so a thinking turn is `<think>I think</think>\\n\\nAnswer` (reasoning "I think", content "Answer"), and
with `enable_thinking: false` the template's prompt tail `<think>\\n\\n</think>\\n\\n` ends on "\\n\\n"
and the answer is just "Answer".

How: the residual stream stays (almost) the current token's embedding. The attention and MLP output
projections (o_proj, down_proj) are small, so attention, RoPE and q_norm/k_norm still move the
logits a little (a fleet that gets them wrong shows in the logprobs) but never the greedy choice;
the final norm makes that embedding a vector of norm sqrt(hidden); the embeddings are random, so
nearly orthogonal; and the LM head row of each scripted successor is the direction of its
predecessor's embedding: that logit is GAIN * sqrt(hidden) (about 23), the others about GAIN * N(0, 1).

It is a real HF-format directory that transformers loads: config.json (model_type "qwen3", saved
by transformers' own Qwen3ForCausalLM), model.safetensors, generation_config.json, tokenizer.json
(byte-level BPE with Qwen2's split regex; a few words merged whole so that every scripted token is
one token) and tokenizer_config.json carrying Qwen3's chat template (`QWEN3_CHAT_TEMPLATE`, as in
Qwen/Qwen3-8B, with its enable_thinking switch). As in Qwen3, `<|im_start|>`, `<|im_end|>` and
`<|endoftext|>` are special added tokens, `<think>` and `</think>` added tokens that are not special
(so a decoder that skips special tokens keeps them), and the model's vocabulary is padded past the
tokenizer's.

`thinking_2507=True` makes a Thinking-2507 model instead: its template opens `<think>` in the prompt
(QWEN3_THINKING_TEMPLATE) and the answer is `I think</think>\\n\\nAnswer` (THINKING_SCRIPT).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json): earlier turns' thinking is dropped,
# and `enable_thinking=false` closes an empty think block after the generation prompt.
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and '
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    "                {{- tool_call.name }}\n"
    '                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)
# The Thinking-2507 models' template (Qwen/Qwen3-4B-Thinking-2507): the same, but the generation
# prompt opens the think block itself (no enable_thinking switch), so the answer is the thinking,
# "</think>", then the reply, with no "<think>" of its own.
QWEN3_THINKING_TEMPLATE = (
    QWEN3_CHAT_TEMPLATE[: QWEN3_CHAT_TEMPLATE.index("{%- if add_generation_prompt %}")]
    + "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}\n"
)

ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
# Words merged whole (byte-level spelling: "Ġ" a leading space, "Ċ" a newline); everything else is
# spelled byte by byte, so prompts are long in tokens (they fill KV blocks quickly).
WORDS = ("user", "assistant", "system", "Answer", "Ġthink", "ĊĊ")
# The scripted successor of each token, by its text (tokenizer.json's spelling for BPE tokens).
SCRIPT: tuple[tuple[str, str], ...] = (
    ("Ċ", THINK),
    (THINK, "I"),
    ("I", "Ġthink"),
    ("Ġthink", END_THINK),
    (END_THINK, "ĊĊ"),
    ("ĊĊ", "Answer"),
    ("Answer", IM_END),
)
# Under QWEN3_THINKING_TEMPLATE the prompt ends on "<think>" "\n": the thinking starts at once.
THINKING_SCRIPT = (("Ċ", "I"), *SCRIPT[1:])
REASONING, CONTENT = "I think", "Answer"  # what a thinking turn splits into
VOCAB_MULTIPLE = 64  # the model's vocabulary is padded to this (Qwen pads 151,669 tokens to 151,936)
HIDDEN = 128
GAIN = 2.0  # the scripted successor's logit is GAIN * sqrt(HIDDEN)
OUT_STD = 0.05  # o_proj / down_proj: what attention and the MLP add to the residual stream


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_json() -> str:
    """tokenizer.json text: byte-level BPE (the 256 bytes, then WORDS merged left to right), Qwen2's
    normalizer and split regex, then the added tokens (ids after the BPE vocabulary)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from fastdecode.tools.checkpoint import _QWEN2_SPLIT_REGEX

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        left = word[0]
        for ch in word[1:]:
            if left + ch not in vocab:
                vocab[left + ch] = len(vocab)
                merges.append((left, ch))
            left += ch
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (ENDOFTEXT, IM_START, IM_END)]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    return tok.to_str(pretty=True)


def _tokenizer_config(tok_json: str, max_len: int, template: str) -> dict:
    added = {
        str(t["id"]): {
            k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        }
        for t in json.loads(tok_json)["added_tokens"]
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def token_ids(tok_json: str) -> dict[str, int]:
    """Every token's id by its tokenizer.json spelling (BPE vocabulary and added tokens)."""
    spec = json.loads(tok_json)
    ids = dict(spec["model"]["vocab"])
    ids.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    return ids


def save_qwen3_scripted(out: Path, seed: int = 7, thinking_2507: bool = False) -> Path:
    """Write the scripted checkpoint into `out` (made if missing); return it. thinking_2507: a
    Thinking-2507 model instead (QWEN3_THINKING_TEMPLATE, THINKING_SCRIPT)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok_json = tokenizer_json()
    ids = token_ids(tok_json)
    n_tokens = max(ids.values()) + 1
    vocab = -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    max_len = 512
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                p.fill_(1.0)
            elif "norm" in name:  # input/post-attention norms and q_norm/k_norm: 1 + noise
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * (OUT_STD / math.sqrt(p.shape[-1])))
            elif name != "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for before, after in THINKING_SCRIPT if thinking_2507 else SCRIPT:
            e = embed[ids[before]]
            head[ids[after]] += GAIN * e / e.norm()
    template = QWEN3_THINKING_TEMPLATE if thinking_2507 else QWEN3_CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT]
    )
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(tok_json, max_len, template), indent=2) + "\n", encoding="utf-8"
    )
    return out


def scripted_ids(path: Path) -> dict[str, int]:
    """The saved checkpoint's token ids by spelling."""
    return token_ids((path / "tokenizer.json").read_text(encoding="utf-8"))
