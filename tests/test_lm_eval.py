"""lm-evaluation-harness against the HTTP API and against vLLM's own server (issue 38).

``lm_eval --model local-completions`` scores a small multiple-choice task, made here as a JSONL
file (nothing is downloaded), once through loractl (``oracle_rig``) and once through vLLM's
server (``vllm_server``), for the base model and for the ``oracle/sql`` adapter. lm-eval asks
``/v1/completions`` for ``echo: true``, ``logprobs: 1``, ``max_tokens: 1`` and sums the prompt's
logprobs over each choice: every per-choice log-likelihood must match vLLM's within 1e-3, the
accuracy exactly, and the adapter's must differ from the base model's (the adapter was applied).

lm-eval runs from a venv of its own, which ``scripts/setup.sh`` makes (``.venv-lmeval``;
``$LORACTL_LMEVAL_VENV`` names another).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

LMEVAL = Path(os.environ.get("LORACTL_LMEVAL_VENV", REPO / ".venv-lmeval")) / "bin" / "lm_eval"
ADAPTER = "oracle/sql"
TASK = "loractl_mc"
# (context, choices, answer): SQL and prose, so that the sql adapter and the base model disagree.
DOCS = [
    ("SELECT name FROM users WHERE", ["age > 30;", "the quick brown fox", "def load(name):"], 0),
    ("SELECT u.id, o.total FROM users u JOIN", ["orders o ON o.user_id = u.id;", "over the lazy dog.", "1, 2"], 0),
    ("INSERT INTO adapters (name, rank) VALUES", ["('sql-expert', 8);", "a LoRA adapter", "print(i)"], 0),
    ("UPDATE tiers SET slots = slots - 1 WHERE", ["tier = 'device';", "the sky is blue.", "return None"], 0),
    ("DELETE FROM cache WHERE", ["pinned = 0;", "once upon a time", "class Adapter:"], 0),
    ("The quick brown fox jumps over", ["the lazy dog.", "GROUP BY name;", "rank=16)"], 0),
    ("A LoRA adapter is a pair of", ["low-rank matrices", "ORDER BY 2 DESC", "users u"], 0),
    ("many adapters can share one base model", ["on one GPU.", "LIMIT 10;", "== 0:"], 0),
    ("def load(name: str, tier: str =", ["\"device\") -> None:", "count(*)", "the lazy dog"], 0),
    ("for i in range(10):\n    if i % 2 ==", ["0:", "JOIN orders", "a time"], 0),
    ("Write a query that lists every user who", ["ordered more than three times", "SET slots", "rank"], 0),
    ("SELECT name, count(*) FROM users GROUP BY", ["name ORDER BY 2 DESC;", "the fox", "self.name"], 0),
    ("class Adapter:\n    def __init__(self,", ["name, rank=16):", "WHERE age > 30", "jumps"], 0),
    ("SELECT * FROM orders WHERE total >=", ["100;", "a pair of", "print(f\"step\")"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The task: a YAML beside its JSONL, for ``--include_path``."""
    assert LMEVAL.exists(), f"lm-eval is not installed ({LMEVAL}): bash scripts/setup.sh makes .venv-lmeval"
    root = tmp_path_factory.mktemp("lmeval")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(docs))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root


class Run:
    """One ``lm_eval`` process against ``url``, its outputs under ``out``."""

    def __init__(self, task_dir: Path, out: Path, url: str, model: str, tokenizer: Path, tokenized: bool) -> None:
        args = ",".join([f"model={model}", f"base_url={url}/v1/completions", f"tokenizer={tokenizer}",
                         "tokenizer_backend=huggingface", f"tokenized_requests={tokenized}", "num_concurrent=1",
                         "max_retries=1", "max_length=1024"])
        out.mkdir(parents=True)
        env = {**os.environ, "HF_HOME": str(task_dir / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self.what, self.out, self.log = f"lm_eval against {url} ({model})", out, out / "lm_eval.log"
        with open(self.log, "wb") as sink:
            self.proc = subprocess.Popen([str(LMEVAL), "--model", "local-completions", "--model_args", args,
                                          "--tasks", TASK, "--include_path", str(task_dir), "--output_path", str(out),
                                          "--log_samples"], stdout=sink, stderr=subprocess.STDOUT, cwd=out, env=env)

    def result(self) -> tuple[dict, float]:
        """({(doc_id, choice): log-likelihood}, accuracy), once the process has ended."""
        try:
            code = self.proc.wait(300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        assert code == 0, f"{self.what} exited {code}:\n{self.log.read_text(errors='replace')[-4000:]}"
        [samples] = self.out.rglob(f"samples_{TASK}_*.jsonl")
        [results] = self.out.rglob("results_*.json")
        scores = {}
        for line in samples.read_text().splitlines():
            sample = json.loads(line)
            for choice, [[loglikelihood, _greedy]] in enumerate(sample["resps"]):
                scores[sample["doc_id"], choice] = float(loglikelihood)
        return scores, json.loads(results.read_text())["results"][TASK]["acc,none"]


# (model, tokenized_requests): prompts sent as text (as lm-eval's README runs it against vLLM)
# for both models, and as token ids (local-completions' default) for the adapter.
CASES = [("base", False), (ADAPTER, False), (ADAPTER, True)]


@pytest.fixture(scope="module")
def scores(task_dir, oracle_rig, vllm_server, home) -> dict[tuple[str, str, bool], tuple[dict, float]]:
    """{(server, model, tokenized): (scores, accuracy)}: each case against both servers at once."""
    done = {}
    for which, tokenized in CASES:
        model = vllm_server.model if which == "base" else which
        runs = {server: Run(task_dir, task_dir / "out" / f"{server}-{which.replace('/', '_')}-{tokenized}", url,
                            model, home / "tiny" / "model", tokenized)
                for server, url in (("loractl", oracle_rig.http), ("vllm", vllm_server.url))}
        for server, run in runs.items():
            done[server, which, tokenized] = run.result()
    return done


@pytest.mark.parametrize("which, tokenized", CASES)
def test_same_loglikelihoods_as_vllm(scores, which, tokenized):
    (ours, our_acc), (theirs, their_acc) = scores["loractl", which, tokenized], scores["vllm", which, tokenized]
    assert len(theirs) == sum(len(choices) for _, choices, _ in DOCS) and ours.keys() == theirs.keys()
    far = {key: (ours[key], theirs[key]) for key in theirs if not abs(ours[key] - theirs[key]) <= 1e-3}
    assert not far, f"{which}: (doc, choice): (loractl, vLLM) log-likelihoods more than 1e-3 apart: {far}"
    assert our_acc == their_acc


def test_the_adapter_changes_the_scores(scores):
    base, _ = scores["loractl", "base", False]
    adapter, _ = scores["loractl", ADAPTER, False]
    assert max(abs(base[key] - adapter[key]) for key in base) > 0.1, "the adapter's scores are the base model's"
