"""``python -m loractld.selfcheck``: start the engine and answer one request with a LoRA.

The check an installation (or an offline bundle, see scripts/bundle.py) ends with: it builds
the embedded demo model and an adapter in a temporary folder, starts vLLM through loractl's
engine on ``--device`` (auto: CUDA when present), generates greedily with and without the
adapter, and fails unless both produce tokens and the adapter changes them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path


async def check(device: str) -> int:
    from loractld.engine.adapter import AdapterRef
    from loractld.models.tiny import DEMO_ADAPTERS, ensure_demo
    from loractld.engine import vllm_requests
    from loractld.engine.client import Engine, EngineSettings
    from loractld.engine.openai_serving import unadmitted_surface
    from loractld.engine.sampling import Sampling
    from loractld.store.validate import validate_adapter

    root = ensure_demo(Path(tempfile.mkdtemp(prefix="loractl-selfcheck-")) / "demo")
    adapter_dir = root / "adapters" / DEMO_ADAPTERS[0].name
    validate_adapter(adapter_dir, max_lora_rank=16)  # the demo adapter is one the store would accept
    adapter = AdapterRef(label=DEMO_ADAPTERS[0].name, path=adapter_dir, digest="selfcheck0000000", engine_id=1)
    began = time.monotonic()
    engine = await Engine.start(EngineSettings(model=str(root / "model"), device=device, max_model_len=256,
                                               kv_cache_bytes=64 << 20 if device == "cpu" else None))
    try:
        surface = unadmitted_surface(engine)   # the daemon's request path, without its admission gate
        outputs = {}
        for name, ref in (("base", None), ("lora", adapter)):
            ids: list[int] = []
            async for delta in vllm_requests.generate(surface, Sampling(max_tokens=8, min_tokens=8, temperature=0.0),
                                                      ref, messages=[{"role": "user", "content": "hello"}]):
                ids += delta.token_ids
            outputs[name] = ids
    finally:
        engine.shutdown()
    ok = len(outputs["base"]) == 8 and len(outputs["lora"]) == 8 and outputs["base"] != outputs["lora"]
    print(f"selfcheck: vllm {engine.vllm_version} on {engine.device} ({engine.dtype}), engine up in "
          f"{engine.start_seconds:.1f} s, total {time.monotonic() - began:.1f} s; base {outputs['base']} "
          f"lora {outputs['lora']}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main() -> None:
    from loractld.engine.device import keep_cuda_uninitialized
    from loractld.worker.media_packages import hide_media_packages

    keep_cuda_uninitialized()  # before the demo build imports torch (engine/device.py)
    hide_media_packages()
    parser = argparse.ArgumentParser(prog="python -m loractld.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    sys.exit(asyncio.run(check(parser.parse_args().device)))


if __name__ == "__main__":
    main()
