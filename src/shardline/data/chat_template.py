"""Chat templates rendered within bounds: the text `tokenizer.apply_chat_template` renders, in bounded time and memory.

A chat template comes with a model from outside and renders once per example, so `chat_text` renders it in-process
within bounds rather than through `apply_chat_template`: the template's size (`MAX_TEMPLATE_CHARS`); no constant
folding while it compiles (jinja's optimizer would build `'x' * 3000000000` before anything renders); and the
bounds of `shardline.data.chat_bounds` while it renders: the size of every value it builds and of all it writes,
checked before an operator, call or filter allocates, its steps and its time. The environment is transformers'
(`_compile_jinja_template`: the same sandbox, options, globals and filters), so the text is the same; a template that
passes a bound is a DataError naming the tokenizer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from shardline.data.chat_bounds import (
    BUDGET,
    RENDER_BASE_CHARS,
    RENDER_CHARS_PER_INPUT,
    RENDER_SECONDS,
    RENDER_STEPS,
    BoundExceeded,
    Budget,
    bounded_concat,
    bounded_iter,
    check_binop,
    check_call,
    current_budget,
    finalize,
    guarded_filter,
    length,
    strftime_now,
    text_size,
    tojson,
)
from shardline.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_TEMPLATE_CHARS = 131_072
"""A longer chat template is refused before it compiles (published ones measure 1-20 thousand characters)."""


def chat_text(tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False,
              tools: list[dict] | None = None) -> str:
    """`tok.apply_chat_template(messages, tokenize=False, ...)`'s text, rendered within `MAX_TEMPLATE_CHARS` and the
    bounds of `shardline.data.chat_bounds`; a DataError naming the tokenizer when the template passes one."""
    source = tok.get_chat_template()
    where = f"{tok.name_or_path or 'the tokenizer'}: its chat template"
    compiled = _compiled(source, where)
    data = _plain({**tok.special_tokens_map, "messages": messages, "tools": tools})
    budget = Budget(RENDER_BASE_CHARS + RENDER_CHARS_PER_INPUT * text_size(data, 1 << 62))
    token = BUDGET.set(budget)
    try:
        out, size = [], 0
        for chunk in compiled.generate(**data, documents=None, add_generation_prompt=add_generation_prompt):
            size += len(chunk)
            budget.fits(size, "a text")
            out.append(chunk)
        return "".join(out)
    except (BoundExceeded, RecursionError, MemoryError) as e:
        raise _bound_error(where, e, budget) from None
    finally:
        BUDGET.reset(token)


def chat_ids(tok: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False,
             tools: list[dict] | None = None) -> list[int]:
    """The ids of `chat_text` (as `apply_chat_template(..., tokenize=True)` encodes it: no special tokens added)."""
    return tok.encode(chat_text(tok, messages, add_generation_prompt, tools), add_special_tokens=False)


_FIX = ("use the model's published chat template (tokenizer_config.json or chat_template.jinja), or render "
        "without one: data.prompt_format=plain, or rows of prompt/completion or text")


def _bound_error(where: str, e: BaseException, budget: Budget) -> DataError:
    if isinstance(e, BoundExceeded):
        problem = str(e)
    elif isinstance(e, RecursionError):
        problem = "recursed deeper than Python allows while rendering"
    else:
        problem = "ran out of memory while rendering"
    return DataError(where, f"{problem} (bounds of one rendering: {budget.limit:,} characters, {RENDER_STEPS:,} "
                     f"steps, {RENDER_SECONDS:g} s)", _FIX)


# ---- the environment: transformers' (`_compile_jinja_template`), bounded ----
_ITER, _CONCAT = "shardline_bounded_iter", "shardline_bounded_concat"


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask block): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox with every growth checked: operators that can build large values are intercepted,
    calls and filters checked, loops and `~` rewritten to bounded forms, nothing constant-folded at compile time
    (optimizer off; a finalize that needs the context leaves every output to the rendering)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        budget = current_budget()
        budget.step()
        check_binop(operator, left, right, budget)
        out = self.binop_table[operator](left, right)
        budget.fits(length(out), "a value")
        return out

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's signature)
        budget = current_budget()
        budget.step()
        check_call(__obj, args, kwargs, budget)
        out = super().call(__context, __obj, *args, **kwargs)
        budget.fits(length(out), "a call's result")
        return out

    def _parse(self, source, name, filename):
        return _Bounding(self).visit(super()._parse(source, name, filename))


class _Bounding(NodeTransformer):
    """Loops iterate through `bounded_iter` (charged their body's text per iteration); `~` becomes
    `bounded_concat`."""

    def __init__(self, environment: jinja2.Environment) -> None:
        self.environment = environment

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        text = sum(len(t.data) for t in node.find_all(nodes.TemplateData))
        node.iter = nodes.Filter(node.iter, _ITER, [nodes.Const(text)], [], None, None, lineno=node.lineno)
        node.iter.set_environment(self.environment)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        out = nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, [], [], None, None,
                           lineno=node.lineno)
        return out.set_environment(self.environment)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself (as transformers offers it)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """A namespace that refuses underscore-prefixed attributes (as transformers' does)."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's Namespace signature)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")


@lru_cache(maxsize=16)
def _compiled(source: str, where: str) -> jinja2.Template:
    """The template compiled in the bounded environment (once per template), or a DataError."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise DataError(where, f"has {len(source):,} characters, more than {MAX_TEMPLATE_CHARS:,}", _FIX)
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols],
                              optimized=False, finalize=finalize)
    env.globals.pop("lipsum", None)  # paragraphs by the count: nothing a chat template needs
    env.filters["tojson"] = tojson
    env.filters = {name: guarded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_ITER], env.filters[_CONCAT] = bounded_iter, bounded_concat
    env.globals.update(raise_exception=_raise_exception, strftime_now=strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    try:
        return env.from_string(source)
    except (RecursionError, MemoryError) as e:
        raise DataError(where, f"cannot be compiled ({type(e).__name__})", _FIX) from None


def _plain(value: object) -> object:
    """What the template sees, rebuilt from plain JSON types (as transformers' `_plain_template_data` does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    for kind in (str, int, float):  # a subclass (an enum, say) carries methods: back to the base type
        if isinstance(value, kind):
            return getattr(kind, f"__{kind.__name__}__")(value)
    return f"<{type(value).__name__}>"
