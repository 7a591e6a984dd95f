"""loopwise's entry point and composition root: ``python serve.py [--model default|tiny|PATH] [--port 8000] ...``.

Builds the frozen settings (flags > ``LOOPWISE_…`` env > config file > defaults), configures logging
once (``learner/logs.py``: readable lines on a terminal, JSON lines otherwise or with ``--log-format
json``), resolves the model (converting SmolLM2 on first use), builds the engine and the app, runs
uvicorn and prints where the API and the console (``/console``) are. The learner processes it starts
log in the same format, relayed through this process's stderr, and are supervised (``learner/supervisor.py``):
one that exits while the server runs is restarted with backoff (1 s doubling to 60 s), its exits and restarts
reported in ``<data-dir>/learner/<family>/supervisor.json`` (``GET /admin/learner``, ``/metrics``). Flags are
generated from the settings fields, so ``--help`` lists every setting with its description and default.

Not here: any serving logic (``runtime/``), training (``learner/``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin

import uvicorn

from agents.settings import AgentSettings
from loopwise_settings import LearnerJob, LearnerProcessSettings, Settings, load_config_file, short_env_overrides
from memory.settings import MemorySettings
from runtime.settings import (
    AdapterSettings,
    AdmissionSettings,
    EngineSettings,
    FeedbackSettings,
    RecorderSettings,
    ServerSettings,
    SGLangSettings,
    VLLMSettings,
)

if TYPE_CHECKING:
    from runtime.engine import Engine

SECTIONS: tuple[tuple[str, type[Any]], ...] = (
    ("server", ServerSettings),
    ("engine", EngineSettings),
    ("recorder", RecorderSettings),
    ("feedback", FeedbackSettings),
    ("admission", AdmissionSettings),
    ("adapters", AdapterSettings),
    ("sglang", SGLangSettings),
    ("vllm", VLLMSettings),
    ("agents", AgentSettings),
    ("learner", LearnerProcessSettings),
    ("memory", MemorySettings),
)


def build_parser() -> argparse.ArgumentParser:
    # prog: argparse's default, the name this process was started as (``serve.py``, or ``loopwise serve`` from ``cli``)
    parser = argparse.ArgumentParser(description="loopwise: OpenAI-compatible serving with an online learning loop")
    parser.add_argument("--config", type=Path, help="TOML or JSON config file: one table per section below ([server], [engine], ...)")
    parser.add_argument(
        "--demo",
        action="store_true",
        default=argparse.SUPPRESS,
        help="watch the loop learn: SmolLM2, a sampled calculator agent, synthetic users with verifier rewards, and the learner",
    )
    for section, model in SECTIONS:
        group = parser.add_argument_group(section)
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            flag = str(extra.get("flag") or "--" + name.replace("_", "-"))
            kwargs: dict[str, Any] = {"dest": f"{section}.{name}", "default": argparse.SUPPRESS}
            help_text = f"{field.description} (default: {field.default})"
            if get_origin(field.annotation) is tuple:
                kwargs["action"] = "append"
            elif field.annotation is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif get_origin(field.annotation) is not None and set(get_args(field.annotation)) <= {str} and get_args(field.annotation):
                kwargs["choices"] = get_args(field.annotation)
            group.add_argument(flag, help=help_text, **kwargs)
    return parser


def settings_from_args(argv: list[str] | None = None) -> Settings:
    args = vars(build_parser().parse_args(argv))
    args.pop("demo", None)  # handled by demo_args before parsing
    config = args.pop("config", None) or os.environ.get("LOOPWISE_CONFIG")
    file_data: dict[str, Any] = load_config_file(Path(config)) if config else {}
    data: dict[str, Any] = {"server": short_env_overrides(dict(os.environ))}
    for key, value in args.items():
        section, name = key.split(".", 1)
        data.setdefault(section, {})[name] = value
    # flags (and short env names) > LOOPWISE_* env vars > config file > defaults.
    env_settings = Settings()
    merged = {
        section: {**file_data.get(section, {}), **getattr(env_settings, section).model_dump(exclude_unset=True), **data.get(section, {})}
        for section, _ in SECTIONS
    }
    return Settings.model_validate(merged)


def learner_jobs(ls: LearnerProcessSettings, served_agents: set[str]) -> list[LearnerJob]:
    """The learner processes to start: ``[[learner.jobs]]`` when given; else the one-family flags' learner (on its agent's
    runs when that agent is served, else on all traffic) plus, next to an agent's learner, the chat learner (plain chat
    traffic, one-off prompts against a running baseline: ``learner/baseline.py``)."""
    if ls.jobs:
        return list(ls.jobs)
    agent = ls.agent if ls.agent in served_agents else ""
    if not agent:
        logging.getLogger("serve").warning(
            "learner agent %r is not served: the learner trains on all rewarded traffic, without an eval gate", ls.agent
        )
    first = LearnerJob(
        family=ls.family,
        agent=agent,
        min_new_trajectories=ls.min_new_trajectories,
        gate_n=ls.gate_n,
        ab_min_samples=ls.ab_min_samples,
        ab_max_samples=ls.ab_max_samples,
        config=ls.config,
    )
    jobs = [first]
    if agent and ls.chat and ls.chat_family != ls.family:
        jobs.append(LearnerJob(family=ls.chat_family, min_new_trajectories=16, gate_n=0, settings={"traffic": {"chat": True, "agents": []}}))
    return jobs


def start_learner(
    job: LearnerJob, settings: Settings, server: ServerSettings, model_path: Path, url: str, log_format: str
) -> subprocess.Popen[bytes]:
    """``python -m learner run`` for one job, logging into our stderr; stopped when we stop (``server``: as built, with the
    learner's internal admin key when none was given). Its supervisor calls it for every (re)start."""
    from learner import logs

    cmd = [
        sys.executable, "-m", "learner", "run",
        "--data-dir", str(server.data_dir), "--admin-url", url, "--base-model", str(model_path),
        "--family", job.family, "--agent", job.agent, "--min-new-trajectories", str(job.min_new_trajectories),
        "--gate-n", str(job.gate_n), "--ab-min-samples", str(job.ab_min_samples), "--ab-max-samples", str(job.ab_max_samples),
    ]  # fmt: skip
    if job.settings:
        tables = load_config_file(job.config) if job.config is not None else {}
        tables |= job.settings
        path = Path(server.data_dir) / "learner" / job.family / "job.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(tables))
        cmd += ["--config", str(path)]
    elif job.config is not None:
        cmd += ["--config", str(job.config)]
    if settings.adapters.adapter_root is not None:
        cmd += ["--adapter-root", str(settings.adapters.adapter_root)]
    env = {**os.environ, "LOOPWISE_ADMIN_KEY": server.admin_key or "", "LOOPWISE_LEARNER_PARENT": str(os.getpid())}
    if settings.recorder.store:
        env["LOOPWISE_STORE"] = settings.recorder.store  # in the environment, not the command line: a URL may hold a password
    # its lines in our format, relayed through our stderr (our stdout carries the announce line): a live status line stays whole
    env |= {logs.ENV_FORMAT: log_format, logs.ENV_COLORS: "1" if log_format == "console" and sys.stderr.isatty() else "0"}
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    logs.relay(proc.stdout, "learner-output")
    logging.getLogger("serve").info("learner started (pid %d) for family %s", proc.pid, job.family)
    return proc


def build_agents(agent_settings: AgentSettings, memory: Any = None) -> Any:
    """The tool registry (built-ins + ``--tool`` dotted paths) and the agents served on it (``memory``: the memory store)."""
    from agents.config import BUILTIN_AGENTS
    from agents.host import Host
    from tools.builtins import default_registry
    from tools.registry import ToolError

    try:
        tools = default_registry(extra=agent_settings.tools)
        configs = [*(BUILTIN_AGENTS if agent_settings.builtin else ()), *agent_settings.definitions]
        return Host(configs, tools, memory=memory)
    except (ToolError, ValueError) as exc:
        sys.exit(f"error: agents: {exc}")


# The demo agent answers one-operation calc_arith problems without the calculator: SmolLM2-135M never emits a
# well-formed tool call (0 of 40 sampled runs called it; 21 of 24 grammar-forced calls held malformed expressions),
# so with the tool listed it solves 4-7% and 75-100% of its groups have no reward variance to learn from.
# Without the tool it solves about 21% (sampled): enough variance for GRPO to learn from in minutes.
DEMO_AGENT = {
    "name": "demo-agent",
    "description": "The --demo agent: one-step arithmetic (calc_arith, n_ops=1, no tool), sampled (temperature 0.8).",
    "system_prompt": "You are a careful assistant. Work out the arithmetic, then give the final answer.",
    "tools": [],
    "temperature": 0.8,
    "max_turns": 1,
    "max_tokens_per_turn": 128,
    "task": "calc_arith",
    "task_options": {"n_ops": 1, "use_tools": False},
    "adapter_family": "calc-lora",
}


DEMO_LEARNER_CONFIG = Path(__file__).resolve().parent / "learner" / "demo.toml"  # step size, PPO epochs, settle time
DEMO_GROUP = 8  # runs per problem the demo users send: at ~20% success, 4 leave half the groups without reward variance, 8 a sixth


def demo_args(argv: list[str]) -> tuple[list[str], bool]:
    """``--demo``: the flags of the demo (a sampled calculator agent, the learner on it); the user's own flags win."""
    if "--demo" not in argv:
        return argv, False
    rest = [a for a in argv if a != "--demo"]
    pre = ["--agent", json.dumps(DEMO_AGENT), "--learner", "--learner-agent", "demo-agent", "--learner-family", "calc-lora"]
    pre += ["--learner-min-trajectories", "32", "--learner-gate-n", "16", "--learner-config", str(DEMO_LEARNER_CONFIG)]
    pre += ["--learner-ab-min-samples", "48", "--learner-ab-max-samples", "100", "--no-chat-learner"]
    return pre + rest, True


def secure_data_dir(data_dir: Path) -> None:
    """The data folder and what the server writes there are the server's alone: folders 0700, files 0600.

    Sets the process umask (so every file and folder created later, by this process and the learner it
    starts, is private) and tightens what an older version left world-readable at the top of the folder
    (the databases and their WAL files)."""
    os.umask(0o077)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for path in data_dir.iterdir():
        if path.is_file() and not path.is_symlink() and path.stat().st_uid == os.geteuid():
            path.chmod(0o600)


def main(argv: list[str] | None = None) -> None:
    argv, demo = demo_args(list(sys.argv[1:] if argv is None else argv))
    try:
        settings = settings_from_args(argv)
    except ValueError as exc:  # pydantic's ValidationError too: a bad flag, environment variable or key file
        sys.exit(f"error: {exc}")
    server = settings.server
    from learner.logs import configure_logging

    log_format = configure_logging(server.log_level, server.log_format, process="server")
    secure_data_dir(server.data_dir)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    built = build(settings)  # heavy imports after argument parsing, so --help is instant
    serve(settings, built, log_format, demo)


@dataclass(frozen=True)
class Built:
    """What :func:`build` composed: the app, its engine, and what ``main`` announces and hands the learner."""

    app: Any
    engine: Any
    model_id: str
    model_path: Path
    server: ServerSettings  # with the learner's internal admin key when the learner runs without --admin-key
    agents: Any
    learner_jobs: list[LearnerJob]  # the learner processes ``main`` starts once the server listens (none without --learner)


@dataclass(frozen=True)
class Stores:
    """Where this runtime keeps its state: the interaction store (None without recording, unless it is a database),
    agent memory and the stored responses (None: ``create_app``'s file in the data folder)."""

    interactions: Any
    memory: Any
    responses: Any


def open_stores(settings: Settings) -> Stores:
    """The stores ``settings`` name. With ``--store postgresql://`` all three live in that database (one pool: memory and
    responses use the interaction store's connections and migration runner), so every runtime on it shares them;
    otherwise each is a file in the data folder. An unreachable database exits here, within seconds, before the model
    loads."""
    from learner.records.store import db_path
    from learner.records.store_open import open_store
    from learner.records.store_sql import is_postgres_url
    from memory.store import MemoryStore
    from memory.store import db_path as memory_db_path

    server, mem = settings.server, settings.memory
    spec = settings.recorder.store or db_path(server.data_dir)
    if not is_postgres_url(spec):
        store = open_store(spec, synchronous_full=settings.recorder.durability == "sync") if settings.recorder.record else None
        return Stores(store, MemoryStore(memory_db_path(server.data_dir), max_chars=mem.max_chars, keep_versions=mem.keep_versions), None)
    from memory.store_pg import PostgresMemoryStore
    from runtime.api.response_store_pg import PostgresResponseStore

    try:
        store = open_store(spec, synchronous_full=settings.recorder.durability == "sync")
    except ConnectionError as exc:
        sys.exit(f"error: {exc}")
    return Stores(store, PostgresMemoryStore(store, max_chars=mem.max_chars, keep_versions=mem.keep_versions), PostgresResponseStore(store))


def build_embedded_engine(settings: Settings, model_path: Path, model_id: str, on_step: Callable[[int], None]) -> Engine:
    """The in-process engine (the default backend), from ``[engine]`` and the admission's grammar cache."""
    from runtime.engines.embedded import EmbeddedEngine

    eng = settings.engine
    return EmbeddedEngine(
        model_path,
        model_id=model_id,
        dtype=eng.dtype,
        max_batch_size=eng.max_batch_size,
        max_queue=eng.max_queue,
        max_model_len=eng.max_model_len,
        threads=eng.threads,
        prefill_chunk=eng.prefill_chunk,
        runner=eng.runner,
        on_step=on_step,
        grammar_cache_mb=settings.admission.grammar_cache_mb,
        row_share=eng.row_share,
    )


def build(settings: Settings) -> Built:
    """The composition: model, engine, recorder, memory, agents and the app, wired from ``settings``.

    No process-wide effects (logging, umask, sockets, the learner process): ``main`` does those, and the
    tests serve this same app in process."""
    server = settings.server
    stores = open_stores(settings)  # first: a database that cannot be reached fails before the model is loaded
    from runtime.app import create_app
    from runtime.engines.local_embedder import LocalEmbedder
    from runtime.metrics import Metrics
    from runtime.model_store import ModelStoreError, resolve_model

    try:
        model_path = resolve_model(server.model, server.data_dir / "models")
    except ModelStoreError as exc:
        sys.exit(f"error: {exc}")
    model_id = server.served_model_name or (
        model_path.name if server.model not in ("default", "tiny") else {"default": "SmolLM2-135M-Instruct", "tiny": "tiny"}[server.model]
    )

    holder: dict[str, Metrics] = {}
    adapter_settings = settings.adapters
    engine: Engine
    if server.backend in ("sglang", "vllm"):
        engine, adapter_settings = build_external_engine(settings, model_path, model_id)
    else:
        engine = build_embedded_engine(settings, model_path, model_id, on_step=lambda rows: holder["m"].on_step(rows))
    holder["m"] = Metrics(engine.stats)
    recorder = None
    if settings.recorder.record:
        from runtime.recorder import Recorder

        # a database server's store journals what it refuses here, in this runtime's own data folder
        journal = Path(server.data_dir) / "interactions.journal" if getattr(stores.interactions, "shared", False) else None
        recorder = Recorder(
            stores.interactions,
            durability=settings.recorder.durability,
            queue_size=settings.recorder.queue_size,
            metrics=holder["m"],
            journal=journal,
        )
    if settings.learner.enabled and not server.admin_key:
        # the learner reaches the runtime over the admin API: give it a key that only it holds
        from runtime.identity import InternalKey

        server = server.model_copy(update={"admin_key": InternalKey(secrets.token_urlsafe(24))})  # no validation: stays an InternalKey
        logging.getLogger("serve").info("the learner reaches the admin API with an internal key; pass --admin-key to use the admin API yourself")
    memory = stores.memory
    agents = build_agents(settings.agents, memory)
    jobs = learner_jobs(settings.learner, set(agents.names()) if agents is not None else set()) if settings.learner.enabled else []
    app = create_app(
        server,
        settings.engine,
        engine,
        model_id,
        metrics=holder["m"],
        recorder=recorder,
        recorder_settings=settings.recorder,
        feedback_settings=settings.feedback,
        admission_settings=settings.admission,
        adapter_settings=adapter_settings,
        agents=agents,
        learner_enabled=settings.learner.enabled,
        learner_families=[j.family for j in jobs],
        memory=memory,
        # the external backends pool nothing for a generative model: embeddings from a local CPU copy, loaded when first asked
        embedder=LocalEmbedder(model_path, engine) if server.backend in ("sglang", "vllm") else None,
        response_store=stores.responses,
    )
    return Built(app, engine, model_id, model_path, server, agents, jobs)


def serve(settings: Settings, built: Built, log_format: str, demo: bool) -> None:
    """Serve ``built.app`` with uvicorn on the configured address, announce it, start the learner (and the demo users)."""
    server, model_id, model_path = built.server, built.model_id, built.model_path
    sock = socket.socket(socket.AF_INET6 if ":" in server.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((server.host, server.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(built.app, log_config=None, timeout_graceful_shutdown=5)
    uv = uvicorn.Server(config)

    from learner.supervisor import Supervisor

    learners: list[Supervisor] = []

    async def announce_then_serve() -> None:
        serving = asyncio.create_task(uv.serve(sockets=[sock]))
        while not uv.started and not serving.done():
            await asyncio.sleep(0.05)
        if uv.started:
            print(f"loopwise serving model '{model_id}' ({model_path}) on http://{host}:{port}/v1", flush=True)
            local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            url = f"http://{'[' + local + ']' if ':' in local else local}:{port}"
            print(console_line(url, server.admin_key, with_key=sys.stdout.isatty()), flush=True)
            for job in built.learner_jobs:
                sup = Supervisor(
                    job.family,
                    partial(start_learner, job, settings, server, model_path, url, log_format),
                    Path(server.data_dir) / "learner" / job.family,
                    stopping=lambda: bool(uv.should_exit),
                )
                sup.start()
                learners.append(sup)
            if demo:
                from experiments.demo_users import DemoUsers

                print("demo: synthetic users send one-step calc_arith problems to demo-agent; the learner trains calc-lora on them", flush=True)
                DemoUsers(url, server.admin_key or "", "demo-agent", "calc_arith", group=DEMO_GROUP, live=log_format == "console").start()
        await serving

    try:
        asyncio.run(announce_then_serve())
    finally:
        for sup in learners:
            sup.request_stop()
        for sup in learners:
            sup.join(timeout=20)  # a learner finishes its round first; killed after 20 s
    if not uv.started:
        sys.exit("error: the server did not start (see the log above)")


def console_line(url: str, admin_key: str | None, with_key: bool) -> str:
    """Where the console is. With a key only loopwise holds (the learner's) and a terminal on stdout, the URL
    carries it in its fragment (``#key=...``: never sent to the server; the page keeps it for the tab and clears
    the address bar), as Jupyter prints its token: whoever reads this terminal is the operator. A key you chose
    is never printed, nor the internal one into a pipe or a log file."""
    from runtime.identity import InternalKey

    if not admin_key:
        return f"loopwise console: {url}/console (the admin API is off: start with --admin-key KEY to use it)"
    if isinstance(admin_key, InternalKey) and with_key:
        return f"loopwise console: {url}/console#key={admin_key}"
    if isinstance(admin_key, InternalKey):
        return f"loopwise console: {url}/console (start with --admin-key KEY to sign in to it)"
    return f"loopwise console: {url}/console (sign in with your --admin-key)"


def build_external_engine(settings: Settings, model_path: Path, model_id: str) -> tuple[Any, AdapterSettings]:
    """The SGLang or vLLM backend: launch servers if asked, check that at least one answers, and put every URL behind
    one replica set (``runtime/engines/replicas.py``). Exits with a message that says what to do when none answers."""
    from runtime.engines.http_engine import HTTPEngine
    from runtime.engines.launcher import LaunchError, ServerLauncher, start_all
    from runtime.engines.replicas import ReplicaSet

    backend, es, adapters = settings.server.backend, settings.engine, settings.adapters
    launchers: list[ServerLauncher] = []

    def stop_launched() -> None:
        for launcher in launchers:
            launcher.stop()

    atexit.register(stop_launched)  # also on sys.exit below; stop() is idempotent
    max_concurrency = es.max_batch_size + es.max_queue
    engines: list[HTTPEngine] = []
    if backend == "sglang":
        from runtime.engines.sglang import SGLangEngine, probe_server
        from runtime.engines.sglang_launcher import SGLangLauncher

        urls = list(dict.fromkeys([*([settings.sglang.url] if settings.sglang.url and not settings.sglang.launch else []), *es.urls]))
        if settings.sglang.launch:
            launchers.append(
                SGLangLauncher(
                    settings.sglang,
                    model_path,
                    max_lora_rank=adapters.max_lora_rank,
                    max_loaded_adapters=adapters.max_loaded_adapters,
                    dtype=es.dtype,
                )
            )
        elif not urls:
            sys.exit("error: --backend sglang needs --sglang-url URL (a running SGLang server), --engine-url URL, or --sglang-launch (start one)")
        try:
            urls = [*start_all(launchers), *urls]
        except LaunchError as exc:
            sys.exit(f"error: {exc}")
        infos = _probe_all(urls, lambda url: probe_server(url, settings.sglang))
        adapters = _fit_adapters_to_sglang(adapters, next(iter(infos.values())))
        engines = [SGLangEngine(url, model_path, model_id=model_id, settings=settings.sglang, max_concurrency=max_concurrency) for url in urls]
    else:
        from runtime.engines.vllm import VLLMEngine
        from runtime.engines.vllm import probe_server as probe_vllm
        from runtime.engines.vllm_launcher import vllm_launchers

        vs = settings.vllm
        urls = list(es.urls)
        if vs.launch:
            launchers.extend(
                vllm_launchers(
                    vs,
                    model_path,
                    served_name=model_id,
                    max_lora_rank=adapters.max_lora_rank,
                    max_loaded_adapters=adapters.max_loaded_adapters,
                    dtype=es.dtype,
                    max_model_len=es.max_model_len,
                    urls=tuple(urls),
                )
            )
            try:
                urls = start_all(launchers)
            except LaunchError as exc:
                sys.exit(f"error: {exc}")
        elif not urls:
            sys.exit("error: --backend vllm needs --engine-url URL (a running vLLM server; repeat it for replicas) or --vllm-launch (start one)")
        _probe_all(urls, lambda url: probe_vllm(url, vs.connect_timeout_s))
        engines = [VLLMEngine(url, model_path, model_id=model_id, settings=vs, max_concurrency=max_concurrency) for url in urls]
    # uvicorn re-raises SIGTERM after its shutdown, so code after serving never runs: stop launched servers in close()
    engine = ReplicaSet(engines, health_interval_s=es.health_interval_s, on_close=stop_launched if launchers else None)
    return engine, adapters


def _probe_all(urls: list[str], probe: Any) -> dict[str, Any]:
    """Each URL's startup answer; exits when none answers, warns about the ones that do not (they are watched)."""
    from runtime.engine import EngineError

    answers: dict[str, Any] = {}
    errors: list[str] = []
    for url in urls:
        try:
            answers[url] = asyncio.run(probe(url))
        except EngineError as exc:
            errors.append(str(exc))
    if not answers:
        sys.exit(f"error: {errors[0]}" + (f" (and {len(errors) - 1} more replicas down)" if len(errors) > 1 else ""))
    for err in errors:
        logging.getLogger("serve").warning("engine replica not answering at startup (it is retried): %s", err)
    return answers


def _fit_adapters_to_sglang(adapters: AdapterSettings, server_info: dict[str, Any]) -> AdapterSettings:
    """Keep one of SGLang's per-batch LoRA slots free for base-model requests (SGLang #23141)."""
    log = logging.getLogger("serve")
    if not server_info.get("enable_lora", True):
        log.warning("SGLang runs without --enable-lora: loading adapters will fail")
    slots = server_info.get("max_loras_per_batch")
    if not isinstance(slots, int) or adapters.max_loaded_adapters <= slots - 1:
        return adapters
    if slots < 2:
        sys.exit(
            f"error: SGLang runs with --max-loras-per-batch {slots}; base-model requests take that slot, so no adapter can be "
            "served safely (SGLang #23141). Restart SGLang with --max-loras-per-batch 2 or more."
        )
    log.warning(
        "SGLang has %d LoRA slots per batch and base requests take one: serving at most %d adapters (not --max-loaded-adapters %d)",
        slots,
        slots - 1,
        adapters.max_loaded_adapters,
    )
    return adapters.model_copy(update={"max_loaded_adapters": slots - 1})


# ``loopwise COMMAND ...`` (the console script): each command is a module's own entry point, imported when run
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {  # name -> (module:function, leading args, help)
    "serve": ("serve:main", (), "the server: OpenAI-compatible API, recording, adapters, agents (the flags of `python serve.py`)"),
    "learner": ("learner.__main__:main", (), "the learner: run | export | report (as `python -m learner`)"),
    "export": ("learner.__main__:main", ("export",), "recorded turn samples as JSONL for external trainers (`loopwise learner export`)"),
    "report": ("learner.__main__:main", ("report",), "a standalone HTML report of the learners and experiments (`loopwise learner report`)"),
    "eval": ("experiments.agent_eval:main", (), "evaluate a served agent on a task's problems (as `python -m experiments.agent_eval`)"),
    "leap": ("learner.leap:main", (), "LEAP's probe-and-prune report for recorded kernel probes (as `python -m learner.leap`)"),
}


def cli(argv: list[str] | None = None) -> None:
    """The ``loopwise`` console script: ``loopwise serve --model tiny``, ``loopwise learner run ...``, ``loopwise export ...``."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {COMMANDS[name][2]}" for name in COMMANDS]
        usage = "usage: loopwise COMMAND [ARGS...]   (loopwise COMMAND --help for its own flags)\n\ncommands:\n" + "\n".join(lines)
        if args and args[0] not in ("-h", "--help"):
            sys.exit(f"{usage}\n\nerror: unknown command {args[0]!r}")
        print(usage)
        return
    target, prefix, _ = COMMANDS[args[0]]
    module, _, func = target.partition(":")
    sys.argv[0] = f"loopwise {args[0]}"  # the program name a command's own --help and errors show
    code = getattr(importlib.import_module(module), func)([*prefix, *args[1:]])
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
