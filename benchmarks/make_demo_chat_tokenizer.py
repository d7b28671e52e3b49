"""Make mmtok/data/demo/chat-tokenizer/, the text tokenizer of `mmtok demo`'s SFT flow.

    .venv/bin/python benchmarks/make_demo_chat_tokenizer.py [--out DIR]

A byte-level BPE (the `tokenizers` library) trained on the demo's own texts -- the bundled captions and
transcripts, and the demo's conversations (`mmtok.commands.demo_flow.demo_conversations`) as the template below renders
them -- with the Apertus chat special tokens added after the learned vocabulary (so their ids differ from
the real Apertus build's, and nothing may hard-code them). tokenizer_config.json holds a chat template in
the Apertus 1.5 layout, written for this demo:

  BOS
  <|system_start|> system text <|system_end|>          (a default text when there is no system message)
  <|developer_start|>Deliberation: enabled|disabled
  Tool Capabilities: disabled | one json line per tool <|developer_end|>
  <|user_start|> text, or {"parts": [...]} <|user_end|>
  <|assistant_start|> a string, or {"blocks": [...]}: thoughts inside <|inner_prefix|>..<|inner_suffix|>
      (a response closes the span), tool calls as [{"name": arguments}] in <|tools_prefix|>..<|tools_suffix|>,
      tool outputs in <|tool_output_start|>..<|tool_output_end|>; OpenAI `reasoning_content`,
      `tool_calls` and `tool` messages map onto the same tokens
  <|assistant_end|>                                   (not while a tool call awaits its output)
  <|assistant_start|>                                 with add_generation_prompt (as the release's template)

The same inputs give the same files byte for byte; rerun after changing the demo's conversations (the demo
test checks that the bundled files are what this script makes).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from mmtok.commands.demo_flow import CHAT_TOKENIZER, bundled_table, demo_conversations
from mmtok.formats.chat import ChatRenderer, split_media

VOCAB_SIZE = 1000  # the BPE's target size (base tokens included); it stops earlier when no pair is left to merge
BASE_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TOKENS = [
    "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>",
    "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>", "<|tools_suffix|>",
    "<|tool_output_start|>", "<|tool_output_end|>",
]
DEFAULT_SYSTEM = "You are a helpful assistant that sees images and hears speech."

# Whitespace control (`{%-`, `-%}`, `{{-`) everywhere: the layout below is for people, not the rendering.
CHAT_TEMPLATE = r"""
{#- The demo's chat template: the Apertus 1.5 token layout (see benchmarks/make_demo_chat_tokenizer.py). -#}
{%- macro render_calls(calls) -%}
  {{- '<|tools_prefix|>[' -}}
  {%- for call in calls -%}
    {%- set fn = call.function if call.function is defined else call -%}
    {%- set arguments = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
    {{- '{"' ~ fn.name ~ '": ' ~ arguments ~ '}' -}}
    {%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
  {%- endfor -%}
  {{- ']<|tools_suffix|>' -}}
{%- endmacro -%}
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}
  {%- if system is mapping -%}{%- set system = system.text -%}{%- endif -%}
  {%- if system is not string -%}{{- raise_exception('system content must be a string or {"text": ...}') -}}{%- endif -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system = '""" + DEFAULT_SYSTEM + r"""' -%}
  {%- set turns = messages -%}
{%- endif -%}
{{- '<|system_start|>' ~ system ~ '<|system_end|>' -}}
{{- '<|developer_start|>Deliberation: ' ~ ('enabled' if enable_thinking else 'disabled') ~ '\n' -}}
{%- if tools -%}
  {{- 'Tool Capabilities:' -}}
  {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
{%- else -%}
  {{- 'Tool Capabilities: disabled' -}}
{%- endif -%}
{{- '<|developer_end|>' -}}
{%- set state = namespace(assistant=false, thinking=false, output=false, awaiting=false) -%}
{%- for message in turns -%}
  {%- if message.role == 'user' -%}
    {%- if state.output -%}{{- '<|tool_output_end|>' -}}{%- set state.output = false -%}{%- endif -%}
    {%- if state.thinking -%}{{- '<|inner_suffix|>' -}}{%- set state.thinking = false -%}{%- endif -%}
    {%- if state.assistant -%}{{- '<|assistant_end|>' -}}{%- set state.assistant = false -%}{%- endif -%}
    {{- '<|user_start|>' -}}
    {%- if message.content is string -%}
      {{- message.content -}}
    {%- elif message.content is mapping and message.content.parts is defined -%}
      {%- for part in message.content.parts -%}
        {%- if part.type == 'text' -%}{{- part.text -}}
        {%- elif part.type in ('image', 'image_url', 'input_image') -%}{{- '<|image|>' -}}
        {%- elif part.type in ('audio', 'audio_url', 'input_audio') -%}{{- '<|audio|>' -}}
        {%- else -%}{{- raise_exception('unknown user part type ' ~ part.type) -}}{%- endif -%}
      {%- endfor -%}
    {%- else -%}
      {{- raise_exception('user content must be a string or {"parts": [...]}') -}}
    {%- endif -%}
    {{- '<|user_end|>' -}}
  {%- elif message.role == 'assistant' -%}
    {%- if not state.assistant -%}{{- '<|assistant_start|>' -}}{%- set state.assistant = true -%}{%- endif -%}
    {%- if state.output -%}{{- '<|tool_output_end|>' -}}{%- set state.output = false -%}{%- endif -%}
    {%- if message.reasoning_content -%}
      {%- if not state.thinking -%}{{- '<|inner_prefix|>' -}}{%- endif -%}
      {{- message.reasoning_content ~ '<|inner_suffix|>' -}}{%- set state.thinking = false -%}
    {%- endif -%}
    {%- if message.content is mapping and message.content.blocks is defined -%}
      {%- for block in message.content.blocks -%}
        {%- if block.type == 'thoughts' -%}
          {%- if not state.thinking -%}{{- '<|inner_prefix|>' -}}{%- set state.thinking = true -%}{%- endif -%}
          {{- block.text -}}
        {%- elif block.type == 'response' -%}
          {%- if state.thinking -%}{{- '<|inner_suffix|>' -}}{%- set state.thinking = false -%}{%- endif -%}
          {{- block.text -}}
        {%- elif block.type == 'tool_calls' -%}
          {{- render_calls(block.calls) -}}{%- set state.awaiting = true -%}
        {%- elif block.type == 'tool_outputs' -%}
          {{- '<|tool_output_start|>' -}}
          {%- for output in block.outputs -%}
            {{- output.output -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
          {%- endfor -%}
          {{- '<|tool_output_end|>' -}}{%- set state.awaiting = false -%}
        {%- else -%}
          {{- raise_exception('unknown assistant block type ' ~ block.type) -}}
        {%- endif -%}
      {%- endfor -%}
    {%- elif message.content is string -%}
      {{- message.content -}}
    {%- elif message.content -%}
      {{- raise_exception('assistant content must be a string or {"blocks": [...]}') -}}
    {%- endif -%}
    {%- if message.tool_calls -%}{{- render_calls(message.tool_calls) -}}{%- set state.awaiting = true -%}{%- endif -%}
  {%- elif message.role == 'tool' -%}
    {%- if not state.assistant -%}{{- raise_exception('a tool message outside an assistant turn') -}}{%- endif -%}
    {{- ', ' if state.output else '<|tool_output_start|>' -}}
    {{- message.content -}}
    {%- set state.output = true -%}{%- set state.awaiting = false -%}
  {%- else -%}
    {{- raise_exception('unknown role ' ~ message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if state.output -%}{{- '<|tool_output_end|>' -}}{%- endif -%}
{%- if state.thinking -%}{{- '<|inner_suffix|>' -}}{%- endif -%}
{%- if state.assistant and not state.awaiting -%}{{- '<|assistant_end|>' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}
"""  # noqa: E501 (one template line is 121 columns: splitting it would change the stored chat template's bytes)


def training_texts() -> list[str]:
    """What the BPE learns from, in a fixed order: the captions, the transcripts and the text of the demo's
    conversations as this template renders them, cut at the special tokens and media placeholders."""
    renderer = ChatRenderer(CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")
    texts = [*bundled_table("captions.jsonl", "file", "caption").values(),
             *bundled_table("audio/transcripts.jsonl", "path", "text").values()]
    for _key, record, _media in demo_conversations():
        texts += [piece for piece in split_media(renderer.render(record)) if isinstance(piece, str)]
    texts.append("0 1 2 3 4 5 6 7 8 9 16*16 13*19 8*8")  # image blocks spell their shape in digits
    special = re.compile("|".join(re.escape(token) for token in BASE_TOKENS + CHAT_TOKENS))
    return [text for whole in texts for text in special.split(whole) if text]


def make_chat_tokenizer(out: Path) -> Path:
    """Train and save tokenizer.json + tokenizer_config.json into `out`; returns `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=BASE_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_texts(), trainer)
    tokenizer.add_special_tokens(CHAT_TOKENS)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE.strip()}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=CHAT_TOKENIZER, help=f"output directory (default {CHAT_TOKENIZER})")
    out = make_chat_tokenizer(parser.parse_args().out)
    vocab = json.loads((out / "tokenizer.json").read_text("utf-8"))
    print(f"{out}: {len(vocab['model']['vocab']) + len(CHAT_TOKENS)} tokens "
          f"({len(vocab['model']['merges'])} merges, {len(CHAT_TOKENS)} chat tokens)")


if __name__ == "__main__":
    main()
