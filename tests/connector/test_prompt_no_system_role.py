"""Chat templates without a system role (Gemma): Gemma 2's raises on one, so the system text is
folded into the first user turn, which is what Gemma 3's template does itself."""

from __future__ import annotations

import pytest
from helpers import make_tokenizer
from jinja2.exceptions import TemplateError

from blendkv.connector.prompt import PromptBuilder, apply_template

GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
# Gemma 3's way: the system text prefixes the first user turn.
GEMMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def _tokenizer(template: str):
    tok = make_tokenizer(320)
    tok.chat_template = template
    return tok


def test_gemma2_folds_the_system_prompt_as_gemma3_does():
    g2, g3 = _tokenizer(GEMMA2), _tokenizer(GEMMA3)
    with pytest.raises(TemplateError, match="System role"):  # the template alone refuses
        g2.apply_chat_template(
            [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], tokenize=False
        )
    for system in (None, "Answer briefly."):
        ours, theirs = PromptBuilder(g2), PromptBuilder(g3)
        assert ours.template_pieces(system) == theirs.template_pieces(system)
        prompt = ours.build([ours.encode("Paris is in France.")], "Where is Paris?", system)
        assert prompt.token_ids[: prompt.prefix_len] == ours.anchor(system)
    prefix, suffix = PromptBuilder(g2).template_pieces("Answer briefly.")
    assert g2.decode(prefix).endswith("<start_of_turn>user\nAnswer briefly.\n\n")
    assert g2.decode(suffix) == "<end_of_turn>\n<start_of_turn>model\n"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    assert apply_template(g2, messages, **kwargs) == g3.apply_chat_template(messages, **kwargs)


def test_other_template_errors_are_not_hidden():
    tok = _tokenizer("{{ raise_exception('no chat here') }}")
    with pytest.raises(TemplateError, match="no chat here"):
        PromptBuilder(tok).template_pieces(None)
