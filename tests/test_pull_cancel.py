"""A pull whose client goes away ends quietly: the download stops, nothing is installed, and the
daemon's log gets no "Future exception was never retrieved" traceback for the expected
PullCancelled. The source is a test double (a download that runs until it is cancelled, which
a real Hub cannot do on demand); the Puller and the Store are the daemon's own."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from pathlib import Path

from loractld.store.pulls import Puller
from loractld.store.sources import AdapterSource, PullCancelled, RemoteFile, Resolved
from loractld.store.disk import Store


class EndlessSource(AdapterSource):
    name = "endless"

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def accepts(self, ref: str) -> bool:
        return ref.startswith("endless://")

    def resolve(self, ref, revision, *, token, endpoint) -> Resolved:
        return Resolved(source=self.name, ref=ref, revision="0" * 40,
                        files=[RemoteFile("adapter_model.safetensors", 1 << 20)], default_name="acme/endless")

    def download_to_disk(self, resolved, dest: Path, progress, cancel, *, token, endpoint) -> None:
        (dest / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
        progress("adapter_model.safetensors", 1000, 1 << 20)
        cancel.wait(30)
        self.stopped.set()
        raise PullCancelled("the pull was cancelled")


def test_a_pull_cancelled_mid_download_ends_quietly_and_installs_nothing(tmp_path):
    store = Store(tmp_path / "adapters")
    source = EndlessSource()
    puller = Puller(store, [source], validate=lambda folder, force: None)
    unhandled: list[str] = []

    async def main() -> list[str]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context["message"]))
        stages: list[str] = []
        downloading = asyncio.Event()

        async def client():
            async with contextlib.aclosing(puller.pull("endless://acme/endless")) as events:
                async for event in events:
                    stages.append(event.stage)
                    if event.stage == "downloading" and event.done:
                        downloading.set()

        task = asyncio.create_task(client())
        await asyncio.wait_for(downloading.wait(), 30)
        task.cancel()  # what grpclib does when the CLI's stream goes away
        with contextlib.suppress(asyncio.CancelledError):
            await task
        del task
        gc.collect()  # a never-retrieved exception is reported when its future is collected
        await asyncio.sleep(0.1)
        return stages

    stages = asyncio.run(main())
    assert "downloading" in stages and "done" not in stages
    assert source.stopped.is_set(), "the download did not see the cancel"
    assert unhandled == [], unhandled
    assert list(store.tmp.iterdir()) == [] and not (store.root / "acme").exists()
