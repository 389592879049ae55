"""Prompt templates: one example → prompt token ids (no loss) and answer token ids + EOS (loss).

Prompt and answer are tokenized separately so the boundary is exact and inference sees the same
prompt tokens as training.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from shardline.spec import PromptFormat

TEMPLATE_VERSION = "1"
INSTRUCTION = "Write the SQL query that answers the question, using the schema."
PLAIN_PROMPT = "### Schema:\n{context}\n### Question:\n{question}\n### SQL:\n"
CHAT_USER = INSTRUCTION + "\n<SCHEMA>\n{context}\n</SCHEMA>\n<USER_QUERY>\n{question}\n</USER_QUERY>"


def encode_prompt(tok: PreTrainedTokenizerBase, question: str, context: str, fmt: PromptFormat) -> list[int]:
    if fmt == "chat":
        messages = [{"role": "user", "content": CHAT_USER.format(context=context, question=question)}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    # Exactly one BOS, added here, never again by the tokenizer.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + tok.encode(PLAIN_PROMPT.format(context=context, question=question), add_special_tokens=False)


def encode_answer(tok: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Answer tokens followed by EOS, so the model learns to stop."""
    return tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
