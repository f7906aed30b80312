"""How a profile's and a merge's names are read and refused (issue 60, items 7, 4, 6, 5), on the
rig (HTTP on; its Hub is unreachable, so a Hub pull fails at once with exit 7):

- a weight is written ``=WEIGHT``, spaces around it allowed; ``:0.7`` is refused saying so;
- ``PARAMETER num_ctx`` over the context in force is refused (not clipped), naming the line;
- an ADAPTER that looks like a stored name and is close to one is refused with "did you mean",
  never pulled from the Hub; written as ``hf://`` (or with no close match) it is a Hub ref;
- close matches name profiles too (``run``, ``show``, ``rm``, a merge, the HTTP 404s), and a
  merge of a profile says that it is one and what a merge takes;
- a wrong FROM is answered with the name the daemon was started with (``--model tiny``).
"""

from __future__ import annotations

import json

import httpx
import pytest

ADAPTERS = ("sql-expert/v1", "poet/v1")


@pytest.fixture(scope="module")
def named(rig, tmp_path_factory):
    """The rig with the profile sql-pirate (two weighted adapters: it runs sql-pirate-merged)."""
    rig.pull(*ADAPTERS)
    base = json.loads(rig.ok("status", "--json").stdout)["engine"]["model_name"]
    folder = tmp_path_factory.mktemp("names")
    (folder / "Modelfile").write_text(f"FROM {base}\nADAPTER sql-expert/v1=0.7\nADAPTER poet/v1=0.3\n")
    rig.ok("create", "sql-pirate", "-f", str(folder / "Modelfile"))
    return rig, base, folder


def _create(named, name: str, text: str):
    rig, base, folder = named
    path = folder / f"{name}.Modelfile"
    path.write_text(text.replace("BASE", base))
    return rig.cli("create", name, "-f", str(path))


def _names(rig) -> set[str]:
    return {a["name"] for a in json.loads(rig.ok("ls", "--json").stdout)}


# -- item 7: weights ------------------------------------------------------------------------------
def test_a_colon_weight_is_refused_saying_write_equals(named):
    done = _create(named, "colon", "FROM BASE\nADAPTER sql-expert/v1:0.7\n")
    assert done.returncode == 2, done.stderr
    assert "Modelfile line 2: ADAPTER 'sql-expert/v1:0.7' is neither a stored adapter, a folder nor a Hub ref" \
        in done.stderr
    assert "A weight is written with '=': ADAPTER sql-expert/v1=0.7." in done.stderr


def test_spaces_around_the_equals_sign_are_taken(named):
    rig = named[0]
    done = _create(named, "spaced", "FROM BASE\nADAPTER sql-expert/v1 = 0.7\n")
    assert done.returncode == 0, done.stderr
    shown = json.loads(rig.ok("show", "spaced", "--json").stdout)
    assert shown["profile"]["adapters"] == [{"name": "sql-expert/v1", "weight": 0.7}], shown
    rig.ok("rm", "spaced")
    rig.cli("rm", "spaced-merged")   # where the profile's removal left its merge


def test_a_weight_that_is_no_number_is_refused_as_one(named):
    done = _create(named, "seven", "FROM BASE\nADAPTER sql-expert/v1=seven\n")
    assert done.returncode == 2 and "Modelfile line 2: adapter weight 'seven' is not a number" in done.stderr, \
        done.stderr


def test_a_merge_with_a_colon_weight_says_write_equals(named):
    done = named[0].cli("merge", "colon/v1", "sql-expert/v1:0.7")
    assert done.returncode == 2 and "invalid adapter name 'sql-expert/v1:0.7'" in done.stderr, done.stderr
    assert "A weight is written with '=': sql-expert/v1=0.7." in done.stderr


def test_num_ctx_over_the_context_is_refused_not_clipped(named):
    done = _create(named, "wide", "FROM BASE\n# the context is 1024 tokens\nPARAMETER num_ctx 99999\n")
    assert done.returncode == 2, done.stderr
    assert "Modelfile line 3: PARAMETER num_ctx 99999 is larger than the context in force (1024 tokens); " \
           "refused, not clipped" in done.stderr
    assert "PARAMETER num_ctx 1024" in done.stderr
    assert _create(named, "fits", "FROM BASE\nPARAMETER num_ctx 1024\n").returncode == 0
    named[0].ok("rm", "fits")


@pytest.mark.parametrize("line", ["PARAMETER temperature -3", "PARAMETER top_p 7", "PARAMETER top_k -100",
                                  "PARAMETER seed 1e29", 'PARAMETER stop ""', "PARAMETER num_predict 1000000000000",
                                  'TEMPLATE "{{ foo"'])
def test_values_every_request_refuses_are_refused_at_create(named, line):
    """Item 22, through the CLI and the daemon: refused by its line, nothing created."""
    done = _create(named, "bounded", f"FROM BASE\n{line}\n")
    assert done.returncode == 2 and "Modelfile line 2: " in done.stderr, done.stderr
    assert "bounded" not in _names(named[0])


# -- item 4: a typo is no Hub pull ---------------------------------------------------------------
def test_a_typo_of_a_stored_name_is_refused_not_pulled(named):
    rig = named[0]
    before = _names(rig)
    done = _create(named, "typo", "FROM BASE\nADAPTER sql-exprt/v1=0.7\n")
    assert done.returncode == 4, done.stderr
    assert "Modelfile line 2: ADAPTER 'sql-exprt/v1' is not a stored adapter" in done.stderr
    assert "Did you mean 'sql-expert/v1'" in done.stderr and "ADAPTER hf://sql-exprt/v1" in done.stderr
    assert "Hub" not in done.stderr.splitlines()[0]
    assert _names(rig) == before


def test_a_typo_of_a_profile_in_an_adapter_line_names_the_profile(named):
    rig = named[0]
    before = _names(rig)
    done = _create(named, "typo2", "FROM BASE\nADAPTER sql-pirat=0.7\n")
    assert done.returncode == 4, done.stderr
    assert "Modelfile line 2: ADAPTER 'sql-pirat' is not a stored adapter" in done.stderr, done.stderr
    assert "Did you mean the profile 'sql-pirate' (FROM sql-pirate)" in done.stderr, done.stderr
    assert _names(rig) == before


@pytest.mark.parametrize("ref", ["hf://sql-exprt/v1", "acme/some-unrelated-lora"])
def test_a_hub_ref_written_as_one_or_with_no_close_match_is_pulled(named, ref):
    done = _create(named, "hubbed", f"FROM BASE\nADAPTER {ref}\n")
    assert done.returncode == 7 and "Hub" in done.stderr, done.stderr   # the rig's Hub is unreachable


# -- item 6: close matches name profiles ---------------------------------------------------------
def test_run_suggests_the_profile(named):
    done = named[0].cli("run", "--lora", "sql-pirat", "-n", "1", "hi")
    assert done.returncode == 4, done.stderr
    assert "Did you mean 'sql-pirate'" in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["show", "sql-pirat"], ["rm", "sql-pirat"], ["merge", "x/v1", "sql-pirat=0.5"]])
def test_show_rm_and_merge_of_a_misspelt_profile_suggest_it(named, command):
    done = named[0].cli(*command)
    assert done.returncode == 4, done.stderr
    assert "'sql-pirate' (a profile)" in done.stderr and "Pull it first" not in done.stderr, done.stderr


def test_a_merge_of_a_profile_says_it_is_one_and_what_a_merge_takes(named):
    done = named[0].cli("merge", "x/v1", "sql-pirate=0.5")
    assert done.returncode == 2, done.stderr
    assert "'sql-pirate' is a profile, not an adapter: a merge takes stored adapters" in done.stderr
    assert "sql-pirate-merged" in done.stderr and "x/v1" not in _names(named[0])


def test_the_http_404s_name_the_profile(named):
    rig = named[0]
    openai = httpx.post(f"{rig.http}/v1/chat/completions", timeout=60,
                        json={"model": "sql-pirat", "messages": [{"role": "user", "content": "hi"}]})
    assert openai.status_code == 404 and "Close matches: sql-pirate" in openai.json()["error"]["message"], openai.text
    ollama = httpx.post(f"{rig.http}/api/chat", timeout=60,
                        json={"model": "sql-pirat", "messages": [{"role": "user", "content": "hi"}]})
    assert ollama.status_code == 404 and "close matches: sql-pirate" in ollama.json()["error"], ollama.text


# -- item 5: the wrong FROM's hint names the daemon's --model --------------------------------------
def test_a_wrong_from_is_told_the_model_argument(named):
    done = _create(named, "wrong-from", "FROM demo\n")
    assert done.returncode == 2, done.stderr
    assert "This daemon serves tiny: FROM that" in done.stderr, done.stderr
