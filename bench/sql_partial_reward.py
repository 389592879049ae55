"""A partial-credit text-to-SQL reward for GRPO, as a user's reward function:
`--set train.grpo.reward=bench.sql_partial_reward:reward` (run from the repository root, which is on the workers'
import path).

The built-in reward (1 for a query whose result matches the gold's on every database of its test suite, 0.1 for a
query that runs) plus `SIMILARITY_WEIGHT` × the overlap of the query's token bigrams with the gold's (Jaccard), the
n-gram partial reward of Reasoning-SQL (Pourreza et al., 2025). At the embedded default's SFT checkpoint most of a
step's groups are all right or all wrong, so they carry no advantage; the overlap ranks the completions of an
all-wrong group (a literal copied from the question, a missing column) so that they do.
"""

from __future__ import annotations

from shardline.example import Example
from shardline.spec import DataSpec
from shardline.tasks.text_to_sql.reward import sql_reward
from shardline.tasks.text_to_sql.suite import normalised_tokens

SIMILARITY_WEIGHT = 0.3


def bigram_overlap(query: str, gold: str) -> float:
    """Jaccard overlap of the two queries' token bigrams (exact match's tokens: case-insensitive outside quoted
    literals and names)."""
    def bigrams(sql: str) -> set[tuple[str, str]]:
        tokens = normalised_tokens(sql)
        return set(zip(tokens, tokens[1:], strict=False))
    a, b = bigrams(query), bigrams(gold)
    return len(a & b) / len(a | b) if a | b else 0.0


def reward(prompts: list[str], completions: list[str], question: list[str], context: list[str], answer: list[str],
           db_id: list[str], **_: list) -> list[float]:
    examples = [Example(question=q, context=c, answer=a, db_id=d)
                for q, c, a, d in zip(question, context, answer, db_id, strict=True)]
    executed = sql_reward(examples, completions, DataSpec()).values  # the default data seed: the embedded default
    return [value + SIMILARITY_WEIGHT * bigram_overlap(pred, gold)
            for value, pred, gold in zip(executed, completions, answer, strict=True)]
