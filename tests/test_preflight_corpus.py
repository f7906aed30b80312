"""Adapters made by PEFT itself (tests/peft_corpus.py), pulled through the real daemon: each is
served token-identical to PEFT's own generation, or refused at pull in one line naming its
feature; after each, the engine is alive and the base model still equals the reference."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import peft_corpus
from loractld.store.disk import MANIFEST_FILE
from test_errors import assert_one_error
from test_preflight import base_is_reference

PROMPT = "Write a query"


@pytest.mark.parametrize("case", peft_corpus.CASES, ids=[c.name for c in peft_corpus.CASES])
def test_peft_adapter_is_served_exactly_or_refused_by_name(rig, demo, tmp_path, reference, case):
    folder = tmp_path / case.name
    peft_folder = peft_corpus.build(case, demo / "model", folder)
    name = f"corpus-{case.name}/v1"
    result = rig.cli("pull", str(folder), "--name", name)
    if case.refused:
        assert_one_error(result, 5, case.refused)
        assert name not in {a["name"] for a in json.loads(rig.ok("ls", "--json").stdout)}
    else:
        assert result.returncode == 0, (result.stderr, rig.daemon.log_tail())
        out = rig.ok("run", "-t", "0", "-n", "12", "--lora", name, PROMPT)
        expected = reference.greedy(reference.chat_ids(PROMPT), peft_folder, 12)
        assert out.stdout == reference.text(expected) + "\n"
        # The adapter does something: its output differs from the base model's.
        assert expected != reference.greedy(reference.chat_ids(PROMPT), None, 12)
        if case.normalized:
            shown = json.loads(rig.ok("show", name, "--json").stdout)
            assert case.normalized in json.dumps(shown["normalized"]), shown
            assert "normalised" in rig.ok("show", name).stdout
            # The manifest keeps the source's own files (digests) beside the installed copy's.
            manifest = json.loads((Path(shown["path"]) / MANIFEST_FILE).read_text())
            source_sha = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
            assert source_sha in {f["sha256"] for f in manifest["original_files"]}
            assert source_sha not in {f["sha256"] for f in manifest["files"]}
        rig.ok("rm", name)
    base_is_reference(rig, reference)
