"""Merged adapters on the session's rig and their oracle, shared by tests/test_merge.py and
tests/test_profile_doors.py: the PEFT-made sources (``SERVED``), their merges (``MERGES``),
``pull_sources`` (build and pull them into a daemon) and :class:`PeftMerge` (HF + PEFT's own
``add_weighted_adapter(..., combination_type="cat")``, greedy, in float32)."""

from __future__ import annotations

from pathlib import Path

import peft_corpus

PROMPT = "the quick brown fox jumps over the lazy dog"
NEW_TOKENS = 8
SERVED = {   # PEFT's cat merge needs each adapter's rank uniform (it sums config.r): no rank_pattern here
    "m/plain": peft_corpus.Case("merge-plain", lambda: peft_corpus._lora()),
    "m/rslora": peft_corpus.Case("merge-rslora", lambda: peft_corpus._lora(use_rslora=True, r=4, lora_alpha=6,
                                                                            target_modules=["q_proj", "v_proj"])),
    "m/alpha": peft_corpus.Case("merge-alpha", lambda: peft_corpus._lora(
        r=2, alpha_pattern={"v_proj": 7}, target_modules=["v_proj", "o_proj", "up_proj"])),
}
MERGES = {"m/two": {"m/plain": 0.7, "m/rslora": 0.3},
          "m/three": {"m/plain": 0.5, "m/rslora": 1.5, "m/alpha": 0.75}}


def pull_sources(rig, demo: Path, root: Path) -> dict[str, Path]:
    """``SERVED``'s adapters built under ``root`` (the same weights every time: a fixed seed)
    and pulled into ``rig`` under their names; name -> folder."""
    folders = {}
    for name, case in SERVED.items():
        folders[name] = root / name.replace("/", "-")
        peft_corpus.build(case, demo / "model", folders[name], scale=0.1)
        # --force: another module pulled these names from its own copy of the same folders (a
        # different source, refused without it since issue 60)
        rig.ok("pull", str(folders[name]), "--name", name, "--force")
    return folders


class PeftMerge:
    """HF + PEFT in float32 with PEFT's own merge (``add_weighted_adapter``, ``cat``): greedy
    tokens and the logprob of each."""

    def __init__(self, model_dir: Path, folders: dict[str, Path]) -> None:
        self.model_dir, self.folders = model_dir, folders

    def greedy(self, weights: dict[str, float], prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        names = [n.replace("/", "-") for n in weights]
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        first, *rest = weights
        model = PeftModel.from_pretrained(model, str(self.folders[first]), adapter_name=names[0])
        for name, key in zip(rest, names[1:]):
            model.load_adapter(str(self.folders[name]), adapter_name=key)
        model.add_weighted_adapter(names, list(weights.values()), "merged", combination_type="cat")
        model.set_adapter("merged")
        model.eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            ids = out[0, len(prompt_ids):].tolist()
            # The raw logits' logprobs, as the engine reports them: generate's scores have EOS
            # masked by min_new_tokens, which moves every logprob by log(1 - p(EOS)).
            scores = torch.log_softmax(model(out).logits[0].float(), -1)
        return ids, [scores[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(ids)]
