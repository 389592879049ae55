"""Where an answer ends: EOS for the plain template, the chat template's own end of turn for `chat`."""

from shardline.data.template import answer_end, encode_answer, stop_ids

# A Llama-3-style template: turns end with <|eot|>, which is not the tokenizer's EOS.
EOT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eot|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")


def test_chat_answers_end_with_the_templates_end_of_turn_not_eos(prepared):
    tok = prepared.tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = EOT_TEMPLATE
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert eot != tok.eos_token_id
    assert answer_end(tok, "chat") == [eot] and answer_end(tok, "plain") == [tok.eos_token_id]
    assert encode_answer(tok, "SELECT 1", "chat")[-1] == eot
    assert stop_ids(tok, "chat") == sorted({eot, tok.eos_token_id})
    full = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "SELECT 1"}],
                                   tokenize=True, return_dict=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    assert list(full).index(eot, len(prompt)) + 1 == len(prompt) + len(encode_answer(tok, "SELECT 1", "chat"))
