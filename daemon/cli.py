"""kvd: the KV cache daemon. Until the daemon lands it prints its version and help."""

from __future__ import annotations

import typer

from kvctl import __version__

app = typer.Typer(help="kvd hosts a model over a paged KV cache and serves it to kvctl and "
                       "OpenAI clients. The serving commands arrive with the daemon.",
                  no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context,
          version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    """kvd: the KV cache daemon."""
    if version:
        typer.echo(f"kvd {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


def main() -> None:
    app()
