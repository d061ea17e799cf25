"""Family chat templates for GGUF files without one (slipstream/chat_templates.py)."""
from __future__ import annotations

import gguf
import pytest
from support import skip_unless_default_model

from slipstream.chat_templates import FAMILIES, family_template
from slipstream.tokenizer import Tokenizer

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky colour?"}]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_is_recognised_by_its_tokens(family: str):
    markers, template = FAMILIES[family]
    assert family_template(["a", "b", *markers]) == (family, template)
    assert family_template(["a", "b", *markers[:-1]]) != (family, template)   # every marker is needed


def test_a_file_without_a_template_gets_its_family_one():
    """The default model's file, read without its template, renders ChatML as its own template does
    (given a system message, SmolLM2's template adds nothing of its own)."""
    skip_unless_default_model()
    from slipstream.weights import default_model_path
    reader = gguf.GGUFReader(str(default_model_path()))
    own = Tokenizer.from_gguf(reader)
    assert own.chat_template_source == "the file's tokenizer.chat_template"
    del reader.fields["tokenizer.chat_template"]
    bare = Tokenizer.from_gguf(reader)
    assert bare.chat_template_source == "built-in chatml template (the file has none)"
    for gen in (True, False):
        assert bare.apply_chat_template(MSGS, add_generation_prompt=gen) == \
            own.apply_chat_template(MSGS, add_generation_prompt=gen)


ENDINGS = {   # what each family's prompt ends with, ready for the assistant's answer
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nSky colour?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nSky colour?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|user|>\nSky colour?<|end|>\n<|assistant|>\n",
    "mistral": "[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Sky colour? [/INST]",
}


@pytest.mark.parametrize("family", list(ENDINGS))
def test_family_templates_render(family: str):
    skip_unless_default_model()
    from slipstream.weights import default_model_path
    tok = Tokenizer.from_gguf(str(default_model_path()))
    text = tok.apply_chat_template(MSGS, add_generation_prompt=True, chat_template=FAMILIES[family][1])
    assert text.endswith(ENDINGS[family]), text
    assert "Be brief." in text and "Hello." in text
