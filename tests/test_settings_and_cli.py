"""serve.py's flags and loopwise_settings.py: one frozen Settings from flags > env > config file > defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

import serve
from loopwise_settings import Settings
from runtime.settings import EngineSettings, ServerSettings

ROOT = Path(__file__).resolve().parent.parent

FLAGS = [
    "--model",
    "--backend",
    "--host",
    "--port",
    "--data-dir",
    "--api-key",
    "--admin-key",
    "--max-batch-size",
    "--max-queue",
    "--dtype",
    "--config",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No LOOPWISE_* variable from the outside world leaks into these tests."""
    for key in list(os.environ):
        if key.startswith("LOOPWISE_"):
            monkeypatch.delenv(key)


def test_parser_has_the_flags() -> None:
    parser = serve.build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    assert set(FLAGS) <= options
    ns = vars(parser.parse_args(["--model", "tiny", "--port", "9", "--api-key", "k1", "--api-key", "k2", "--dtype", "float32"]))
    assert ns == {"config": None, "server.model": "tiny", "server.port": "9", "server.api_keys": ["k1", "k2"], "engine.dtype": "float32"}


def test_defaults() -> None:
    s = serve.settings_from_args([])
    assert isinstance(s, Settings)
    assert isinstance(s.server, ServerSettings) and isinstance(s.engine, EngineSettings)
    assert (s.server.host, s.server.port, s.server.model, s.server.backend) == ("127.0.0.1", 8000, "default", "embedded")
    assert s.server.data_dir == Path(".data")
    assert s.server.api_keys == () and s.server.admin_key is None
    assert (s.engine.max_batch_size, s.engine.max_queue, s.engine.dtype) == (32, 256, "auto")


def test_all_flags_parse_into_typed_settings(tmp_path: Path) -> None:
    s = serve.settings_from_args(
        [
            "--model", "tiny", "--backend", "embedded", "--host", "0.0.0.0", "--port", "8123",
            "--data-dir", str(tmp_path), "--api-key", "k1", "--api-key", "k2", "--admin-key", "adm",
            "--max-batch-size", "4", "--max-queue", "0", "--dtype", "bfloat16",
        ]
    )  # fmt: skip
    assert s.server.model == "tiny"
    assert s.server.host == "0.0.0.0"
    assert s.server.port == 8123
    assert s.server.data_dir == tmp_path
    assert s.server.api_keys == ("k1", "k2")
    assert s.server.admin_key == "adm"
    assert (s.engine.max_batch_size, s.engine.max_queue, s.engine.dtype) == (4, 0, "bfloat16")


def test_settings_are_frozen() -> None:
    s = serve.settings_from_args([])
    with pytest.raises(ValidationError):
        s.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        s.engine.max_queue = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        s.engine = EngineSettings()  # type: ignore[misc]
    assert s.server.port == 8000 and s.engine.max_queue == 256


def test_env_short_name_used_without_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_PORT", "9001")
    assert serve.settings_from_args([]).server.port == 9001


def test_flag_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_PORT", "9001")
    monkeypatch.setenv("LOOPWISE_ENGINE__MAX_BATCH_SIZE", "4")
    s = serve.settings_from_args(["--port", "9002", "--max-batch-size", "2"])
    assert s.server.port == 9002
    assert s.engine.max_batch_size == 2


def test_nested_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_ENGINE__MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("LOOPWISE_SERVER__HOST", "0.0.0.0")
    s = serve.settings_from_args([])
    assert s.engine.max_batch_size == 4
    assert s.server.host == "0.0.0.0"
    assert s.engine.max_queue == 256  # untouched fields keep their defaults


def test_api_keys_from_env_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_API_KEYS", "a,b")
    assert serve.settings_from_args([]).server.api_keys == ("a", "b")


@pytest.fixture()
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "loopwise.toml"
    path.write_text('[server]\nport = 7000\nhost = "0.0.0.0"\n\n[engine]\nmax_queue = 7\n')
    return path


def test_config_file(config_file: Path) -> None:
    s = serve.settings_from_args(["--config", str(config_file)])
    assert (s.server.port, s.server.host, s.engine.max_queue) == (7000, "0.0.0.0", 7)
    assert s.engine.max_batch_size == 32


def test_json_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"server": {"port": 7100}, "engine": {"max_batch_size": 3}}')
    s = serve.settings_from_args(["--config", str(path)])
    assert (s.server.port, s.engine.max_batch_size) == (7100, 3)


def test_flags_beat_config_file(config_file: Path) -> None:
    s = serve.settings_from_args(["--config", str(config_file), "--port", "7001", "--max-queue", "8"])
    assert (s.server.port, s.server.host, s.engine.max_queue) == (7001, "0.0.0.0", 8)


def test_env_beats_config_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_PORT", "9001")
    monkeypatch.setenv("LOOPWISE_ENGINE__MAX_QUEUE", "5")
    s = serve.settings_from_args(["--config", str(config_file)])
    assert (s.server.port, s.engine.max_queue) == (9001, 5)
    assert s.server.host == "0.0.0.0"  # not in env: the file's value


def test_config_from_env_variable(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWISE_CONFIG", str(config_file))
    s = serve.settings_from_args(["--max-queue", "9"])
    assert (s.server.port, s.engine.max_queue) == (7000, 9)


@pytest.mark.parametrize(
    ("argv", "loc"),
    [
        (["--port", "-1"], ("server", "port")),
        (["--port", "70000"], ("server", "port")),
        (["--dtype", "fp8"], ("engine", "dtype")),
        (["--max-batch-size", "0"], ("engine", "max_batch_size")),
        (["--max-queue", "-1"], ("engine", "max_queue")),
        (["--backend", "tgi"], ("server", "backend")),
    ],
)
def test_invalid_values_raise(argv: list[str], loc: tuple[str, str]) -> None:
    with pytest.raises(ValidationError) as ei:
        serve.settings_from_args(argv)
    assert tuple(ei.value.errors()[0]["loc"]) == loc


def test_engine_urls_from_flags_and_a_toml_list(tmp_path: Path) -> None:
    s = serve.settings_from_args(["--backend", "vllm", "--engine-url", "http://a:1", "--engine-url", "http://b:2"])
    assert s.engine.urls == ("http://a:1", "http://b:2")
    path = tmp_path / "replicas.toml"
    path.write_text('[server]\nbackend = "vllm"\n[engine]\nurls = ["http://a:1", "http://b:2", "http://c:3"]\n')
    assert serve.settings_from_args(["--config", str(path)]).engine.urls == ("http://a:1", "http://b:2", "http://c:3")
    with pytest.raises(ValidationError, match="--backend sglang or --backend vllm"):
        serve.settings_from_args(["--engine-url", "http://a:1"])  # the embedded engine has no URL
    with pytest.raises(ValidationError, match="one server per URL"):
        serve.settings_from_args(["--backend", "vllm", "--vllm-launch", "--vllm-replicas", "3", "--engine-url", "http://a:1"])


def test_invalid_config_file_key_raises(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[engine]\nmax_batchsize = 3\n")  # typo: extra keys are forbidden
    with pytest.raises(ValidationError):
        serve.settings_from_args(["--config", str(path)])


def test_help_subprocess_is_quick_and_lists_flags() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    for flag in FLAGS:
        assert flag + " " in proc.stdout, flag
    assert "(default: 8000)" in proc.stdout
    assert elapsed < 15  # no torch/transformers import before parsing


def test_demo_flag_sets_up_the_learning_demo_and_user_flags_win() -> None:
    from serve import demo_args, settings_from_args

    argv, demo = demo_args(["--demo", "--learner-min-trajectories", "8", "--model", "tiny"])
    assert demo and "--demo" not in argv
    s = settings_from_args(argv)
    assert s.learner.enabled and s.learner.agent == "demo-agent" and s.learner.family == "calc-lora"
    assert s.learner.min_new_trajectories == 8  # the user's flag comes after the demo's, so it wins
    [agent] = s.agents.definitions
    assert agent["name"] == "demo-agent" and agent["adapter_family"] == "calc-lora" and agent["temperature"] > 0
    assert demo_args(["--port", "1"]) == (["--port", "1"], False)
    # the demo's learner settings ship with the code and validate
    import tomllib

    from learner.config import LearnerSettings

    assert s.learner.config is not None and s.learner.config.is_file()
    demo = LearnerSettings.model_validate({"family": "calc-lora", **tomllib.loads(s.learner.config.read_text())})
    assert demo.trainer.epochs > 1 and demo.samples.settle_s < LearnerSettings(family="x").samples.settle_s
    own, _ = demo_args(["--demo", "--learner-config", "mine.toml"])
    assert str(settings_from_args(own).learner.config) == "mine.toml"


# ---- the `loopwise` console script ----------------------------------------------------------------

LOOPWISE = Path(sys.executable).with_name("loopwise")  # installed by `make install` ([project.scripts])


def loopwise(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, wherever the editable install points
    return subprocess.run([str(LOOPWISE), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_loopwise_lists_its_commands_and_refuses_unknown_ones() -> None:
    assert LOOPWISE.is_file(), "no loopwise console script: run `make install`"
    out = loopwise("--help")
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")] == list(serve.COMMANDS)
    bad = loopwise("bogus")
    assert bad.returncode == 1 and "unknown command 'bogus'" in bad.stderr


def test_loopwise_serve_is_serve_py_and_export_is_the_learners_export(tmp_path: Path) -> None:
    plain = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    served = loopwise("serve", "--help").stdout
    assert plain.stdout.startswith("usage: serve.py [-h]") and served.startswith("usage: loopwise serve [-h]")  # each names itself
    # the same flags and help: everything after the usage lines
    assert served[served.index("\n\n") :] == plain.stdout[plain.stdout.index("\n\n") :]
    bad = loopwise("serve", "--no-such-flag")
    assert bad.returncode == 2 and "loopwise serve: error: unrecognized arguments: --no-such-flag" in bad.stderr
    from learner.records import Reward
    from learner.records.store import SqliteStore, db_path
    from tests.learner.test_store import make_turn

    store = SqliteStore(db_path(tmp_path))
    store.append_turns([make_turn(1), make_turn(2, index=1, parent="turn-1")])
    store.add_reward(Reward(target="turn", target_id="turn-2", value=0.5))
    store.close()
    out = loopwise("export", "--format", "jsonl", "--data-dir", str(tmp_path), "--rewarded")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["turn_id"] for line in out.stdout.splitlines()] == ["turn-2"]
    missing = loopwise("learner", "export", "--format", "jsonl", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "no interaction store" in missing.stderr


def test_learner_jobs_from_flags_and_tables(tmp_path):
    """No jobs: the agent's learner plus the chat learner; an agent that is not served: one learner on all traffic;
    [[learner.jobs]]: exactly those, with their own traffic filters."""
    from serve import learner_jobs, settings_from_args

    default = learner_jobs(settings_from_args([]).learner, {"calc-agent"})
    assert [(j.family, j.agent) for j in default] == [("calc-lora", "calc-agent"), ("chat-lora", "")]
    assert default[1].settings == {"traffic": {"chat": True, "agents": []}} and default[1].gate_n == 0
    assert [(j.family, j.agent) for j in learner_jobs(settings_from_args([]).learner, set())] == [("calc-lora", "")]
    assert len(learner_jobs(settings_from_args(["--no-chat-learner"]).learner, {"calc-agent"})) == 1
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[learner.jobs]]\nfamily = "support-lora"\n[learner.jobs.settings.traffic]\ntags = ["support"]\n'
        '[[learner.jobs]]\nfamily = "sales-lora"\n[learner.jobs.settings.traffic]\ntags = ["sales"]\n'
    )
    jobs = learner_jobs(settings_from_args(["--config", str(cfg)]).learner, {"calc-agent"})
    assert [(j.family, j.settings["traffic"]["tags"]) for j in jobs] == [("support-lora", ["support"]), ("sales-lora", ["sales"])]
    job = '{"family": "x", "settings": {"singletons": {"mode": "drop"}}}'
    assert learner_jobs(settings_from_args(["--learner-job", job]).learner, set())[0].settings == {"singletons": {"mode": "drop"}}
    with pytest.raises(ValueError, match="distinct families"):
        settings_from_args(["--learner-job", job, "--learner-job", job])


def test_the_learner_schedule_is_declared_once_in_learner_config(capsys) -> None:
    """``python -m learner run``'s flags and the root settings' [learner] / [[learner.jobs]] fields come from ScheduleConfig."""
    import pydantic

    from learner.__main__ import build_parser, main
    from learner.config import ScheduleConfig
    from loopwise_settings import LearnerJob, LearnerProcessSettings

    args = build_parser().parse_args(["run", "--base-model", "m", "--gate-n", "3", "--poll-s", "0.5", "--agent", ""])
    assert (args.gate_n, args.poll_s, args.agent, args.min_new_trajectories, args.ab_max_samples, args.task) == (3, 0.5, "", 32, 256, None)
    flagged = {n for n, f in ScheduleConfig.model_fields.items() if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("flag")}
    assert flagged == {"agent", "task", "min_new_trajectories", "poll_s", "gate_n", "gate_tolerance", "ab_min_samples", "ab_max_samples"}
    # the model's bounds apply on the command line (before anything is loaded) and in the server's settings
    assert main(["run", "--base-model", "m", "--admin-key", "k", "--gate-n", "-1"]) == 2
    assert "gate_n" in capsys.readouterr().err
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        LearnerJob(family="f", min_new_trajectories=0)
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 2"):
        LearnerProcessSettings(ab_min_samples=1)
    ls, job = LearnerProcessSettings(), LearnerJob(family="f")
    schedule = ScheduleConfig()
    assert (ls.agent, ls.min_new_trajectories, ls.gate_n, ls.ab_min_samples, ls.ab_max_samples) == (
        schedule.agent, schedule.min_new_trajectories, schedule.gate_n, schedule.ab_min_samples, schedule.ab_max_samples,
    )  # fmt: skip
    assert (job.agent, job.min_new_trajectories) == ("", 32)  # a job trains on its [traffic] filter unless it names an agent
    assert LearnerProcessSettings.model_fields["gate_n"].description == ScheduleConfig.model_fields["gate_n"].description


def test_agents_and_memory_settings_are_their_packages_own(tmp_path: Path) -> None:
    """``[agents]`` and ``[memory]`` are ``agents.settings`` and ``memory.settings`` as declared; the longest memory text
    is one number, the store's default and the bound on an agent's memory config."""
    import inspect

    from agents.settings import AgentSettings
    from memory.config import MemoryConfig
    from memory.settings import KEEP_VERSIONS, MAX_MEMORY_CHARS, MemorySettings
    from memory.store import MemoryStore

    assert Settings.model_fields["agents"].annotation is AgentSettings
    assert Settings.model_fields["memory"].annotation is MemorySettings
    cfg = tmp_path / "c.toml"
    cfg.write_text('[memory]\nkeep_versions = 3\n[agents]\nbuiltin = false\n[[agents.definitions]]\nname = "a"\n')
    s = serve.settings_from_args(["--config", str(cfg), "--memory-max-chars", "500", "--tool", "m:f"])
    assert (s.memory.keep_versions, s.memory.max_chars) == (3, 500)
    assert (s.agents.builtin, s.agents.tools, s.agents.definitions) == (False, ("m:f",), ({"name": "a"},))
    assert serve.settings_from_args(["--agent", '{"name": "b"}']).agents.definitions == ({"name": "b"},)
    with pytest.raises(ValidationError, match="--agent must be a JSON object"):
        serve.settings_from_args(["--agent", "{"])
    store = inspect.signature(MemoryStore).parameters
    assert (store["max_chars"].default, store["keep_versions"].default) == (MAX_MEMORY_CHARS, KEEP_VERSIONS)
    assert (MemorySettings().max_chars, MemorySettings().keep_versions) == (MAX_MEMORY_CHARS, KEEP_VERSIONS)
    assert MemoryConfig(max_chars=MAX_MEMORY_CHARS).max_chars == MAX_MEMORY_CHARS
    with pytest.raises(ValidationError, match=f"less than or equal to {MAX_MEMORY_CHARS}"):
        MemoryConfig(max_chars=MAX_MEMORY_CHARS + 1)


def test_an_ab_cap_below_the_ab_minimum_fails_at_startup_naming_both(capsys) -> None:
    """``ab_max_samples`` is 0 (no cap) or at least ``ab_min_samples``: one rule (``learner.config.check_ab_bounds``) for the
    learner's schedule, the root settings' [learner] and each [[learner.jobs]] table, checked before anything starts."""
    from learner.__main__ import main as learner_main
    from learner.config import ScheduleConfig
    from loopwise_settings import LearnerJob, LearnerProcessSettings

    both = r"ab_max_samples .*= 10 must be at least ab_min_samples .*= 64"
    for build in (ScheduleConfig, LearnerProcessSettings, lambda **kw: LearnerJob(family="f", **kw)):
        with pytest.raises(ValidationError, match=both):
            build(ab_max_samples=10)
        assert build(ab_max_samples=0).ab_max_samples == 0  # no cap
        assert build(ab_min_samples=8, ab_max_samples=8).ab_max_samples == 8
    with pytest.raises(ValidationError, match=r"--learner-ab-max-samples\) = 10 must be at least ab_min_samples \(--learner-ab-min-samples\)"):
        serve.settings_from_args(["--learner-ab-max-samples", "10"])
    with pytest.raises(ValidationError, match=r"learner.jobs.0\n.*ab_max_samples = 4 must be at least ab_min_samples = 8"):
        serve.settings_from_args(["--learner-job", '{"family": "x", "ab_min_samples": 8, "ab_max_samples": 4}'])
    with pytest.raises(SystemExit, match="ab_max_samples .*must be at least ab_min_samples"):
        serve.main(["--learner-ab-min-samples", "300"])
    assert learner_main(["run", "--base-model", "m", "--admin-key", "k", "--ab-min-samples", "8", "--ab-max-samples", "4"]) == 2
    assert "ab_max_samples (--ab-max-samples) = 4 must be at least ab_min_samples (--ab-min-samples) = 8" in capsys.readouterr().err
