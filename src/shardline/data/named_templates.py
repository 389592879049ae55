"""Chat templates written in shardline (`data.chat_template`), for a tokenizer that has none or a wrong one.

Each is a short Jinja string in transformers' dialect: an assistant turn's content and end of turn sit in a
`{% generation %}` block, so a tokenizer saved with one gives TRL's `assistant_only_loss` (transformers'
`return_assistant_tokens_mask`) the same loss shardline trains. Contents are written as they are (never trimmed):
the answer is trained as written, in every format. A template names the special tokens it writes; a tokenizer must
have each as one token, or generation would not stop at the end of a turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardline.errors import DataError
from shardline.spec import ChatTemplateName

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedTemplate:
    source: str
    special_tokens: tuple[str, ...]
    """Tokens the template writes that the tokenizer must hold as single tokens."""


_CONTENT = "(message['content'] or '')"
TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ " + _CONTENT + " + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\\n' }}{% else %}{{ " + _CONTENT + " + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ("<|im_start|>", "<|im_end|>")),
    "llama3": NamedTemplate(
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ " + _CONTENT + " + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ " + _CONTENT + " + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "alpaca": NamedTemplate(
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ " + _CONTENT + " + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + " + _CONTENT + " + '\\n\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' }}{% generation %}"
        "{{ " + _CONTENT + " + eos_token }}{% endgeneration %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}",
        ()),
}


def use_named_template(tok: PreTrainedTokenizerBase, name: ChatTemplateName | None,
                       where: str = "data.chat_template") -> PreTrainedTokenizerBase:
    """`tok` with the named template as its chat template (None: as it is); a DataError naming the tokens the
    template writes that `tok` does not hold as single tokens."""
    if name is None:
        return tok
    template = TEMPLATES[name]
    missing = [t for t in template.special_tokens if len(tok.encode(t, add_special_tokens=False)) != 1]
    if missing:
        raise DataError(f"{where}={name}", f"writes {', '.join(missing)}, which the tokenizer "
                        f"({tok.name_or_path or 'trained on the data'}) does not hold as single tokens: they would be "
                        "split into pieces, and generation would not stop at the end of a turn",
                        "name a template whose tokens the tokenizer has (alpaca needs only its EOS), or use a "
                        "model whose tokenizer has them (Qwen: chatml; Llama 3: llama3)")
    if getattr(tok, "chat_template", None) and tok.chat_template != template.source:
        log.info("%s: its own chat template replaced by %s=%s", tok.name_or_path or "the tokenizer", where, name)
    tok.chat_template = template.source
    return tok
