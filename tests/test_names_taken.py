"""Issue 60 (what a new user and an attacker found): names that are taken.

- item 1: a merge, a create, a copy and a pull of another source onto a taken name refuse,
  naming what holds it, unless ``--force``; a new revision of the same source (the same folder,
  the same merge) stays a plain update; HTTP ``/api/create`` and ``/api/copy`` refuse too, in
  Ollama's error shape;
- item 15: one name space: a name is an adapter or a profile, and every command that makes a
  name refuses one the other kind holds;
- item 3: ``rm`` of an adapter a weighted profile was made of is refused without ``--force``; a
  weighted profile's merged adapter is its own: listed with it (not in ``ls``'s adapters, nor
  ``/api/tags`` or ``/v1/models``), copied with it and removed with it;
- item 14: a namespaced Ollama name keeps its tag;
- item 21: ``/api/delete`` of a profile; names too long are a 400 with a hint, everywhere.

Every refusal is checked against the daemon's state after it: nothing lost, nothing left behind.
All on the session's rig (HTTP on), under names of their own (``tk-...``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from adapter_factory import good


def _state(rig) -> dict:
    """What the daemon holds: every name ``ls`` lists (with its revision, or its profile's
    Modelfile) and every name on disk (store links and profile files)."""
    listed = {a["name"]: a.get("revision") or (a.get("profile") or {}).get("modelfile")
              for a in json.loads(rig.ok("ls", "--json").stdout)}
    store = rig.root / "adapters"
    on_disk = {str(p.relative_to(store)) for p in store.glob("*") if not p.name.startswith(".") and p.is_symlink()}
    on_disk |= {str(p.relative_to(store)) for p in store.glob("*/*") if p.is_symlink()}
    on_disk |= {"profile:" + str(p.relative_to(store / ".profiles"))[:-5] for p in (store / ".profiles").rglob("*.json")
                if not p.name.startswith(".")}
    return {"listed": listed, "disk": on_disk}


def _refused(rig, *args: str, needles: tuple[str, ...]) -> str:
    """Run ``args``, which must fail with a one-line error naming each of ``needles``; the
    daemon's state must be as it was."""
    before = _state(rig)
    result = rig.cli(*args)
    assert result.returncode != 0, (args, result.stdout)
    for needle in needles:
        assert needle in result.stderr, (args, needle, result.stderr)
    assert _state(rig) == before, args
    return result.stderr


def _show(rig, name: str) -> dict:
    return json.loads(rig.ok("show", name, "--json").stdout)


@pytest.fixture(scope="module")
def taken(rig, demo, tmp_path_factory):
    """tk-pirate/v1 (the poet, pulled from a folder), tk-sql/v1 and tk-pirate/v2, the merge's sources."""
    folders = tmp_path_factory.mktemp("taken")
    poet = folders / "poet"
    shutil.copytree(demo / "adapters" / "poet" / "v1", poet)
    rig.ok("pull", str(poet), "--name", "tk-pirate/v1")
    rig.ok("pull", str(demo / "adapters" / "sql-expert" / "v1"), "--name", "tk-sql/v1")
    rig.ok("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "tk-pirate/v2")
    return rig, folders, poet


def test_a_merge_onto_a_pulled_adapter_is_refused_unless_forced_and_the_same_merge_again_updates(taken):
    rig, _, poet = taken
    pulled = _show(rig, "tk-pirate/v1")
    assert pulled["source"] == "local" and pulled["ref"] == str(poet)
    # The command: it replaced the pulled adapter, with no word.
    stderr = _refused(rig, "merge", "tk-pirate/v1", "tk-sql/v1=0.5", "tk-pirate/v2=0.5",
                      needles=("'tk-pirate/v1' is taken", f"pulled from {poet}", "--force"))
    assert len(stderr.strip().splitlines()) <= 2, stderr   # one line, and its hint
    assert _show(rig, "tk-pirate/v1")["revision"] == pulled["revision"]
    rig.ok("merge", "tk-pirate/v1", "tk-sql/v1=0.5", "tk-pirate/v2=0.5", "--force")
    merged = _show(rig, "tk-pirate/v1")
    assert merged["source"] == "merge" and merged["revision"] != pulled["revision"], merged
    assert re.search(r"^source\s+merge ", rig.ok("show", "tk-pirate/v1").stdout, re.M)
    # The same merge again (in another order) is an update of the same source: no --force needed.
    again = rig.ok("merge", "tk-pirate/v1", "tk-pirate/v2=0.5", "tk-sql/v1=0.5")
    assert _show(rig, "tk-pirate/v1")["revision"] == merged["revision"], again.stdout
    # Other weights make another adapter: refused, naming the merge the name holds.
    _refused(rig, "merge", "tk-pirate/v1", "tk-sql/v1=0.7", "tk-pirate/v2=0.3",
             needles=("'tk-pirate/v1' is taken", "the merge of"))
    # A pull of a folder onto the merge's name: another source, refused as well.
    _refused(rig, "pull", str(poet), "--name", "tk-pirate/v1", needles=("'tk-pirate/v1' is taken", "the merge of"))


def test_a_pull_of_another_source_is_refused_unless_forced_and_a_new_revision_updates(taken, demo):
    rig, folders, _ = taken
    folder = good(demo, folders / "fresh", name="tk-one")
    rig.ok("pull", str(folder), "--name", "tk-rev/v1")
    first = _show(rig, "tk-rev/v1")
    # The same folder again: up to date; with new content: a new revision, a plain update.
    assert "up to date" in rig.ok("pull", str(folder), "--name", "tk-rev/v1").stdout
    good(demo, folder, name="tk-two")
    rig.ok("pull", str(folder), "--name", "tk-rev/v1")
    second = _show(rig, "tk-rev/v1")
    assert second["revision"] != first["revision"] and second["ref"] == str(folder)
    # Another folder onto it: refused, naming where the name's adapter came from; --force replaces.
    other = demo / "adapters" / "sql-expert" / "v1"
    _refused(rig, "pull", str(other), "--name", "tk-rev/v1", needles=("'tk-rev/v1' is taken", f"pulled from {folder}"))
    rig.ok("pull", str(other), "--name", "tk-rev/v1", "--force")
    assert _show(rig, "tk-rev/v1")["ref"] == str(other)


def test_a_copy_onto_a_taken_name_is_refused_unless_forced(taken):
    rig, _, _ = taken
    sql = _show(rig, "tk-sql/v1")
    _refused(rig, "cp", "tk-sql/v1", "tk-pirate/v2", needles=("'tk-pirate/v2' is taken", "pulled from", "--force"))
    rig.ok("cp", "tk-sql/v1", "tk-pirate/v2", "--force")
    copied = _show(rig, "tk-pirate/v2")
    assert [f["sha256"] for f in copied["files"]] == [f["sha256"] for f in sql["files"]]
    assert _show(rig, "tk-sql/v1")["revision"] == sql["revision"]   # the source is as it was


def test_a_create_onto_a_profile_made_otherwise_is_refused_unless_forced(taken):
    rig, _, _ = taken
    rig.ok("create", "tk-prof", "--from", "tk-sql/v1", "--system", "one")
    # The same Modelfile again is an update (what show --modelfile's hint to recreate relies on).
    rig.ok("create", "tk-prof", "--from", "tk-sql/v1", "--system", "one")
    _refused(rig, "create", "tk-prof", "--from", "tk-sql/v1", "--system", "two",
             needles=("'tk-prof' is taken", "a profile", "--force"))
    assert _show(rig, "tk-prof")["profile"]["system"] == "one"
    rig.ok("create", "tk-prof", "--from", "tk-sql/v1", "--system", "two", "--force")
    assert _show(rig, "tk-prof")["profile"]["system"] == "two"
    # A profile copied onto a taken profile, likewise.
    rig.ok("create", "tk-prof2", "--from", "tk-sql/v1", "--system", "three")
    _refused(rig, "cp", "tk-prof", "tk-prof2", needles=("'tk-prof2' is taken", "--force"))
    rig.ok("cp", "tk-prof", "tk-prof2", "--force")
    assert _show(rig, "tk-prof2")["profile"]["system"] == "two"


def test_ollamas_create_and_copy_refuse_a_taken_name_in_ollamas_shape(taken):
    rig, _, _ = taken
    rig.ok("create", "tk-web", "--from", "tk-sql/v1", "--system", "web")
    before = _state(rig)
    created = httpx.post(f"{rig.http}/api/create", json={"model": "tk-web", "from": "tk-sql/v1", "system": "other"},
                         timeout=60)
    assert created.status_code == 400 and "'tk-web' is taken" in created.json()["error"], created.text
    copied = httpx.post(f"{rig.http}/api/copy", json={"source": "tk-sql:v1", "destination": "tk-pirate:v2"},
                        timeout=60)
    assert copied.status_code == 400 and "'tk-pirate/v2' is taken" in copied.json()["error"], copied.text
    assert _state(rig) == before
    # The same create again is an update, as loractl create's.
    same = httpx.post(f"{rig.http}/api/create", json={"model": "tk-web", "from": "tk-sql/v1", "system": "web"},
                      timeout=60)
    assert same.status_code == 200 and '"success"' in same.text, same.text


# -- item 15: one name space --------------------------------------------------------------------

def test_a_name_is_an_adapter_or_a_profile_and_every_command_that_makes_one_says_which(taken, demo):
    rig, _, _ = taken
    folder = str(demo / "adapters" / "poet" / "v1")
    rig.ok("create", "tk-fb", "--from", "tk-sql/v1", "--system", "hi")
    # The commands: a pull and a merge onto the profile's name both succeeded.
    _refused(rig, "pull", folder, "--name", "tk-fb", needles=("'tk-fb' is taken", "profile 'tk-fb'"))
    _refused(rig, "merge", "tk-fb", "tk-sql/v1=0.5", "tk-pirate/v2=0.5", needles=("'tk-fb' is taken", "profile"))
    _refused(rig, "merge", "tk-fb", "tk-sql/v1=0.5", "tk-pirate/v2=0.5", "--force", needles=("'tk-fb' is taken",))
    _refused(rig, "cp", "tk-sql/v1", "tk-fb", needles=("'tk-fb' is taken", "profile"))
    _refused(rig, "cp", "tk-sql/v1", "tk-fb", "--force", needles=("'tk-fb' is taken",))
    # And the other way: a profile onto an adapter's name.
    _refused(rig, "create", "tk-sql/v1", "--from", "tk-sql/v1", "--system", "hi", needles=("'tk-sql/v1' is taken",
                                                                                          "an adapter"))
    _refused(rig, "create", "tk-sql/v1", "--from", "tk-sql/v1", "--force", needles=("'tk-sql/v1' is taken",))
    _refused(rig, "cp", "tk-fb", "tk-sql/v1", "--force", needles=("'tk-sql/v1' is taken", "an adapter"))
    before = _state(rig)
    created = httpx.post(f"{rig.http}/api/create", json={"model": "tk-sql:v1", "from": "tk-sql/v1"}, timeout=60)
    assert created.status_code == 400 and "adapter" in created.json()["error"], created.text
    assert _state(rig) == before
    # Each name is listed once, and the profile is what rm removes (the adapter it runs stays).
    tags = [m["name"] for m in httpx.get(f"{rig.http}/api/tags", timeout=60).json()["models"]]
    assert len(tags) == len(set(tags)), tags
    assert "deleted tk-fb" in rig.ok("rm", "tk-fb").stdout
    assert "tk-fb" not in _state(rig)["listed"] and "tk-sql/v1" in _state(rig)["listed"]


# -- item 3: a weighted profile's merge is its own; its sources are guarded ---------------------

def test_a_weighted_profiles_merge_is_its_own_and_its_sources_are_guarded(taken):
    rig, _, _ = taken
    rig.ok("pull", str(rig.root / "tiny" / "adapters" / "sql-expert" / "v1"), "--name", "tk-src/v1")
    before = _state(rig)
    rig.ok("create", "tk-sp", "--from", "tk-pirate/v2", "--adapter", "tk-src/v1=0.7")
    shown = _show(rig, "tk-sp")
    assert shown["profile"]["adapter"] == "tk-sp-merged", shown
    assert _show(rig, "tk-sp-merged")["source"] == "merge"
    # Listed with its profile (what it runs), not as an adapter or a model of its own.
    after = _state(rig)
    assert set(after["listed"]) - set(before["listed"]) == {"tk-sp"}, after["listed"]
    assert "tk-sp-merged" in after["disk"]
    tags = {m["name"] for m in httpx.get(f"{rig.http}/api/tags", timeout=60).json()["models"]}
    assert "tk-sp:latest" in tags and not {t for t in tags if "tk-sp-merged" in t}, tags
    models = {m["id"] for m in httpx.get(f"{rig.http}/v1/models", timeout=60).json()["data"]}
    assert "tk-sp" in models and "tk-sp-merged" not in models, models
    # The rm: it printed "deleted" though the profile lists ADAPTER tk-src/v1=0.7.
    _refused(rig, "rm", "tk-src/v1", needles=("'tk-src/v1' is used by profile tk-sp", "--force"))
    _refused(rig, "rm", "tk-pirate/v2", needles=("used by profile", "tk-sp"))   # FROM it
    _refused(rig, "rm", "tk-sp-merged", needles=("used by profile tk-sp",))
    # A copy gets its own merge (removed alone); rm of a profile removes its merge with it.
    rig.ok("cp", "tk-sp", "tk-sp2")
    assert _show(rig, "tk-sp2")["profile"]["adapter"] == "tk-sp2-merged"
    assert _show(rig, "tk-sp2-merged")["revision"] == _show(rig, "tk-sp-merged")["revision"]
    rig.ok("rm", "tk-sp")
    assert "tk-sp-merged" not in _state(rig)["disk"] and "tk-sp2-merged" in _state(rig)["disk"]
    rig.ok("rm", "tk-sp2")
    assert _state(rig) == before
    # A weighted profile replaced (--force) by one that runs one adapter takes its merge along.
    rig.ok("create", "tk-sp", "--from", "tk-pirate/v2", "--adapter", "tk-src/v1=0.7")
    rig.ok("create", "tk-sp", "--from", "tk-src/v1", "--force")
    assert "tk-sp-merged" not in _state(rig)["disk"]
    rig.ok("rm", "tk-sp")
    assert _state(rig) == before


# -- item 14: a namespaced Ollama name keeps its tag ---------------------------------------------

def test_a_namespaced_ollama_name_keeps_its_tag(taken):
    rig, _, _ = taken
    before = _state(rig)
    for tag in ("v1", "v2"):
        made = httpx.post(f"{rig.http}/api/create", json={"model": f"tk-org/m:{tag}", "from": "tk-sql/v1",
                                                           "system": tag}, timeout=60)
        assert made.status_code == 200 and '"success"' in made.text, made.text
    for tag in ("v1", "v2"):
        shown = httpx.post(f"{rig.http}/api/show", json={"model": f"tk-org/m:{tag}"}, timeout=60)
        assert shown.status_code == 200 and shown.json()["system"] == tag, shown.text
    tags = [m["name"] for m in httpx.get(f"{rig.http}/api/tags", timeout=60).json()["models"]]
    assert "tk-org/m:v1" in tags and "tk-org/m:v2" in tags, tags
    # The untagged name is :latest, which neither is.
    assert httpx.post(f"{rig.http}/api/show", json={"model": "tk-org/m"}, timeout=60).status_code == 404
    assert _show(rig, "tk-org/m-v1")["profile"]["system"] == "v1"
    for tag in ("v1", "v2"):
        deleted = httpx.request("DELETE", f"{rig.http}/api/delete", json={"model": f"tk-org/m:{tag}"}, timeout=60)
        assert deleted.status_code == 200, deleted.text
    assert _state(rig) == before


# -- item 21: /api/delete of a profile; a name too long is a 400 with a hint --------------------

def test_ollamas_delete_removes_a_profile_it_lists(taken):
    rig, _, _ = taken
    before = _state(rig)
    made = httpx.post(f"{rig.http}/api/create", json={"model": "tk-bard2", "from": "tk-sql/v1", "system": "hi"},
                      timeout=60)
    assert made.status_code == 200, made.text
    assert "tk-bard2:latest" in {m["name"] for m in httpx.get(f"{rig.http}/api/tags", timeout=60).json()["models"]}
    deleted = httpx.request("DELETE", f"{rig.http}/api/delete", json={"model": "tk-bard2"}, timeout=60)
    assert deleted.status_code == 200, deleted.text
    assert _state(rig) == before


def test_a_name_too_long_is_a_400_with_a_hint_on_every_route(taken):
    rig, _, _ = taken
    long = "a" * 300
    before = _state(rig)
    routes = [("POST", "/api/generate", {"model": long, "prompt": "hi", "stream": False}),
              ("POST", "/api/chat", {"model": long, "messages": [{"role": "user", "content": "hi"}], "stream": False}),
              ("POST", "/api/create", {"model": long, "from": "tk-sql/v1"}),
              ("POST", "/api/create", {"model": "tk-long", "from": long}),
              ("POST", "/api/copy", {"source": long, "destination": "tk-long"}),
              ("POST", "/api/copy", {"source": "tk-sql/v1", "destination": long}),
              ("POST", "/api/show", {"model": long}),
              ("DELETE", "/api/delete", {"model": long}),
              ("POST", "/api/pull", {"model": long, "stream": False})]
    for method, path, payload in routes:
        answer = httpx.request(method, f"{rig.http}{path}", json=payload, timeout=60)
        assert answer.status_code == 400, (path, answer.status_code, answer.text)
        error = answer.json()
        assert "300 characters long" in error["error"] and "at most 128" in error["hint"], (path, error)
    assert _state(rig) == before
    # As the user nobody (the door's uid rule: a caller of no privilege), the same 400, not a 500.
    import subprocess
    if not (shutil.which("setpriv") and shutil.which("curl")):
        pytest.skip("setpriv and curl are needed to call as nobody")
    payload = json.dumps({"model": long, "messages": [{"role": "user", "content": "hi"}], "stream": False})
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "curl", "-s", "-o",
                          "/dev/null", "-w", "%{http_code}", "-H", "Content-Type: application/json", "-d", payload,
                          f"{rig.http}/api/chat"], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "400", (run.stdout, run.stderr)


def test_namespaced_names_map_both_ways_without_a_daemon():
    from loractld.api.ollama.create import listed_as, store_name
    from loractld.api.ollama.names import resolve

    assert [store_name(n) for n in ("org/m:v1", "Org/M:V2", "org/m", "org/m:latest", "m:v1", "m")] == \
        ["org/m-v1", "org/m-v2", "org/m", "org/m", "m/v1", "m"]
    assert [listed_as(n) for n in ("org/m:v1", "org/m", "m:v1", "m")] == ["org/m:v1", "org/m:latest", "", ""]
    stored = {"org/m-v1", "org/m-v2", "org/m"}
    for name in ("org/m:v1", "org/m:v2", "org/m:latest"):   # each listed name resolves back to its profile
        assert resolve(name, {"tiny"}, stored.__contains__).adapter == store_name(name)
    assert resolve("org/m:v3", {"tiny"}, stored.__contains__) is None
