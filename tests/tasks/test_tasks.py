"""Tasks are plug-ins: `data.task` picks the prompt words, the bundled data and the generation metric, and a run
of one task never loads another's code."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from shardline.data.prepare import prepare
from shardline.errors import DataError, SpecError
from shardline.example import Example
from shardline.observe.prometheus import EVAL_GAUGES
from shardline.spec import TaskName
from shardline.spec.resolve import load_spec
from shardline.tasks import TASKS, get_task
from tests.conftest import REPO, free_port, small_spec

SRC = REPO / "src" / "shardline"
SQL_PACKAGE = "shardline.tasks.text_to_sql"


def _user_data(tmp_path: Path, n: int = 60) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"How many rows number {i}?", "context": "CREATE TABLE t (x INTEGER)", "answer": f"SELECT {i}"}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _user_spec(tmp_path: Path, *extra: str):
    return small_spec(tmp_path, f"data.path={_user_data(tmp_path)}", "data.validation_size=8", "data.test_size=8",
                      "data.train_size=null", *extra)


def test_every_task_name_the_spec_accepts_is_registered_and_names_itself():
    assert set(TASKS) == set(get_args(TaskName))
    assert {name: get_task(name).name for name in TASKS} == {name: name for name in TASKS}


def test_task_defaults_to_text_to_sql_for_the_generated_set_and_none_for_user_data():
    assert load_spec("tiny").data.task == "text_to_sql"
    assert load_spec("tiny", ["data.path=mine.jsonl"]).data.task == "none"
    assert load_spec("tiny", ["data.path=mine.jsonl", "data.task=text_to_sql"]).data.task == "text_to_sql"
    assert load_spec("llama-3.1-8b-lora").data.task == "text_to_sql"  # the gretel text-to-SQL set


def test_unknown_task_names_the_field():
    with pytest.raises(SpecError) as e:
        load_spec("tiny", ["data.task=chat"])
    assert e.value.where == "data.task"


def test_none_task_without_data_path_says_to_set_it(tmp_path):
    with pytest.raises(DataError) as e:
        prepare(small_spec(tmp_path, "data.task=none"))
    assert e.value.where == "data.path" and "data.task=none" in e.value.problem
    assert "data.task=text_to_sql" in e.value.fix


def test_prompt_words_are_the_tasks():
    sql, none = get_task("text_to_sql").prompt, get_task("none").prompt
    assert sql.plain("Who?", "CREATE TABLE t (x)") == "### Schema:\nCREATE TABLE t (x)\n### Question:\nWho?\n### SQL:\n"
    assert "Write the SQL query" in sql.chat("Who?", "CREATE TABLE t (x)")
    # the instruction before its input, as Alpaca, LLaMA-Factory and Axolotl render it (was: the input first)
    assert none.plain("Summarise.", "A long text.") == "Summarise.\n\nA long text.\n"
    assert none.plain("Hello", "") == "Hello\n" and none.chat("Hello", "") == "Hello"
    assert sql.version != none.version  # the dataset version tells the two preparations apart


def test_user_data_is_prepared_with_the_chosen_tasks_prompt(tmp_path):
    plain = prepare(_user_spec(tmp_path / "none"))
    sql = prepare(_user_spec(tmp_path / "sql", "data.task=text_to_sql"))
    assert plain.version != sql.version

    def first_document(data) -> str:
        rows = data.rows("train")
        return data.tokenizer().decode(rows.tokens[0][: rows.n_real[0]])

    assert "### SQL:" in first_document(sql) and "### SQL:" not in first_document(plain)


def test_sql_metric_writes_the_score_names_report_and_prometheus_read():
    ex = Example("How many t rows are there?", "CREATE TABLE t (x INTEGER)", "SELECT COUNT(*) FROM t", "")
    result = get_task("text_to_sql").score([ex, ex], ["SELECT COUNT(*) FROM t", "SELECT 1"], load_spec("tiny").data)
    assert result.scores == {"sql_execution_accuracy": 0.5, "sql_exact_match": 0.5} and result.n == 2
    assert set(result.scores) <= set(EVAL_GAUGES)
    assert [s["match"] for s in result.samples] == [True, False] and "execution accuracy" in result.headline
    assert get_task("none").score is None and get_task("none").bundled_splits is None


def test_only_the_registry_imports_the_text_to_sql_package():
    importers = set()
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        if module.startswith(SQL_PACKAGE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == SQL_PACKAGE or n.startswith(SQL_PACKAGE + ".") for n in names):
                importers.add(module)
    assert importers == {"shardline.tasks.__init__"}


NONE_TASK_RUN = """
import json, sys
from pathlib import Path
from rich.console import Console
import shardline.worker  # everything a training process imports
from shardline.data.prepare import prepare
from shardline.spec.resolve import load_spec
from shardline.tasks import get_task
from shardline.parallel.mesh import distributed
from shardline.training.trainer import Trainer

spec = load_spec(sys.argv[1], [])
assert spec.data.task == "none"
data = prepare(spec)
with distributed() as ctx:
    trainer = Trainer(spec, ctx, data, Path(sys.argv[2]), Console(quiet=True))
    loss = trainer.validate()
    generated = trainer.evaluate_generation()
loaded = sorted(m for m in sys.modules if m.startswith("shardline.tasks.text_to_sql"))
get_task("text_to_sql")
print(json.dumps({"loss": loss, "generated": generated, "sql_modules": loaded,
                  "sql_after_choosing_it": "shardline.tasks.text_to_sql" in sys.modules}))
"""


def test_a_none_task_run_validates_without_loading_any_text_to_sql_code(tmp_path):
    spec = _user_spec(tmp_path, "train.eval_examples=8", "train.precision=fp32", "train.peak_tflops=1")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json")))
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", NONE_TASK_RUN, str(spec_file), str(run_dir)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sql_modules"] == [] and out["generated"] == {} and out["loss"] > 0
    assert out["sql_after_choosing_it"]  # the check above can see an import when one happens
    # no metric scores a user's own data: a few answers beside their references instead, and no SQL score
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["task"] == "none" and evaluation["samples"] and "sql_execution_accuracy" not in evaluation
    assert all({"question", "gold", "pred"} <= set(s) for s in evaluation["samples"])
