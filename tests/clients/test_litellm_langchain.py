"""litellm and langchain-openai against ``serve.py``'s app on a real port (tiny model): each library's plain default
call, a call with ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, and a streamed one with them.

The libraries live in their own virtualenv (``make clients``, outside the checkout like vLLM's: their dependency trees
stay out of ``constraints.txt``), so each library's calls run as a script (``litellm_calls.py``, ``langchain_calls.py``
beside this file) with that virtualenv's python, from a folder outside the checkout, as a user's project would run them.
The scripts' environment routes every other host through a closed proxy port: the calls must not need the network
(litellm reads its bundled model-cost map, ``LITELLM_LOCAL_MODEL_COST_MAP``). Without the virtualenv the tests are
skipped with the reason.

That the penalties reached the sampler is read on the server's side: each call's recorded turn (found by its prompt
through the admin API) carries the values in ``sampling``, is one the learner leaves out
(``learner.samples.sampled_with_penalties``: skip reason ``sampling_penalties``), and its greedy output is the biased
token only (``logit_bias`` +100), which it would not be had the bias been dropped. The plain calls' turns carry none.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from learner.samples import sampled_with_penalties

HERE = Path(__file__).resolve().parent
ADMIN = "clients-admin"
MODEL = "tiny"
MAX_TOKENS = 12  # the server's default completion length (--default-max-tokens): the plain calls send none
LIBRARIES = ("litellm", "langchain")
CALLS = ("penalized", "plain", "streamed")


def clients_venv() -> Path:
    """Where ``make clients`` installs litellm and langchain-openai: ``$LOOPWISE_CLIENTS_VENV``, else ``~/.cache/loopwise/clients``."""
    return Path(os.environ.get("LOOPWISE_CLIENTS_VENV") or Path.home() / ".cache" / "loopwise" / "clients").expanduser()


def skip_reason() -> str | None:
    venv = clients_venv()
    if not (venv / "bin" / "python").exists() or not any(venv.glob(".installed-*")):
        return f"litellm and langchain-openai are not installed at {venv} (`make clients` installs them; `make test-clients` runs these tests)"
    return None


pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--admin-key", ADMIN, "--default-max-tokens", str(MAX_TOKENS))


@pytest.fixture(scope="module")
def word_id(tiny_model_path: Path) -> int:
    """An ordinary (non-special, alphabetic) token of the tiny model's vocabulary: the one the calls bias to +100."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    special = set(tok.all_special_ids)
    return next(i for i in range(100, len(tok)) if i not in special and tok.decode([i]).strip().isalpha())


def prompt(library: str, call: str) -> str:
    return f"[{library} {call}] Tell me something about the weather."


def offline_env() -> dict[str, str]:
    """The test's environment for the scripts, less PYTHONPATH and the OpenAI and proxy variables, with every host but
    this machine's routed to a closed port (a call that reaches out fails at once instead of hanging)."""
    drop = {"PYTHONPATH", "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_BASE", "ALL_PROXY", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"}
    env = {k: v for k, v in os.environ.items() if k.upper() not in drop}
    closed = "http://127.0.0.1:9"
    env |= {"HTTP_PROXY": closed, "HTTPS_PROXY": closed, "NO_PROXY": "127.0.0.1,localhost", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return env


def run_script(library: str, server: Any, word_id: int, cwd: Path) -> dict[str, Any]:
    spec = {"prompts": {c: prompt(library, c) for c in CALLS}, "logit_bias": {str(word_id): 100}}
    python = clients_venv() / "bin" / "python"
    script = HERE / f"{library}_calls.py"
    p = subprocess.run(
        [str(python), str(script), server.url, MODEL, json.dumps(spec)], cwd=cwd, env=offline_env(), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    out["stderr"] = p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def replies(server: Any, word_id: int, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``replies(library, call)`` → the reply text of that call; each library's script runs once for the module (a call
    that raised, a non-200 included, fails here with the library's error)."""
    done: dict[str, dict[str, Any]] = {}

    def reply(library: str, call: str) -> str:
        if library not in done:
            done[library] = run_script(library, server, word_id, tmp_path_factory.mktemp(f"{library}-project"))
        out = done[library]
        result = out["calls"][call]
        assert "error" not in result, f"{library} {out['version']}, {call} call: {result['error']}\n{out['stderr']}"
        return str(result["content"])

    return reply


def text_of(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def recorded_turns(server: Any) -> dict[str, dict[str, Any]]:
    """Every recorded turn of the module's server, by the text of the last user message it answered."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(server.base_url + "/admin/trajectories", params={"limit": 1000}, headers=headers, timeout=30)
    assert listed.status_code == 200, listed.text
    turns: dict[str, dict[str, Any]] = {}
    for row in listed.json()["data"]:
        r = httpx.get(server.base_url + f"/admin/trajectories/{row['trajectory_id']}", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        for turn in r.json()["turns"]:
            users = [m for m in turn["messages"] if m.get("role") == "user"]
            if users:
                turns[text_of(users[-1].get("content"))] = turn
    return turns


@pytest.mark.parametrize("library", LIBRARIES)
def test_penalties_and_logit_bias_reach_the_sampler(server, replies, word_id, library) -> None:
    """The non-streamed and the streamed call with penalties: 200 (the script raised nothing), a reply, and the server
    sampled under what was sent."""
    contents = {call: replies(library, call) for call in ("penalized", "streamed")}  # the script runs first
    turns = recorded_turns(server)
    for call, content in contents.items():
        turn = turns.get(prompt(library, call))
        assert turn is not None, f"no recorded turn for {library}'s {call} call (recorded: {sorted(turns)})"
        s = turn["sampling"]
        assert (s["presence_penalty"], s["frequency_penalty"], s["logit_bias"]) == (0.5, 0.5, {str(word_id): 100.0}), (library, call, s)
        assert sampled_with_penalties(s), s  # what the learner reads: the turn is kept out of training (sampling_penalties)
        # greedy under a +100 bias: the biased token every time; without the bias the tiny model says something else
        assert turn["output_ids"] == [word_id] * MAX_TOKENS, (library, call, turn["output_ids"])
        assert turn["finish_reason"] == "length"
        assert content.strip() and content.strip() == turn["output_text"].strip(), (library, call, content, turn["output_text"])


@pytest.mark.parametrize("library", LIBRARIES)
def test_plain_default_call(server, replies, library) -> None:
    """The library's call with nothing but the model and a message: a reply, recorded without penalties (so it trains)."""
    content = replies(library, "plain")
    assert content, f"{library}: empty reply"
    turn = recorded_turns(server).get(prompt(library, "plain"))
    assert turn is not None, f"no recorded turn for {library}'s plain call"
    s = turn["sampling"]
    assert (s["presence_penalty"], s["frequency_penalty"], s["logit_bias"]) == (0.0, 0.0, None), s
    assert not sampled_with_penalties(s)
    assert turn["output_ids"] and turn["finish_reason"] in ("stop", "length")


def test_litellm_embedding_default_call(replies) -> None:
    """``litellm.embedding`` with nothing but the model and the input sends ``"encoding_format": null``: a unit vector of
    floats comes back (it was a 400: the server refused the null)."""
    vector = json.loads(replies("litellm", "embedding"))
    assert len(vector) > 0 and all(isinstance(x, float) for x in vector)
    assert abs(sum(x * x for x in vector) - 1) < 1e-4
