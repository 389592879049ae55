"""What one rendering of a chat template may spend (`shardline.data.chat_template`), and the size of what an operator,
call or filter would build, estimated before it runs: a template comes with a model from outside, and a value of
gigabytes is one `'x' * 3000000000` or `s.ljust(3000000000)` away.

The limit of one rendering is `RENDER_BASE_CHARS` + `RENDER_CHARS_PER_INPUT` × its messages' and special tokens'
characters: no value it builds may be longer (characters of a string, items of a list), and all it writes together
(every `{{ ... }}` evaluated, a loop body's text per iteration) stays within it. Loop iterations, calls, filters and
operators are steps, `RENDER_STEPS` at most; `RENDER_SECONDS` bounds the time, checked between steps.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime

from jinja2.utils import Namespace, pass_context

RENDER_BASE_CHARS = 1 << 20
RENDER_CHARS_PER_INPUT = 8
"""One rendering's bound on characters: no value it builds and not all it writes together may pass
RENDER_BASE_CHARS + RENDER_CHARS_PER_INPUT × the characters of its messages and special tokens."""
RENDER_STEPS = 250_000
"""Loop iterations, calls, filters and operators of one rendering (101 messages take ~710 with ChatML's, Llama 3.1's
or Hermes' template)."""
RENDER_SECONDS = 10.0
"""Wall-clock bound of one rendering, checked every 64 steps (101 messages render in ~1-2 ms on a loaded CPU)."""
MAX_INT_BITS = 4096
"""An integer the template computes may not pass this many bits (`7 ** (7 ** 49)` computes for hours)."""


class BoundExceeded(Exception):
    """A rendering passed a bound (raised inside the template; `chat_template.chat_text` makes it a DataError)."""


class Budget:
    """What one rendering may still spend."""

    __slots__ = ("chars", "deadline", "limit", "steps")

    def __init__(self, limit: int) -> None:
        self.limit, self.chars, self.steps = limit, limit, RENDER_STEPS
        self.deadline = time.monotonic() + RENDER_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise BoundExceeded(f"took more than {RENDER_STEPS:,} steps (loop iterations, calls, filters, operators)")
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise BoundExceeded(f"rendered for more than {RENDER_SECONDS:g} s")

    def charge(self, chars: int) -> None:
        """Characters written: every `{{ ... }}` evaluated (in macros and blocks too) and a loop body's text per
        iteration; all of a rendering's together stay within the limit."""
        self.chars -= chars
        if self.chars < 0:
            raise BoundExceeded(f"wrote more than {self.limit:,} characters")

    def fits(self, size: int, what: str) -> None:
        """A value about to be built must fit the limit."""
        if size > self.limit:
            raise BoundExceeded(f"built {what} of {size:,} characters or items, more than {self.limit:,}")


BUDGET: ContextVar[Budget] = ContextVar("shardline_chat_template_budget")


def current_budget() -> Budget:
    budget = BUDGET.get(None)
    if budget is None:  # the bounded environment renders only inside chat_text
        raise BoundExceeded("rendered outside a bounded rendering")
    return budget


_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)
_STRINGS = (str, bytes)


def text_size(value: object, limit: int) -> int:
    """At least the characters `str(value)` (or JSON of it) takes: a string's length; a container's items' sizes
    plus a few per item, counted until past `limit` (so a shared or self-containing value costs at most that)."""
    if isinstance(value, _STRINGS):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return value.bit_length() // 3 + 2 if isinstance(value, int) else 24
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, _STRINGS):
            total += len(item) + 2
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
            total += 4 * len(item) + 2
        elif isinstance(item, Namespace):
            stack.append(dict(item._Namespace__attrs))  # type: ignore[attr-defined]
        elif isinstance(item, _CONTAINERS):
            stack += item
            total += 2 * len(item) + 2
        else:
            total += text_size(item, limit)
    return total


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)


def length(value: object) -> int:
    """Characters of a string, items of a container, 0 for anything else (what a result is checked by)."""
    return len(value) if isinstance(value, _SIZED) else 0


# ---- operators ----
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMAT_NUMBER = re.compile(r"\d+")


_SEQUENCES = (str, bytes, list, tuple)


def check_binop(op: str, left: object, right: object, budget: Budget) -> None:
    if op == "+":
        if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            budget.fits(len(left) + len(right), "a concatenation")
    elif op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, _SEQUENCES) and isinstance(n, int):
                budget.fits(len(seq) * max(n, 0), "a repetition")
        if isinstance(left, int) and isinstance(right, int):
            _fits_bits(left.bit_length() + right.bit_length())
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            _fits_bits(left.bit_length() * right)
    elif op == "%" and isinstance(left, _STRINGS):
        _check_printf(left if isinstance(left, str) else left.decode(errors="replace"), right, budget)


def _fits_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise BoundExceeded(f"computed an integer of more than {MAX_INT_BITS:,} bits")


def _check_printf(fmt: str, args: object, budget: Budget) -> None:
    """`fmt % args` fits: its fields' widths and precisions, and each field as long as the longest argument."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    fields = _PRINTF_FIELD.findall(fmt)
    widths = [int(n) for field in fields for n in field if n.isdigit()]
    widths += [v for v in values if isinstance(v, int) and any("*" in field for field in fields)]
    widest = max([*widths, 0])
    budget.fits(widest, "a printf field")
    longest = max([text_size(v, budget.limit) for v in values] + [0])
    budget.fits(len(fmt) + len(fields) * (widest + longest), "a printf result")


def _check_format(fmt: str, args: tuple, kwargs: dict, budget: Budget) -> None:
    """`fmt.format(*args, **kwargs)` fits: numbers in its fields (widths) and each field as long as the longest
    argument."""
    fields = fmt.count("{")
    values = [*args, *kwargs.values()]
    widest = max([int(n) for n in _FORMAT_NUMBER.findall(fmt)] + [v for v in values if isinstance(v, int)] + [0])
    budget.fits(widest, "a format field")
    longest = max([text_size(v, budget.limit) for v in values] + [0])
    budget.fits(len(fmt) + fields * (widest + longest), "a format result")


# ---- calls ----
def check_call(func: object, args: tuple, kwargs: dict, budget: Budget, name: str = "") -> None:
    """Before a call from the template: no integer argument past the limit (widths, counts, lengths), and the
    string methods whose result can outgrow their arguments checked by their result's size."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > budget.limit:
            raise BoundExceeded(f"passed {value:,} to {name or getattr(func, '__name__', 'a function')}, more than "
                            f"{budget.limit:,}")
    target = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(owner, _STRINGS):
        _check_string_method(owner, name, args, kwargs, budget)


def _check_string_method(s: str | bytes, name: str, args: tuple, kwargs: dict, budget: Budget) -> None:
    if name in ("format", "format_map") and isinstance(s, str):
        _check_format(s, args, kwargs if name == "format" else dict(args[0]) if args else {}, budget)
    elif name == "replace" and len(args) >= 2:
        _check_replace(s, args[0], args[1], args[2] if len(args) > 2 else -1, budget)
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], list | tuple) else ()
        budget.fits(sum(text_size(i, budget.limit) for i in items) + len(s) * len(items), "a join")
    elif name == "expandtabs":
        budget.fits(len(s) * max(1, args[0] if args and isinstance(args[0], int) else 8), "a tab expansion")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max([text_size(v, budget.limit) for v in args[0].values()] + [1])
        budget.fits(len(s) * longest, "a translation")


def _check_replace(s: object, old: object, new: object, count: object, budget: Budget) -> None:
    if not (isinstance(s, _STRINGS) and isinstance(old, _STRINGS) and isinstance(new, _STRINGS)):
        return
    found = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    budget.fits(len(s) + found * max(0, len(new) - len(old)), "a replacement")


# ---- filters ----
_GROWING_FILTERS = frozenset({"center", "indent", "wordwrap", "format", "replace", "join", "batch", "slice",
                              "sum", "string", "pprint", "xmlattr", "urlencode", "e", "escape", "forceescape",
                              "urlize"})


def _filter_check(name: str, value: object, args: tuple, kwargs: dict, budget: Budget) -> None:
    """Before a filter: the filters whose result can outgrow their arguments, by their result's size."""
    if name not in _GROWING_FILTERS:
        return

    def arg(i: int, key: str, default: object = None) -> object:
        return args[i] if len(args) > i else kwargs.get(key, default)

    size = text_size(value, budget.limit)
    if name == "center":
        width = arg(0, "width", 80)
        budget.fits(max(size, width if isinstance(width, int) else 0), "a centred string")
    elif name == "indent":
        width = arg(0, "width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        budget.fits(size + pad * (str(value).count("\n") + 1 if isinstance(value, str) else size), "an indentation")
    elif name == "wordwrap":
        width, wrap = arg(0, "width", 79), arg(2, "wrapstring", None)
        lines = size // max(1, width if isinstance(width, int) else 1) + 1
        budget.fits(size + lines * len(wrap if isinstance(wrap, str) else "\n"), "a word wrap")
    elif name == "format" and isinstance(value, str):
        _check_printf(value, kwargs if kwargs else tuple(args), budget)
    elif name == "replace":
        _check_replace(value, arg(0, "old"), arg(1, "new"), arg(2, "count"), budget)
    elif name == "join":
        items = len(value) if isinstance(value, _SIZED) else 0
        budget.fits(size + len(str(arg(0, "d", ""))) * items, "a join")
    elif name in ("batch", "slice"):
        count, fill = arg(0, "linecount" if name == "batch" else "slices", 1), arg(1, "fill_with")
        if isinstance(count, int):
            budget.fits(count * (1 + text_size(fill, budget.limit)) if fill is not None else count, f"a {name}")
    elif name == "sum" and not isinstance(arg(1, "start", 0), int | float):  # sequences: each sum copies the last
        budget.fits((len(value) if isinstance(value, _SIZED) else 1) * size, "a sum of sequences")
    else:
        budget.fits(6 * size, f"the {name} of a value")


def guarded_filter(name: str, func: Callable) -> Callable:
    """`func` with the budget's step, its arguments checked before it runs and its result after."""
    passes = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    @pass_context
    def guarded(context, value, *args, **kwargs):
        budget = current_budget()
        budget.step()
        check_call(func, args, kwargs, budget, f"the {name} filter")
        if not isinstance(value, _SIZED) and isinstance(value, Iterator):  # a generator (select, map, ...)
            value = _bounded_list(value, budget)
        _filter_check(name, value, args, kwargs, budget)
        if passes is None:
            out = func(value, *args, **kwargs)
        else:
            first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}
            out = func(first[passes], value, *args, **kwargs)
        budget.fits(length(out), f"the result of the {name} filter")
        return out

    return guarded


def _bounded_list(items: Iterator, budget: Budget) -> list:
    out = []
    for item in items:
        budget.step()
        out.append(item)
    return out


@pass_context
def bounded_iter(context, iterable, text_chars: int):
    """A loop's iterable: each iteration is a step, and the text of the loop's body (written once per iteration)
    is charged to the characters written."""
    budget = current_budget()
    for item in iterable:
        budget.step()
        budget.charge(text_chars)
        yield item


@pass_context
def bounded_concat(context, items: list) -> str:
    """`a ~ b ~ ...`, checked before it is built."""
    budget = current_budget()
    budget.step()
    budget.fits(sum(text_size(i, budget.limit) for i in items), "a concatenation")
    return "".join(str(i) for i in items)


@pass_context
def finalize(context, value):
    """Every `{{ ... }}`: its characters count towards what the rendering writes, before they are written."""
    budget = current_budget()
    budget.step()
    budget.charge(text_size(value, budget.limit) if value is not None else 4)
    return value


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` filter (JSON without jinja's HTML escaping), encoded piece by piece within the budget."""
    budget, size, out = current_budget(), 0, []
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for chunk in encoder.iterencode(x):  # not one-shot: pieces, so a large text stops at the bound
        size += len(chunk)
        budget.fits(size, "a JSON text")
        out.append(chunk)
    return "".join(out)


def strftime_now(format):
    """transformers' `strftime_now`: a format's directives write at most ~16 characters each."""
    current_budget().fits(16 * len(str(format)), "a date")
    return datetime.now().strftime(format)
