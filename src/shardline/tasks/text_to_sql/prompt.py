"""The words of the text-to-SQL prompt: the schema (context), the question, then the SQL the model writes."""

from __future__ import annotations

from shardline.tasks.base import PromptTemplate

INSTRUCTION = "Write the SQL query that answers the question, using the schema."
PLAIN_PROMPT = "### Schema:\n{context}\n### Question:\n{question}\n### SQL:\n"
CHAT_USER = INSTRUCTION + "\n<SCHEMA>\n{context}\n</SCHEMA>\n<USER_QUERY>\n{question}\n</USER_QUERY>"

SQL_PROMPT = PromptTemplate(
    plain=lambda question, context: PLAIN_PROMPT.format(context=context, question=question),
    chat=lambda question, context: CHAT_USER.format(context=context, question=question),
    version="2",  # the template version before tasks existed: the embedded default's dataset version stays
)
