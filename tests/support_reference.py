"""The independent oracle: greedy completions from HF transformers + PEFT in float32, on the
tiny model (``reference``) and on the real demo (SmolLM2 + trained adapters), whose build this
module starts once per checkout (``real_demo``). Registered by conftest (``pytest_plugins``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support_daemons import REPO

# The real demo (SmolLM2 + trained adapters) is built once per checkout: a clean CI clone builds
# it once per run, a developer's later runs reuse it.
REAL_DEMO_CACHE = REPO / ".cache" / "real-demo"


class Reference:
    """Greedy completions from HF transformers + PEFT in float32: the independent oracle."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._cache: dict = {}

    def chat_ids(self, user_text: str) -> list[int]:
        return self.messages_ids([{"role": "user", "content": user_text}])

    def messages_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def greedy(self, prompt_ids: list[int], adapter: Path | None, max_new: int, min_new: int = 0) -> list[int]:
        key = (tuple(prompt_ids), str(adapter), max_new, min_new)
        if key not in self._cache:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter))
            model.eval()
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=min_new,
                                     do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_real_demo_build: subprocess.Popen | None = None


def _start_real_demo_build() -> subprocess.Popen:
    global _real_demo_build
    if _real_demo_build is None:
        REAL_DEMO_CACHE.mkdir(parents=True, exist_ok=True)
        log = open(REAL_DEMO_CACHE / "build.log", "w")
        _real_demo_build = subprocess.Popen([sys.executable, "-m", "loractld.models.demo", "--data",
                                             str(REAL_DEMO_CACHE)], stdout=log, stderr=subprocess.STDOUT, text=True)
    return _real_demo_build


@pytest.fixture(scope="session")
def real_demo() -> dict:
    """Build (or find) the demo under the cache: {'model': folder, 'adapters': {name: folder}}."""
    build = _start_real_demo_build()
    code = build.wait(1500)
    output = (REAL_DEMO_CACHE / "build.log").read_text()
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    model = Path(next(ln.split(": ", 1)[1] for ln in lines if ln.startswith("model: ")))
    adapters = {}
    for ln in lines:
        if ln.startswith("adapter: "):
            name, folder = ln.split(": ", 1)[1].split(" ", 1)
            adapters[name] = Path(folder)
    return {"model": model, "adapters": adapters}


@pytest.fixture(scope="session")
def reference(demo: Path) -> Reference:
    return Reference(demo / "model")


def add_bos(model: Path) -> int:
    """Make the tokenizer in ``model`` add BOS (``<s>``) as a base model's does; returns its id."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    bos = [t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<s>"][0]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return bos
