"""lm-evaluation-harness tasks by name -> results, with one clear error for what cannot run.

    manager = task_manager("my_tasks/")                 # lm-eval's tasks + the YAMLs under my_tasks/
    results = run(lm, ["lambada_openai", "my_task"], manager, num_fewshot=0)
    print(table(results)); metrics(results)            # {"eval/lambada_openai/acc": 0.68, ...}

Named tasks fetch their data from the Hugging Face hub; on a machine that cannot reach it, write a
task YAML over local files (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`) and pass
its folder as the include path. An unknown task, an include path with no task YAML in it and a
task whose data cannot be loaded are each one `EvalError` naming it.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence as Seq

from mesh_transformer.errors import UserError


class EvalError(UserError, ValueError):
    """An evaluation task cannot run (unknown name, no task files, data that cannot be loaded)."""


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise EvalError("evaluation needs lm-evaluation-harness: pip install 'mesh-transformer[eval]' "
                        "(or pip install lm-eval)") from None


def task_manager(include_path: Optional[str | os.PathLike] = None, names: Seq[str] = ()):
    """lm-eval's TaskManager: its own tasks plus the task YAMLs under `include_path` (if given).

    Indexing lm-eval's few thousand task files takes seconds (tens on a busy machine), so when every
    one of `names` is a task of the include path alone, the manager holds only those; and there is
    one manager per (path, scope) per process."""
    require_lm_eval()
    if include_path is not None:
        path = Path(include_path)
        if not path.is_dir():
            raise EvalError(f"--include-path {include_path}: not a directory")
        if not any(path.rglob("*.yaml")) and not any(path.rglob("*.yml")):
            raise EvalError(f"--include-path {include_path}: holds no task YAML files (*.yaml)")
        local = _manager(str(path.resolve()), False)
        if names and all(name in local.all_tasks for name in names):
            return local
    return _manager(str(Path(include_path).resolve()) if include_path is not None else None, True)


@functools.lru_cache(maxsize=8)
def _manager(include_path: Optional[str], defaults: bool):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path, include_defaults=defaults)


def load_tasks(names: Seq[str], manager) -> list:
    """lm-eval Task/Group objects for `names` (their data loaded now), or EvalError naming the first
    that is unknown or whose data cannot be loaded."""
    if not names:
        raise EvalError("no tasks given (--tasks t1,t2 or the config key eval_harness_tasks)")
    loaded = []
    for name in names:
        if name not in manager.all_tasks and not Path(name).is_file():
            hint = difflib.get_close_matches(name, manager.all_tasks, n=1)
            raise EvalError(f"unknown task {name!r}: not one of lm-eval's tasks nor in the include path"
                            + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        try:
            built = manager.load([name])
        except Exception as e:  # noqa: BLE001 - datasets' many ways to fail (offline, missing file, bad format)
            raise EvalError(f"task {name!r}: its data cannot be loaded ({_first_line(e)})") from None
        loaded += list(built["groups"].values()) or list(built["tasks"].values())
    return loaded


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def run(lm, tasks: Seq, manager, num_fewshot: Optional[int] = None, limit: Optional[float] = None,
        bootstrap_iters: int = 100_000, log_samples: bool = False, seed: int = 0) -> dict:
    """lm-eval's `simple_evaluate` of `lm` on `tasks` (names, or what `load_tasks` gave): its results
    dict (results, groups, configs, versions, n-shot, samples if `log_samples`, ...)."""
    from lm_eval import simple_evaluate

    _cache_compiled_templates()
    if all(isinstance(t, str) for t in tasks):
        tasks = load_tasks(tasks, manager)
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=num_fewshot, limit=limit,
                           bootstrap_iters=bootstrap_iters, log_samples=log_samples, random_seed=seed,
                           numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def _cache_compiled_templates() -> None:
    """lm-eval compiles a task's Jinja templates again for every document (`utils.apply_template`:
    four compiles per LAMBADA document, about as long as scoring it on a small model); compile each
    template string once. Rendering is unchanged (the same compiled template, fresh per call)."""
    from lm_eval import utils

    compile_once = getattr(utils.env.from_string, "compile_once", None)
    if compile_once is not None:
        return
    compile_fresh = utils.env.from_string
    compile_once = functools.lru_cache(maxsize=1024)(compile_fresh)

    def from_string(source, globals=None, template_class=None):
        if isinstance(source, str) and globals is None and template_class is None:
            return compile_once(source)
        return compile_fresh(source, globals, template_class)
    from_string.compile_once = compile_once
    utils.env.from_string = from_string


def table(results: dict) -> str:
    """lm-eval's results table (and its groups table, if any) as the harness prints it."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def write_json(results: dict, path: str | os.PathLike) -> None:
    """The results as lm-eval writes them (values it cannot serialise as strings)."""
    from lm_eval.utils import handle_non_serializable

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))


def metrics(results: dict, prefix: str = "eval") -> dict[str, float]:
    """{"<prefix>/<task>/<metric>": value} for every numeric metric (stderrs left out); a filter
    other than lm-eval's "none" is kept in the name ("exact_match_strict-match")."""
    out: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, comma, filt = key.partition(",")
                if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                name = metric if filt in ("", "none") else f"{metric}_{filt}"
                if math.isfinite(float(value)):
                    out[f"{prefix}/{task}/{name}"] = float(value)
    return out


def task_names(spec: Any) -> list[str]:
    """"t1,t2" or ["t1", "t2"] -> ["t1", "t2"]."""
    if isinstance(spec, str):
        spec = spec.split(",")
    return [s.strip() for s in spec if s and s.strip()]
