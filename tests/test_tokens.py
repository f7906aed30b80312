"""The daemon's tokenizing shortcut (loractld.engine.tokens) gives transformers' own ids.

Run on real tokenizers: the tiny model's, and the same with a BOS-adding post-processor (a base
model whose tokenizer adds BOS). The texts checked are drawn at random, not the probes the
encoder checks itself with at start.
"""

from __future__ import annotations

import random
import shutil

import pytest

from conftest import add_bos
from loractld.engine import tokens


def _texts(seed: int, count: int = 200) -> list[str]:
    rng = random.Random(seed)
    pieces = ["the", " sea", "SQL", "SELECT *", "\n", "\t", "  ", "é", "東", "🙂", "<s>", "</s>", "<|im_start|>",
              "123", ".", ",", "'", "don't", "x" * 40]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def bos_model(demo, tmp_path_factory):
    model = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(demo / "model", model)
    return model, add_bos(model)


@pytest.mark.parametrize("which", ["tiny", "bos"])
def test_the_shortcut_is_taken_and_gives_transformers_ids(which, demo, bos_model):
    from transformers import AutoTokenizer

    path = demo / "model" if which == "tiny" else bos_model[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = tokens.encoder(tokenizer)
    assert encode.__name__ == "through_backend", "a fast tokenizer with equal ids takes the Rust path"
    for text in _texts(seed=7 if which == "tiny" else 8):
        for special in (True, False):
            assert encode(text, special) == list(tokenizer.encode(text, add_special_tokens=special)), (text, special)
    if which == "bos":
        assert encode("hello", True)[0] == bos_model[1] and encode("hello", False)[0] != bos_model[1]


def test_a_tokenizer_whose_wrapper_changes_the_ids_keeps_the_wrappers_path(demo):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    plain_encode = tokenizer.encode

    class Wrapped:
        """A wrapper that post-edits ids (as some model-specific tokenizer classes do)."""
        backend_tokenizer = tokenizer.backend_tokenizer
        all_special_tokens = tokenizer.all_special_tokens

        def encode(self, text, add_special_tokens=True):
            return [*plain_encode(text, add_special_tokens=add_special_tokens), 0]

    encode = tokens.encoder(Wrapped())
    assert encode.__name__ == "through_transformers"
    assert encode("hello", False) == [*plain_encode("hello", add_special_tokens=False), 0]


def test_a_tokenizer_without_a_rust_backend_keeps_its_own_encode():
    class Slow:
        def encode(self, text, add_special_tokens=True):
            return [len(text), int(add_special_tokens)]

    encode = tokens.encoder(Slow())
    assert encode("abc", True) == [3, 1] and encode("", False) == [0, 0]
