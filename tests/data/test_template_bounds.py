"""A chat template comes with a model from outside: rendering it is bounded in time and memory. Each hostile template
below is a DataError naming the tokenizer within seconds, where transformers' own rendering allocates gigabytes (a
string constant-folded while the template compiles, or built while it renders) or runs for hours."""

import time

import pytest

from shardline.data import chat_bounds, chat_template
from shardline.data.chat_template import chat_ids, chat_text
from shardline.data.template import encode_prompt
from shardline.errors import DataError
from shardline.tasks import get_task

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

HOSTILE = {
    # 3 GB folded into a constant by jinja's optimizer when the template compiles, before anything renders
    "constant-folded multiplication": "{{ 'x' * 3000000000 }}",
    "constant-folded power": "{{ 'x' * 10 ** 9 }}",
    "constant-folded filter": "{{ 'x' | center(3000000000) }}",
    "a method's width": "{{ 'x'.ljust(3000000000) }}",
    "doubling in a loop": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}{{ ns.s | length }}",
    "doubling by concatenation": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                                 "{% endfor %}{{ ns.s | length }}",
    "a list repeated then joined": "{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | join }}",
    "a replace that multiplies": "{{ ('x' * 100000) | replace('x', 'y' * 100000) }}",
    "a printf width": "{{ '%0999999999d' % 1 }}",
    "a format width": "{{ '{:>999999999}'.format(1) }}",
    "a huge integer": "{{ 7 ** (7 ** (7 ** 2)) }}",
    "endless nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "exponential recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                             "{{ f(60) }}",
    "long output": "{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}",
    "static text in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}" + "z" * 100 + "{% endfor %}"
                             "{% endfor %}",
    "indented json": "{{ messages | tojson(indent=1000000) }}",
}


@pytest.fixture()
def tok(prepared):
    return prepared.tokenizer()


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_chat_template_is_a_named_error_within_seconds(tok, name):
    tok.chat_template = HOSTILE[name]
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        chat_text(tok, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 10 + chat_bounds.RENDER_SECONDS
    assert "chat template" in err.value.where and "prompt_format=plain" in err.value.fix


def test_the_prompt_of_a_chat_example_is_rendered_within_the_bound(tok):
    """`data.prompt_format: chat` renders every example's prompt with the template: that is where prepare meets it."""
    tok.chat_template = HOSTILE["constant-folded multiplication"]
    with pytest.raises(DataError, match="chat template"):
        encode_prompt(tok, get_task("text_to_sql").prompt, "how many?", "CREATE TABLE t (a INT)", "chat")


def test_a_template_over_the_size_bound_is_refused_before_it_compiles(tok):
    tok.chat_template = "{# " + "x" * chat_template.MAX_TEMPLATE_CHARS + " #}" + CHATML
    with pytest.raises(DataError) as err:
        chat_text(tok, [{"role": "user", "content": "hi"}])
    assert f"{chat_template.MAX_TEMPLATE_CHARS:,}" in err.value.problem


def test_the_output_bound_grows_with_the_conversation(tok):
    tok.chat_template = CHATML
    long = "word " * (chat_bounds.RENDER_BASE_CHARS // 4)  # more than the base bound alone allows
    assert chat_text(tok, [{"role": "user", "content": long}]).count("word") == long.count("word")


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_bounded_rendering_equals_transformers(tok, generation_prompt):
    """The same text and ids as `apply_chat_template` for templates that use tools, macros, tojson, namespaces,
    loop controls, `{% generation %}` and the special tokens."""
    messages = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "q1 {{ not jinja }}"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2 ' \" <|im_end|>"}]
    templates = [CHATML,
                 "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
                 "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}[{{ ns.n }}|{{ m.role | upper }}]"
                 "{{ m.content | trim }}{% endgeneration %}{{ eos_token if m.role == 'assistant' }}{% endfor %}"
                 "{{ messages | tojson }}{{ messages[0] | tojson(indent=2) }}{{ '%s-%d' % ('a', 3) }}"
                 "{{ '{}:{:>4}'.format('b', 7) }}{{ messages | map(attribute='role') | join(', ') }}"
                 "{{ (messages | length) * 2 }}{{ 2 ** 10 }}{{ 'ab' * 3 }}{{ [1, 2] + [3] }}{{ 'x' ~ 1 ~ none }}"
                 "{% macro m(x) %}<{{ x | replace('q', 'Q') | center(9) }}>{% endmacro %}{{ m('q') }}"
                 "{{ dict(a=1) | tojson }}{{ messages | selectattr('role', 'equalto', 'user') | list | length }}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}"]
    for text in templates:
        tok.chat_template = text
        theirs = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert chat_text(tok, messages, add_generation_prompt=generation_prompt) == theirs
        assert chat_ids(tok, messages, add_generation_prompt=generation_prompt) == list(
            tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                    return_dict=False))


def test_template_errors_still_reach_the_caller(tok):
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(Exception, match="roles must alternate"):
        chat_text(tok, [{"role": "user", "content": "hi"}])


def test_a_rendering_that_runs_past_its_time_is_stopped(tok, monkeypatch):
    """Few steps, each slow (a scan of a long string): the wall-clock bound stops it, not the step bound."""
    monkeypatch.setattr(chat_bounds, "RENDER_SECONDS", 0.5)
    tok.chat_template = ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% if s.count('y') %}{% endif %}"
                         "{% endfor %}")
    start = time.monotonic()
    with pytest.raises(DataError, match="rendered for more than 0.5 s"):
        chat_text(tok, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 5
