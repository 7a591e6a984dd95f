"""``python -m learner``: the learner's command line: ``run`` (the learner process), ``export`` and ``report``.

    python -m learner run --base-model PATH --admin-url URL --admin-key KEY [--family calc-lora --agent calc-agent]

runs ``learner.service.LearnerService`` (see there); ``serve.py`` starts it unless ``--no-learner``.

    python -m learner export --format jsonl [--data-dir .data] [--db PATH | --store URL] [--out FILE|-] [--since ISO-or-unix] [--rewarded]

writes one JSON object per recorded turn (``iter_samples`` of the store, in insertion order) to
``--out`` (default ``-``, stdout) and the count to stderr. The store is ``--store`` (a
``postgresql://`` URL, or a file path), ``--db`` or, by default, ``<data-dir>/interactions.db``; a
missing SQLite file is an error (export never creates one), and so is a database that cannot be reached: within a
few seconds, naming its host (``run`` checks its ``--store`` the same way before it starts anything). ``--since``
takes Unix seconds (``1767225600``) or an ISO 8601 time (``2026-01-01T00:00:00``; without a UTC
offset it is read as UTC) and keeps turns created at or after it. ``--rewarded`` keeps turns with a
reward on them or on their trajectory.

Each line::

    {"turn_id", "trajectory_id", "session_id", "index",            # where the turn sits
     "owner": str,           # the identity of the API key that made it (key-<hash>, or public)
     "context_ids": [int],   # the exact prompt token ids the engine was given (all earlier turns included)
     "output_ids": [int],    # the sampled response token ids (a final eos included)
     "logprobs": [float],    # behaviour-policy logprob of each output token (float32 precision); may be []
     "loss_mask": [0|1],     # per output token: 1 = model token to train on
     "adapter", "finish_reason", "created_at",
     "reward": float|null,             # the latest turn-level reward
     "trajectory_reward": float|null,  # the latest trajectory-level reward
     "rewards": [{reward_id, target, target_id, value, source, created_at, comment, idempotency_key, owner}],
     "trainable": bool,      # False when an agent run broke the prefix invariant (train on it at your own risk)
     "task_key": str|null}   # the agent run's task key (same problem → same key), for grouping

Reading it from other trainers (``datasets.load_dataset("json", data_files="samples.jsonl")``):
- TRL: ``context_ids`` → ``prompt_ids``, ``output_ids`` → ``completion_ids``, ``loss_mask`` →
  ``completion_mask``, ``logprobs`` → ``old_per_token_logps`` (the sampling logprobs, for the
  importance ratio), ``reward``/``trajectory_reward`` → the reward a GRPO-style advantage is computed
  from (group rows by whatever task key you use). Never re-tokenize: the ids are what the model saw.
- verl (``DataProto``): ``context_ids`` → ``prompts`` (left-pad to a batch), ``output_ids`` →
  ``responses`` (right-pad), ``loss_mask`` → ``response_mask``, ``logprobs`` → ``old_log_probs``,
  the reward → ``token_level_scores`` on the last response token; ``trajectory_id`` groups turns of
  one multi-turn rollout, ``index`` orders them.

Only ``jsonl`` for now; other formats are rejected.

    python -m learner report --data-dir D --out report.html

writes one standalone HTML file with the learner and experiment charts of the console (``learner/report.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from learner.config import ScheduleConfig
from learner.records.store import DEFAULT_DB_NAME, SqliteStore, db_path
from learner.records.store_open import open_store
from learner.records.store_sql import is_postgres_url

FORMATS = ("jsonl",)


def parse_time(text: str) -> float:
    """Unix seconds or an ISO 8601 time (naive = UTC) → Unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a Unix time or an ISO 8601 time: {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def add_model_flags(parser: Any, model: type[BaseModel]) -> None:
    """One flag per field of ``model`` that names its ``flag``: the field's type, default and description, as ``serve.py`` does."""
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if not extra.get("flag"):
            continue
        kind = next((t for t in (get_args(field.annotation) or (field.annotation,)) if t in (int, float, str)), str)
        parser.add_argument(
            str(extra["flag"]),
            dest=name,
            type=kind,
            default=field.default,
            help=f"{field.description}" + ("" if field.default is None else f" (default: {field.default})"),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m learner", description="loopwise learner")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write recorded turn samples for external trainers")
    ex.add_argument("--format", required=True, help="output format; only 'jsonl' for now")
    ex.add_argument("--data-dir", type=Path, default=Path(".data"), help="data directory (default .data)")
    ex.add_argument("--db", type=Path, default=None, help=f"store file (default <data-dir>/{DEFAULT_DB_NAME})")
    ex.add_argument("--store", default=os.environ.get("LOOPWISE_STORE"), help="the store: a postgresql:// URL (or LOOPWISE_STORE), else --db")
    ex.add_argument("--out", default="-", help="output file, or - for stdout (default)")
    ex.add_argument("--since", type=parse_time, default=None, help="only turns created at/after this (Unix seconds or ISO 8601, naive = UTC)")
    ex.add_argument("--rewarded", action="store_true", help="only turns with a reward on them or on their trajectory")
    run = sub.add_parser("run", help="the learner process: train an adapter family on rewarded agent runs, publish, gate, A/B")
    run.add_argument("--data-dir", type=Path, default=Path(".data"), help="the server's data directory (store, adapters)")
    run.add_argument("--admin-url", default="http://127.0.0.1:8000", help="the runtime's base URL")
    run.add_argument(
        "--store",
        default=os.environ.get("LOOPWISE_STORE"),
        help="the interaction store: a postgresql:// URL (or LOOPWISE_STORE); default <data-dir>/interactions.db",
    )
    run.add_argument(
        "--adapter-root", type=Path, default=None, help="where to publish adapters (a folder every runtime reads; default <data-dir>/adapters)"
    )
    run.add_argument("--admin-key", default=os.environ.get("LOOPWISE_ADMIN_KEY"), help="the runtime's admin key (or LOOPWISE_ADMIN_KEY)")
    run.add_argument("--base-model", type=Path, required=True, help="the served base model's folder")
    run.add_argument("--family", default="calc-lora", help="adapter family to train (published as family@N)")
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML/JSON with [lora], [trainer], [samples], [rerollouts], [leap], [svr], [svr_r1], [reves], [patr], [rods] tables "
        "and rollouts, overlap_sampling (learner.config)",
    )
    add_model_flags(run.add_argument_group("schedule (learner.config.ScheduleConfig)"), ScheduleConfig)
    run.add_argument("--once", action="store_true", help="run one update now and exit")
    run.add_argument(
        "--nproc", type=int, default=1, help="data-parallel ranks on this host (torch.distributed: gloo on CPU, nccl on GPU); rank 0 publishes"
    )
    run.add_argument("--log-format", choices=("auto", "console", "json"), default=os.environ.get("LOOPWISE_LOG_FORMAT", "auto"), help="log lines")
    run.add_argument("--log-level", default=os.environ.get("LOOPWISE_LOG_LEVEL", "info"), help="log level (debug shows each admin API call)")
    rep = sub.add_parser("report", help="a standalone HTML file with the learner and experiment charts, for sharing a run")
    rep.add_argument("--data-dir", type=Path, default=Path(".data"), help="data directory (default .data)")
    rep.add_argument("--db", type=Path, default=None, help=f"store file (default <data-dir>/{DEFAULT_DB_NAME})")
    rep.add_argument("--store", default=os.environ.get("LOOPWISE_STORE"), help="the store: a postgresql:// URL (or LOOPWISE_STORE), else --db")
    rep.add_argument("--out", type=Path, default=Path("report.html"), help="output file (default report.html)")
    return parser


def run(args: argparse.Namespace) -> int:
    from learner.config import LearnerSettings
    from learner.distributed import init_from_env, serve_worker, stop_workers
    from learner.logs import configure_logging

    chosen = configure_logging(args.log_level, args.log_format, process="learner")  # logs on stderr; stdout is for results
    if not args.admin_key:
        print("error: the learner needs the runtime's admin key (--admin-key or LOOPWISE_ADMIN_KEY)", file=sys.stderr)
        return 2
    try:
        ScheduleConfig.model_validate({k: getattr(args, k) for k in ScheduleConfig.model_fields if hasattr(args, k)})
    except ValidationError as exc:
        print(f"error: learner schedule: {exc}", file=sys.stderr)
        return 2
    data: dict[str, Any] = {"family": args.family}
    if args.config is not None:
        text = args.config.read_text()
        data.update(json.loads(text) if args.config.suffix == ".json" else tomllib.loads(text))
    if chosen == "json" or not sys.stderr.isatty():  # a progress bar in a log file (or relayed through serve.py) is noise
        data["trainer"] = {"progress": False, **data.get("trainer", {})}
    try:
        settings = LearnerSettings.model_validate(data)
    except ValueError as exc:
        print(f"error: learner config: {exc}", file=sys.stderr)
        return 2
    rr, est = settings.rerollouts, settings.trainer.estimator
    if not args.agent and ((rr.enabled and est in ("rtpo", "tcpo")) or settings.leap.enabled):
        what = f"estimator {est!r} with re-rollouts" if rr.enabled and est in ("rtpo", "tcpo") else "[leap] enabled"
        print(
            f"error: learner config: {what} needs --agent (its task runs are replayed or expanded); or set [rerollouts] enabled = false",
            file=sys.stderr,
        )
        return 2
    rank, _ = init_from_env()
    if rank > 0:  # a worker: trains its share of each update, rank 0 does everything else
        return serve_worker(args.base_model, settings.trainer, settings.lora)
    try:
        return _run_service(args, settings)
    finally:
        stop_workers()


def _run_service(args: argparse.Namespace, settings: Any) -> int:
    from learner.service import LearnerConfigError

    try:
        service = _service(args, settings)
    except ConnectionError as exc:  # the database went away since main() reached it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.once:
            record = service.update()
            print(json.dumps(record["gate"]), flush=True)
            return 0
        service.run_forever()
    except LearnerConfigError as exc:
        print(f"error: learner config: {exc}", file=sys.stderr)
        return 2
    return 0


def _service(args: argparse.Namespace, settings: Any) -> Any:
    from learner.service import LearnerService, ServiceConfig

    return LearnerService(
        ServiceConfig(
            data_dir=args.data_dir,
            store=args.store,
            adapter_root=args.adapter_root,
            admin_url=args.admin_url,
            admin_key=args.admin_key,
            base_model=args.base_model,
            settings=settings,
            agent=args.agent or None,
            task=args.task,
            min_new_trajectories=args.min_new_trajectories,
            poll_s=args.poll_s,
            gate_n=args.gate_n if args.agent else 0,
            gate_tolerance=args.gate_tolerance,
            ab_min_samples=args.ab_min_samples,
            ab_max_samples=args.ab_max_samples or None,
        )
    )


def export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        print(f"error: unsupported export format {args.format!r}; supported: {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    spec = args.store if args.store else (args.db if args.db is not None else db_path(args.data_dir))
    if is_postgres_url(spec):
        try:
            store = open_store(spec)
        except ConnectionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        path = store.display_url
    else:
        path = Path(spec)
        if not path.is_file():
            print(f"error: no interaction store at {path}", file=sys.stderr)
            return 2
        store = SqliteStore(path)
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    n = 0
    try:
        for sample in store.iter_samples(since=args.since, rewarded=True if args.rewarded else None):
            out.write(json.dumps(sample, separators=(",", ":"), ensure_ascii=False))
            out.write("\n")
            n += 1
    finally:
        if out is not sys.stdout:
            out.close()
        else:
            out.flush()
        store.close()
    print(f"exported {n} samples from {path} to {args.out}", file=sys.stderr)
    return 0


def report(args: argparse.Namespace) -> int:
    from learner.report import build_report

    if not args.data_dir.is_dir():
        print(f"error: no data directory at {args.data_dir}", file=sys.stderr)
        return 2
    try:
        counts = build_report(args.data_dir, args.out, args.store or args.db)
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['learners']} learner(s), {counts['updates']} update(s), {counts['experiments']} experiment(s)", file=sys.stderr)
    return 0


def unreachable(spec: str | None) -> str | None:
    """Why the PostgreSQL store ``spec`` names cannot be reached (within seconds, the host named, never the password);
    None when it can, or when ``spec`` is not a database URL."""
    if not is_postgres_url(spec):
        return None
    from learner.records.store_pg import probe  # psycopg is imported only for a PostgreSQL store

    try:
        probe(str(spec))
    except ConnectionError as exc:
        return str(exc)
    return None


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return export(args)
    if args.command == "report":
        return report(args)
    if args.command == "run":
        if args.nproc < 1:
            print(f"error: --nproc must be at least 1, got {args.nproc}", file=sys.stderr)
            return 2
        if (why := unreachable(args.store)) is not None:  # before any rank starts or any model loads
            print(f"error: {why}", file=sys.stderr)
            return 2
        if args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            from learner.distributed import launch

            return launch(args.nproc, _without_nproc(sys.argv[1:] if argv is None else argv))
        return run(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
