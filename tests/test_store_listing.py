"""The store's kept listing (loractld.store.listing): ls at 10,000 adapters no longer reads every
entry per ask, and still shows every change on the next ask — hand-placed adapters added,
removed, given their config or rewritten in place, and the store's own installs and removals."""

from __future__ import annotations

import os
import shutil
import time

from loractld.store.disk import Store, WEIGHTS_FILE


def _settled(store: Store) -> list[str]:
    """The names listed once the listing is kept (its files older than listing.RACY_S): the ask
    after a change then goes through the kept listing's check, the path under test."""
    deadline = time.monotonic() + 10
    while True:
        names = [a.name for a in store.list()]
        if store._listing is not None and store._listing[1].trusted:
            return names
        assert time.monotonic() < deadline, "the listing was never kept"
        time.sleep(0.2)


def test_a_kept_listing_shows_every_change_on_the_next_ask(tmp_path, demo):
    store = Store(tmp_path / "adapters")
    source = demo / "adapters" / "poet" / "v1"
    org = store.root / "org"
    shutil.copytree(source, org / "a")
    shutil.copytree(source, org / "b")
    (org / "later").mkdir()
    assert _settled(store) == ["org/a", "org/b"]
    kept = store.list()
    assert kept[0] is store.list()[0]   # answered from the kept listing, nothing read again

    shutil.copytree(source, org / "c")                            # added by hand
    assert [a.name for a in store.list()] == ["org/a", "org/b", "org/c"]
    _settled(store)
    for name in os.listdir(source):                               # a folder given its files later
        shutil.copy(source / name, org / "later" / name)
    assert "org/later" in [a.name for a in store.list()]
    _settled(store)
    shutil.rmtree(org / "a")                                      # removed by hand
    assert [a.name for a in store.list()] == ["org/b", "org/c", "org/later"]
    _settled(store)
    before = {a.name: a.manifest["revision"] for a in store.list()}
    weights = org / "b" / WEIGHTS_FILE                            # rewritten in place, same size
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    with open(weights, "r+b") as f:
        f.write(data)
    after = {a.name: a.manifest["revision"] for a in store.list()}
    assert after["org/b"] != before["org/b"] and after["org/c"] == before["org/c"]

    _settled(store)
    kept = {a.name: a for a in store.list()}
    shutil.copytree(source, org / "d")                            # one added beside one rewritten:
    with open(org / "c" / WEIGHTS_FILE, "r+b") as f:              # the folder is read again, and
        f.seek(-1, os.SEEK_END)                                   # only the rewritten entry with it
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    listed = {a.name: a for a in store.list()}
    assert sorted(listed) == ["org/b", "org/c", "org/d", "org/later"]
    assert listed["org/c"].manifest["revision"] != kept["org/c"].manifest["revision"]
    assert listed["org/b"] is kept["org/b"] and listed["org/later"] is kept["org/later"]

    _settled(store)
    with store.staging() as staged:                               # the store's own install and rm
        shutil.copytree(source, staged, dirs_exist_ok=True)
        store.install("pulled/v1", staged, {"files": [{"name": n, "size": (staged / n).stat().st_size,
                                                       "sha256": "0" * 64} for n in os.listdir(staged)]})
    assert "pulled/v1" in [a.name for a in store.list()]
    _settled(store)
    store.remove("pulled/v1")
    assert "pulled/v1" not in [a.name for a in store.list()]



def test_a_store_write_reads_again_only_the_folder_it_changed(tmp_path, demo):
    """A pull or rm (or the registry entry written after it) lists again without reading an org
    folder it did not touch (issue 48: 10,000 hand-placed adapters read again per pull), and the
    listing still equals a fresh store's and shows hand changes anywhere on the next ask, even in
    the folder written a moment ago (racy, so read again)."""
    store = Store(tmp_path / "adapters")
    source = demo / "adapters" / "poet" / "v1"
    org = store.root / "org"
    for name in ("a", "b"):
        shutil.copytree(source, org / name)
    _settled(store)
    org_part = store._listing[1].parts[str(org)]

    def fresh() -> list[str]:
        return [a.name for a in Store(store.root).list()]

    with store.staging() as staged:
        shutil.copytree(source, staged, dirs_exist_ok=True)
        store.install("pulled/v1", staged, {"files": [{"name": n, "size": (staged / n).stat().st_size,
                                                       "sha256": "0" * 64} for n in os.listdir(staged)]})
    listed = [a.name for a in store.list()]
    assert listed == ["org/a", "org/b", "pulled/v1"] == fresh()
    assert store._listing[1].parts[str(org)] is org_part        # org/ was not read again
    shutil.copytree(source, store.root / "pulled" / "hand")     # racy folder, changed by hand
    shutil.copytree(source, org / "c")                          # the reused folder, changed by hand
    assert [a.name for a in store.list()] == ["org/a", "org/b", "org/c", "pulled/hand", "pulled/v1"] == fresh()
    _settled(store)
    org_part = store._listing[1].parts[str(org)]
    store.remove("pulled/v1")
    assert [a.name for a in store.list()] == ["org/a", "org/b", "org/c", "pulled/hand"] == fresh()
    assert store._listing[1].parts[str(org)] is org_part

def _filled(cls, depth: int = 0):
    """A message of ``cls`` with every field set (nested messages to a depth of two)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    message = cls()
    for field in cls.DESCRIPTOR.fields:
        if field.type == F.TYPE_MESSAGE:
            entry = field.message_type
            if entry.GetOptions().map_entry:
                key = "k" if entry.fields_by_name["key"].type == F.TYPE_STRING else 5
                value = entry.fields_by_name["value"]
                if value.type == F.TYPE_MESSAGE:
                    getattr(message, field.name)[key].CopyFrom(_filled(type(getattr(message, field.name)[key]), 2))
                else:
                    getattr(message, field.name)[key] = {F.TYPE_STRING: "v", F.TYPE_DOUBLE: 0.5}.get(value.type, 3)
            elif depth < 2:
                sub = _filled(type(getattr(message, field.name)) if not field.is_repeated
                              else getattr(message, field.name).add().__class__, depth + 1)
                if field.is_repeated:
                    del getattr(message, field.name)[:]
                    getattr(message, field.name).extend([sub, sub])
                else:
                    getattr(message, field.name).CopyFrom(sub)
            continue
        value = {F.TYPE_STRING: 'q"\u00e9\n', F.TYPE_BOOL: True, F.TYPE_DOUBLE: 0.1, F.TYPE_FLOAT: 0.1,
                 F.TYPE_INT64: 2 ** 40 + 1, F.TYPE_UINT64: 2 ** 40 + 1}.get(field.type, 7)
        if field.type == F.TYPE_ENUM:
            value = field.enum_type.values[-1].number
        elif field.type == F.TYPE_BYTES:
            value = b"\x00\xff"
        if field.is_repeated:
            getattr(message, field.name).extend([value, value])
        else:
            setattr(message, field.name, value)
    return message


def test_every_reply_decodes_and_prints_as_json_format_and_json_dumps_do():
    """The CLI's field-by-field decoding, its JSON writer and ls --json's messages-to-text (at 10,000
    adapters) give what protobuf's json_format and json.dumps(indent=2, sort_keys=True) give, for
    every message (or leave it to them: None)."""
    import json

    from loractl.cli._output import dumps_indented
    from loractl.message_json import messages_json
    from loractl.messages import slow_to_dict, to_dict
    from loractl.v1 import loractl_pb2 as pb

    for name in pb.DESCRIPTOR.message_types_by_name:
        for message in (getattr(pb, name)(), _filled(getattr(pb, name))):
            assert to_dict(message) == slow_to_dict(message), name
            data = to_dict(message)
            assert dumps_indented(data) == json.dumps(data, indent=2, sort_keys=True), name
            assert messages_json([message, message]) in (None, dumps_indented([data, data])), name
    assert messages_json(pb.ListReply(adapters=[_filled(pb.Adapter)] * 2).adapters) is not None   # ls's own path


def test_a_listing_reply_from_kept_bytes_is_the_reply_made_afresh():
    """ListedMessages joins each adapter's bytes made once from its manifest's view with the
    bytes of the fields its listing's copy changed (and keeps each one's ls --json text); decoded,
    that is the message made afresh (the text: the CLI's text of it) —
    for fields set to other values, to their proto default (slot 0: not encoded, so the whole
    message is made instead), a list changed, a view with no base, and on later asks with some
    bases kept and one replaced."""
    from loractl.message_json import message_json, messages_json
    from loractl.v1 import loractl_pb2 as pb
    from loractld.api.grpc_service import ListedMessages, adapter_message
    from loractld.api.listed_text import ListedText
    from loractld.views import AdapterView, MergeView

    def base(i: int) -> AdapterView:
        return AdapterView(name=f"org/a{i}", source="local", rank=4, alpha=8.0, target_modules=["q_proj"],
                           size_bytes=1000 + i, files=[{"name": "w", "size": 10, "sha256": "ab" * 32}],
                           path=f"/s/a{i}", merge=MergeView(method="cat", rank=8) if i == 3 else None)

    def listing(bases: list[AdapterView]) -> list[AdapterView]:
        views = [b.copy() for b in bases]
        views[1].tier, views[1].slot, views[1].requests, views[1].last_used = "device", 1, 5, 12.5
        views[2].tier, views[2].slot, views[2].pin, views[2].pinned = "device", 0, "device", True   # slot 0: a default
        views[3].state, views[3].error = "failed", "bad (fix it)"
        views[4].normalized = ["renamed"]                                                       # a list changed
        return views + [base(9)]                                                                # no base

    bases, listed = [base(i) for i in range(6)], ListedMessages()
    as_text = ListedText(lambda view: message_json(adapter_message(view)))
    for ask in range(3):
        if ask == 2:
            bases[0] = base(0)   # its store entry changed: a new view, its bytes made again
            bases[0].rank = 16
        views = listing(bases)
        reply = listed.reply(views)
        assert reply == pb.ListReply(adapters=[adapter_message(v) for v in views]), ask
        # ls --json's text, from texts kept per base the same way: as the CLI writes it afresh.
        assert as_text.reply(views).decode() == messages_json(reply.adapters), ask
        assert reply.adapters[2].slot == 0 and reply.adapters[0].rank == (16 if ask == 2 else 4)


def test_ls_text_kept_between_listings_is_the_text_written_afresh():
    """ListedText reuses spans of the last listing's text for unchanged copies of the same base
    views: over listings that add, drop, reorder, replace and change entries, repeat themselves
    (the same object back) and empty out, its text is each view's text written afresh, joined."""
    import random

    from loractl.message_json import list_json, message_json
    from loractld.api.grpc_service import adapter_message
    from loractld.api.listed_text import ListedText
    from loractld.views import AdapterView

    def write(view: AdapterView) -> str:
        return message_json(adapter_message(view))

    def base(i: int) -> AdapterView:
        return AdapterView(name=f"org/a{i}", rank=4 + i, path=f"/s/a{i}", files=[{"name": "w", "size": i, "sha256": ""}])

    rng, listed = random.Random(48), ListedText(write)
    bases = {i: base(i) for i in range(12)}
    last = None
    for ask in range(60):
        if ask % 7 == 3:
            bases[rng.randrange(12)] = base(rng.randrange(12))   # an entry replaced: a new base view
        if ask % 10 == 9:
            views = []
        elif last is not None and ask % 5 == 4:
            views = [v.base.copy() for v in last if v.changes() is not None]   # the last entries, unchanged
        else:
            chosen = sorted(rng.sample(sorted(bases), rng.randrange(1, 12)))
            if rng.random() < 0.3:
                rng.shuffle(chosen)
            views = [bases[i].copy() for i in chosen]
            for view in views:
                if rng.random() < 0.2:
                    view.tier, view.requests = "host", rng.randrange(1, 9)   # changed: written afresh
            if rng.random() < 0.2:
                views.append(base(99))                                       # no base
        text = listed.reply(views)
        assert text.decode() == list_json([write(v) for v in views]), ask
        if ask % 5 == 4 and views:
            again = [v.base.copy() for v in views]
            assert listed.reply(again) is text, ask   # the same listing again: the same object
        last = views
    assert listed.reply([]) == b"[]"


def test_garbage_collection_keeps_every_linked_object(tmp_path, demo):
    """collect_garbage finds what names link to by a walk of names (no listing: after a pull or
    rm the kept listing is void, and reading 10,000 entries again made pull number 10,001 ten
    times the first): objects linked at the top and under an org folder stay, an unlinked one goes."""
    store = Store(tmp_path / "adapters")
    source = demo / "adapters" / "poet" / "v1"
    shutil.copytree(source, store.root / "org" / "by-hand")
    installed = []
    for name in ("top", "org/pulled"):
        with store.staging() as staged:
            shutil.copytree(source, staged, dirs_exist_ok=True)
            installed.append(store.install(name, staged, {"files": [
                {"name": n, "size": (staged / n).stat().st_size, "sha256": "0" * 64} for n in os.listdir(staged)]}))
    orphan = store.objects / "1-orphan"
    orphan.mkdir()
    assert store.collect_garbage() == [str(orphan)]
    assert all(a.path.is_dir() for a in installed) and (store.root / "org" / "by-hand").is_dir()


def test_a_hand_placed_adapter_written_just_now_makes_its_folder_untrusted(tmp_path):
    # Its files' ctimes are read from their packed stats: a file rewritten in place inside RACY_S
    # of the scan (which moves no folder's ctime) must make its part untrusted, read again next time.
    import time

    from loractld.store import listing

    folder = tmp_path / "org" / "fresh"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "adapter_model.safetensors").write_bytes(b"w")
    time.sleep(listing.RACY_S + 0.05)
    assert listing.scan(str(tmp_path)).parts[str(tmp_path / "org")].trusted
    (folder / "adapter_config.json").write_text('{"r": 8}')   # in place: only the file's ctime moves
    assert not listing.scan(str(tmp_path)).parts[str(tmp_path / "org")].trusted


def test_links_out_of_the_store_are_refused(tmp_path, demo):
    """A hand-placed entry is read by real paths (store/disk.py ``_read``, which keeps each
    folder's real path for the listing in progress): an adapter folder or a weights file that
    is a link out of the store is refused with a warning, the adapters beside them are listed at
    their real place, and a folder later replaced by a link out is refused at the next ask."""
    store = Store(tmp_path / "adapters")
    source = demo / "adapters" / "poet" / "v1"
    outside = tmp_path / "outside"
    shutil.copytree(source, outside / "a")
    shutil.copytree(source, store.root / "org" / "a")
    shutil.copytree(source, store.root / "org" / "b")
    (store.root / "org" / "away").symlink_to(outside / "a")           # an adapter folder out of the store
    shutil.copytree(source, store.root / "org" / "weights")
    (store.root / "org" / "weights" / WEIGHTS_FILE).unlink()
    (store.root / "org" / "weights" / WEIGHTS_FILE).symlink_to(outside / "a" / WEIGHTS_FILE)
    listed = {a.name: a for a in store.list()}
    assert sorted(listed) == ["org/a", "org/b"]
    assert listed["org/a"].path == (store.root / "org" / "a").resolve()
    assert listed["org/a"].manifest["revision"] == listed["org/b"].manifest["revision"]

    shutil.rmtree(store.root / "org" / "b")                            # replaced by a link out
    (store.root / "org" / "b").symlink_to(outside / "a")
    assert [a.name for a in store.list()] == ["org/a"]
