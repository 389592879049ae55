"""The one record every data source yields and every task reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Example:
    """One example: the prompt's two fields, the answer the model learns, and where the example came from.

    `question` and `context` are what the task's prompt template shows (text-to-SQL: the question and the
    CREATE TABLE schema); `answer` is the text that carries loss; `db_id` names the record's source within its
    data set (text-to-SQL: the generated database the query runs on), empty when there is none.
    """

    question: str
    context: str
    answer: str
    db_id: str

    def to_dict(self) -> dict[str, str]:
        """Plain dict with keys question, context, answer, db_id."""
        return asdict(self)
