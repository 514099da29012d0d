"""The commands that run the pipeline's flows: ``train`` (``flows.train``), ``evaluate``
(``flows.evaluate``) and ``rerun`` (``flows.rerun``). Each checks its inputs before Prefect, Ray or a
model starts, runs the flow, and prints what came out and where to look next."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from flows.cli.common import console, fail, on_interrupt, prepare, print_metrics
from ragen_core.run.service_watch import resume_hint


def train(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Run config (YAML); default configs/bandit-tiny.yaml. With --resume: only to check it is the run's own.",
        ),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (repeatable).")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Run id (or run directory) to continue; --set trainer.iterations=N extends it.",
        ),
    ] = None,
    backend: Annotated[
        Literal["ray", "local"] | None, typer.Option(help="ray (actors) or local (one process).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Name of the new run (letters, digits, -_.).")] = None,
) -> None:
    """Train a policy with StarPO (warm start, then iterations); --resume continues a killed run."""
    prepare()
    _check_train(config, set_ or [], resume, name)
    on_interrupt(resume_hint)
    from flows.train import TrainRequest
    from flows.train import train as train_flow

    t0 = time.perf_counter()
    result = train_flow(
        TrainRequest(
            config=str(config) if config else None,
            overrides=set_ or [],
            resume=resume,
            run_name=name,
            backend=backend,
        )
    )
    wall = time.perf_counter() - t0
    run_dir = Path(result["run_dir"])
    from ragen_core.run.run_dir import RunDir

    run = RunDir(run_dir)
    cfg = run.config()
    evals = {p.stem: run.read_json(p) for p in sorted((run_dir / "eval").glob("step_*.json"))}
    if evals:
        first, last = next(iter(evals)), list(evals)[-1]
        rows = {
            step: success_per_tag(evals[step], cfg.train.tags, cfg.val.tags)
            for step in dict.fromkeys((first, last))
        }
        print_metrics("validation success", rows)
    console().print(
        f"run {result['run_id']} ({run_dir}); MLflow run {result['mlflow_run_id']}; "
        f"{result['last_iteration']} iterations in {wall:.0f} s",
        soft_wrap=True,
    )
    _print_next_steps(result, cfg)


def _check_train(config: Path | None, overrides: list[str], resume: str | None, name: str | None) -> None:
    """Input errors fail here, before Prefect, Ray or a model starts (the command wrapper prints them)."""
    from ragen_core.config import DEFAULT_CONFIG, load_config
    from ragen_core.run.run_dir import find_run, run_name

    if resume is None:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)  # a config error before torch loads
        from ragen_core.run.preflight import preflight

        preflight(cfg)
        run_name(cfg, name, config or DEFAULT_CONFIG)
        return
    if name is not None:
        fail("--name names a new run; a resumed run keeps its name (drop --name)")
    from ragen_core.run.resume import resume_config
    from ragen_core.run.run_lock import RunLock
    from ragen_core.run.stages import check_resumable

    run = find_run(resume)
    RunLock(run.root).acquire().release()  # in use by another process: say so now
    cfg, _ = resume_config(run.root, run.config(), check_resumable(run), config, overrides)
    from ragen_core.run.preflight import PreflightError
    from ragen_core.run.state_checks import state_problems

    problems = state_problems(cfg.tracking)
    if problems:
        raise PreflightError("cannot resume this run:\n  " + "\n  ".join(problems))


def success_per_tag(
    metrics: dict[str, float], train_tags: list[str], val_tags: list[str]
) -> dict[str, float]:
    """A validation's success per tag, the tags the run did not train on marked ``(held out)``; no
    average over the tags, which would mix a tag the run trained on with one it did not."""
    return {
        tag + ("" if tag in train_tags else " (held out)"): metrics[f"val-env/{tag}/success"]
        for tag in val_tags
        if f"val-env/{tag}/success" in metrics
    }


def _print_next_steps(result: dict[str, Any], cfg: Any) -> None:
    """Where to look next, with the commands that do it."""
    run_id, last = result["run_id"], result["last_iteration"]
    from ragen_core.state_folder import mlflow_ui_url

    url = result.get("mlflow_url")
    lines = ["next:"]
    if url:
        local = url.startswith(mlflow_ui_url() + "/")
        lines.append(
            f"  browse it:   {'`ragen ui`, then open ' if local else ''}{url}{'' if local else ' (tracking server)'}"
        )
    lines.append(
        f"  evaluate it: ragen evaluate {run_id}   # on its validation tags, {','.join(cfg.val.tags)}"
    )
    for alias, uri in result.get("models", {}).items():  # the registered policies (MLflow's Models page)
        lines.append(f"  the {alias + ':':6s}  ragen evaluate {uri}")
    lines.append(f"  train on:    ragen train --resume {run_id} --set trainer.iterations={2 * max(last, 1)}")
    lines.append(f"  rerun:       ragen rerun {run_id} --iteration {max(last, 1)} --stage learn")
    if last >= 1:
        lines.append(
            f"  read it:     ragen show {run_id}   # iteration {last}'s rollouts, the filter's choices marked"
        )
    console().print("\n".join(lines), soft_wrap=True)


def evaluate(
    policy: Annotated[
        str,
        typer.Argument(
            help="RUN_ID[@STEP] (default: the last step), a run directory, a model folder, or a cached HF model name."
        ),
    ],
    tags: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated validation tags (default: a run's own validation tags, val.tags; "
            "for a model SimpleSokoban)."
        ),
    ] = None,
    n: Annotated[int, typer.Option(min=1, help="Validation seeds (episodes) per tag.")] = 64,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy).")] = 0.5,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=1, help="New tokens per turn (default: the run's rollout.max_new_tokens, else each tag's)."
        ),
    ] = None,
    engine: Annotated[Literal["hf", "vllm"], typer.Option(help="Rollout backend.")] = "hf",
    config: Annotated[
        Path | None,
        typer.Option(
            help="Play with this run config's agent settings (turns, actions, thinking), max_new_tokens and "
            "validation envs (val.env_overrides, val.seed); default: the run's own, or for a model each "
            "tag's catalogue defaults.",
        ),
    ] = None,
) -> None:
    """Evaluate any checkpoint or model on any validation tags (e.g. the generalisation tags).

    Success is reported per tag; tags the run did not train on are marked held out.
    """
    prepare()
    from ragen_core.models.policy_ref import locate_policy

    # Before Prefect, MLflow or torch load (seconds): an unknown run or model fails at once.
    ref = locate_policy(policy)
    from flows.evaluate import evaluate as evaluate_flow
    from ragen_core.run.evaluation import EvaluateRequest, check_before_work, check_tags, resolve_policy

    if ref.kind == "registry":  # looked up in the store: check it first
        check_before_work(None)

    # A bad tag, step or config fails here too, before Prefect starts.
    tag_list = [t.strip() for t in tags.split(",") if t.strip()] if tags is not None else None
    if tag_list is not None:
        check_tags(tag_list)
    resolved = resolve_policy(policy)
    check_before_work(resolved)  # the state folder and the store, before a model loads
    if tag_list is None:  # the run's own validation tags (a model: SimpleSokoban)
        tag_list = resolved.default_tags()
        check_tags(tag_list)
    if config is not None:
        from ragen_core.config import load_config

        load_config(config, [])
    # what starts now (Prefect, the store, the model) takes seconds before the first episode: say so
    console().print(
        f"evaluating {policy} on {', '.join(tag_list)} ({n} episodes per tag): starting Prefect and loading the policy ...",
        markup=False,
        soft_wrap=True,
    )
    result = evaluate_flow(
        EvaluateRequest(
            policy=policy,
            tags=tag_list,
            n_per_tag=n,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            engine=engine,
            config=str(config) if config else None,
        )
    )
    _print_evaluation(result)


def _print_evaluation(result: dict[str, Any]) -> None:
    """Each tag's metrics in a column of its own, headed by whether the policy trained on it; no
    aggregate over tags. The MLflow run id comes last, where a script or a reader looks for it."""
    metrics: dict[str, float] = result["metrics"]
    columns: dict[str, dict[str, float]] = {}
    for row in result["tags"]:
        tag, held = row["tag"], row["held_out"]
        head = f"{tag} (held out)" if held else (f"{tag} (trained on)" if held is False else tag)
        prefix = f"val-env/{tag}/"
        columns[head] = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
    print_metrics(f"evaluation of {result.get('label') or result['policy']}", columns)
    out = console()
    for row in result["tags"]:
        if row["success_means"]:
            out.print(f"success on {row['tag']}: {row['success_means']}", markup=False, soft_wrap=True)
    out.print(f"trajectories: {result['out_dir']}/eval.parquet", markup=False, soft_wrap=True)
    if result["mlflow_run_id"]:
        nested = result.get("mlflow_parent_run_id")
        where = f", nested under the training run {nested}" if nested else ""
        out.print(
            f"MLflow run of the evaluation: {result['mlflow_run_id']} (experiment "
            f"{result.get('mlflow_experiment')}{where}; `ragen ui` to browse it)",
            markup=False,
            soft_wrap=True,
        )


def rerun(
    run: Annotated[str, typer.Argument(help="Run id or run directory.")],
    iteration: Annotated[int, typer.Option(min=0, help="Iteration (evaluate: the step).")],
    stage: Annotated[
        Literal["rollout", "learn", "evaluate"], typer.Option(help="The stage to recompute.")
    ] = "learn",
) -> None:
    """Recompute one stage of one iteration from what is stored and compare with the stored result."""
    prepare()
    from ragen_core.run.rerun_checks import check_rerun
    from ragen_core.run.run_dir import find_run

    check_rerun(find_run(run), iteration, stage)  # a missing run or iteration fails before Prefect loads
    from flows.rerun import RerunRequest
    from flows.rerun import rerun as rerun_flow

    result = rerun_flow(RerunRequest(run=run, iteration=iteration, stage=stage))
    verdict = (
        "[green]identical[/]"
        if result["identical"]
        else "[yellow]non-deterministic server[/]"
        if result.get("verdict") == "non-deterministic server"
        else "[red]DIFFERENT[/]"
    )
    console().print(
        f"{stage} of iteration {iteration}: {verdict} ({result['detail']})\n"
        f"  rerun:  {result['output']}\n  stored: {result['stored']}"
        + (
            f"\n  MLflow: run {result['mlflow_run_id']}, nested under the training run"
            if result.get("mlflow_run_id")
            else ""
        )
    )
    if not result["identical"]:
        raise typer.Exit(2)
